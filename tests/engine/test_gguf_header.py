"""A GGUF header is walked and its counts judged before gguf's reader builds a Python object for each of them."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from npumoe.engine.loading.gguf_header import MAX_ARRAY_ITEMS, HeaderRefused, read_gguf
from npumoe.engine.loading.gguf_summary import HEADER_ERRORS, summarize


def gguf_bytes(*, tensors: int = 0, keys: int = 1, body: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, keys) + body


def string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def uint8_array(key: str, count: int, present: int) -> bytes:
    """A key holding an array that claims `count` bytes, of which `present` are in the file."""
    return string(key) + struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT8, count) + bytes(present)


@pytest.fixture
def readers_built(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Each file gguf's reader is asked to read; the reader itself is never run on these files."""
    built: list[Path] = []

    def spy(path: Path, *args: object) -> None:
        built.append(path)
        raise AssertionError("gguf's reader was let loose on a header that claims more than a model's has")

    monkeypatch.setattr(gguf, "GGUFReader", spy)
    return built


def test_a_small_file_claiming_a_three_million_item_array_is_refused_before_the_reader_runs(
        tmp_path: Path, readers_built: list[Path]) -> None:
    crafted = tmp_path / "crafted.gguf"
    crafted.write_bytes(gguf_bytes(body=uint8_array("tokenizer.ggml.token_type", 3_000_000, 3_000_000)))

    with pytest.raises(HeaderRefused) as refused:
        summarize([crafted])  # what `model list` does with every file in a store
    assert str(refused.value) == (f"crafted.gguf: 'tokenizer.ggml.token_type' claims an array of 3,000,000 items; "
                                  f"a model's header holds at most {MAX_ARRAY_ITEMS:,} in one: not read")
    assert isinstance(refused.value, HEADER_ERRORS)  # `model list` shows it as a file it cannot read
    assert readers_built == []


@pytest.mark.parametrize(("tensors", "keys", "body", "why"), [
    (2**60, 0, b"", "it claims 1,152,921,504,606,846,976 tensors, over the 2,097,152 a model's header holds"),
    (1000, 0, b"", "it claims 1,000 tensors, more than the rest of the file can hold"),
    (0, 1, uint8_array("a", 100_000, 10), "it claims 100,000 items of 'a', more than the rest of the file can hold"),
    (0, 1, string("a") + struct.pack("<IQ", gguf.GGUFValueType.STRING, 2**40),
     "its header runs past the end of the file (at byte 45, 1,099,511,627,776 more bytes claimed)"),
])
def test_counts_and_lengths_the_file_cannot_hold_are_refused_by_name(
        tmp_path: Path, readers_built: list[Path], tensors: int, keys: int, body: bytes, why: str) -> None:
    crafted = tmp_path / "crafted.gguf"
    crafted.write_bytes(gguf_bytes(tensors=tensors, keys=keys, body=body))
    with pytest.raises(HeaderRefused) as refused:
        read_gguf(crafted)
    assert str(refused.value) == f"crafted.gguf: {why}: not read"
    assert readers_built == []


def test_a_header_like_a_real_models_is_read(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list([f"token{i}" for i in range(5000)])
    writer.add_token_types([1] * 5000)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype="float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reader = read_gguf(path)
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 5000
    assert [t.name for t in reader.tensors] == ["token_embd.weight"]
