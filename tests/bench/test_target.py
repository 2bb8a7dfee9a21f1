"""`bench make-target`: the file appears whole under its name or not at all, and a made target is kept."""

from __future__ import annotations

import gguf
import pytest
from click.testing import CliRunner

from npumoe.bench.document import target as bench_target
from npumoe.bench.document.target import make_target, make_target_command
from npumoe.engine.synthetic import random_gguf
from npumoe.engine.synthetic.byte_tokenizer import build_byte_tokenizer

TINY = "64x8x2x32"  # a Qwen3-MoE geometry of these sizes, with the family's default vocabulary


def test_the_target_is_written_under_a_temporary_name_then_renamed(tmp_path):
    out = tmp_path / "cache" / "target.gguf"
    made = make_target(out, TINY, "q8_0", build_byte_tokenizer(), layers=1, show_progress=False)
    assert [path.name for path in out.parent.iterdir()] == ["target.gguf"]
    assert made["file_bytes"] == out.stat().st_size and made["tensor_bytes"] < made["file_bytes"]
    assert made["layers"] == 1 and made["peak_rss"] >= made["rss_before"] > 0
    matrices = {t.tensor_type for t in gguf.GGUFReader(out).tensors if len(t.shape) == 2}
    assert matrices == {gguf.GGMLQuantizationType.Q8_0}


def test_a_write_that_fails_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(path, *args, **kwargs):
        path.write_bytes(b"GGUF half")
        raise OSError("disk full")

    monkeypatch.setattr(random_gguf, "write_random_gguf", broken)
    with pytest.raises(OSError, match="disk full"):
        make_target(tmp_path / "target.gguf", TINY, "q4_0", build_byte_tokenizer(), layers=1, show_progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_made_target_is_kept_and_its_path_printed(tmp_path, monkeypatch):
    out = tmp_path / "target.gguf"
    out.write_bytes(b"made before")
    writes: list[object] = []
    monkeypatch.setattr(bench_target, "make_target", lambda *args, **kwargs: writes.append(args))
    result = CliRunner().invoke(make_target_command, ["--out", str(out)])
    assert result.exit_code == 0 and result.stdout.strip() == str(out)
    assert writes == [] and out.read_bytes() == b"made before"


def test_a_bpe_tokenizer_is_written_with_its_merges_which_llama_cpp_needs(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(BPE(vocab, [("a", "b"), ("ab", "c")])))
    out = tmp_path / "target.gguf"
    make_target(out, TINY, "q8_0", tokenizer, layers=1, show_progress=False)
    merges = gguf.GGUFReader(out).fields["tokenizer.ggml.merges"]
    assert [bytes(merges.parts[i]).decode() for i in merges.data] == ["a b", "ab c"]
