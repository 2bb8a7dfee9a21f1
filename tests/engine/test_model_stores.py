"""Finding the GGUF models a person already has (Ollama's store, LM Studio's folder, the Hugging Face cache), the
names they get, and those names resolving to the files where the stores keep them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import pytest
from support.gguf_stores import fake_home, hf_download, lmstudio_download, ollama_manifest, ollama_pull, tiny_ggufs

from npumoe.engine.errors import ModelError
from npumoe.engine.loading import model_stores
from npumoe.engine.loading.gguf_load import gguf_config, is_gguf
from npumoe.engine.loading.gguf_summary import HEADER_ERRORS, not_runnable, summarize
from npumoe.engine.loading.model_stores import find_models, store_file
from npumoe.engine.loading.resolve import model_folder

LIBRARY = ("registry.ollama.ai", "library")


@pytest.fixture(scope="module")
def ggufs(tiny, tmp_path_factory) -> dict[str, Path]:
    return tiny_ggufs(tiny("qwen3_moe"), tmp_path_factory.mktemp("ggufs"))


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    return fake_home(tmp_path, monkeypatch)


def test_a_model_in_each_store_is_found_under_a_name_that_resolves_to_the_stores_own_file(home, ggufs):
    blob = ollama_pull(home / ".ollama/models", ggufs["qwen3moe"], *LIBRARY, "tiny-moe", "latest")
    link = hf_download(home / ".cache/huggingface/hub", "org/Tiny-Llama-GGUF", ggufs["llama"], "q8/tiny-llama.gguf")
    file = lmstudio_download(home / ".lmstudio/models", "pub/tiny-moe-GGUF/tiny-moe-Q8_0.gguf", ggufs["qwen3moe"])

    found = find_models()
    names = {"ollama:tiny-moe:latest": blob, "lmstudio:pub/tiny-moe-GGUF/tiny-moe-Q8_0.gguf": file,
             "hf:org/Tiny-Llama-GGUF/q8/tiny-llama.gguf": link}
    assert [(m.name, m.files, m.problem) for m in found.models] == [(n, (p,), None) for n, p in names.items()]
    for name, path in names.items():
        assert store_file(name) == path
        assert model_folder(name, allow_download=False, trust_remote_code=False) == (path, name)
    assert {home / ".ollama/models", home / ".lmstudio/models", home / ".cache/huggingface/hub"} <= set(found.searched)


def test_an_ollama_blob_has_no_suffix_and_reads_as_gguf(home, ggufs):
    blob = ollama_pull(home / ".ollama/models", ggufs["qwen3moe"], *LIBRARY, "tiny-moe", "latest")
    assert blob.suffix == "" and is_gguf(blob)
    assert gguf_config(blob).model_type == "qwen3_moe"  # transformers reads it by name too, suffix or not
    assert not is_gguf(home)


def test_the_places_the_environment_and_lm_studio_settings_name_are_searched(home, ggufs, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "big-disk/ollama"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    moved = tmp_path / "lmstudio-data"  # LM Studio's data folder, moved: the pointer says where
    (home / ".lmstudio-home-pointer").write_text(f"{moved}\n")
    moved.mkdir()
    (moved / "settings.json").write_text(json.dumps({"downloadsFolder": str(tmp_path / "my-ggufs")}))
    ollama_pull(tmp_path / "big-disk/ollama", ggufs["qwen3moe"], "hf.co", "org", "Tiny-GGUF", "Q8_0")
    ollama_pull(tmp_path / "big-disk/ollama", ggufs["llama"], "registry.ollama.ai", "someone", "llama", "tiny")
    hf_download(tmp_path / "hf-home/hub", "org/Tiny-GGUF", ggufs["llama"], "tiny.gguf")
    lmstudio_download(tmp_path / "my-ggufs", "pub/repo/tiny.gguf", ggufs["qwen3moe"])

    found = find_models()
    assert [m.name for m in found.models] == ["ollama:hf.co/org/Tiny-GGUF:Q8_0", "ollama:someone/llama:tiny",
                                              "lmstudio:pub/repo/tiny.gguf", "hf:org/Tiny-GGUF/tiny.gguf"]
    assert all(store_file(m.name) == m.files[0] for m in found.models)
    assert found.searched[0] == tmp_path / "big-disk/ollama" and tmp_path / "hf-home/hub" in found.searched
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # over HF_HOME
    assert model_stores.hf_hub_cache() == tmp_path / "elsewhere"


def test_an_ollama_name_without_a_tag_means_latest_and_a_name_that_climbs_out_is_refused(home, ggufs):
    blob = ollama_pull(home / ".ollama/models", ggufs["qwen3moe"], *LIBRARY, "tiny-moe", "latest")
    assert store_file("ollama:tiny-moe") == store_file("ollama:library/tiny-moe:latest") == blob
    for name in ("ollama:../../etc:passwd", "ollama:a/b/c/d:tag", "ollama:"):
        with pytest.raises(ModelError, match="not an Ollama model name"):
            store_file(name)
    with pytest.raises(ModelError, match="Ollama has no such model"):
        store_file("ollama:qwen3:30b-a3b")
    with pytest.raises(ModelError, match=r"expected lmstudio:publisher/repo/file\.gguf"):
        store_file("lmstudio:../x.gguf")


def test_a_split_model_is_one_entry_that_resolves_to_an_error_saying_why(home, ggufs):
    models = home / ".lmstudio/models"
    for part in (1, 2, 3):
        lmstudio_download(models, f"pub/big/big-Q4_K_M-{part:05d}-of-00003.gguf", ggufs["qwen3moe"])
    lmstudio_download(models, "pub/half/half-00001-of-00002.gguf", ggufs["qwen3moe"])

    found = {m.name: m for m in find_models().models}
    big_name = "lmstudio:pub/big/big-Q4_K_M-00001-of-00003.gguf"
    assert list(found) == [big_name, "lmstudio:pub/half/half-00001-of-00002.gguf"]
    big = found[big_name]
    assert big.split and len(big.files) == 3 and big.problem is None
    assert "half-00002-of-00002.gguf missing" in found["lmstudio:pub/half/half-00001-of-00002.gguf"].problem
    with pytest.raises(ModelError, match="split into 3 files, and the engine reads a GGUF model from one file"):
        model_folder(big.name, allow_download=False, trust_remote_code=False)
    with pytest.raises(ModelError, match="one part of a split model"):
        store_file("lmstudio:pub/big/big-Q4_K_M-00002-of-00003.gguf")


def test_damaged_manifests_and_missing_files_are_entries_with_the_reason_and_do_not_resolve(home, ggufs):
    root = home / ".ollama/models"
    ollama_manifest(root, "{not json", *LIBRARY, "broken", "latest")
    ollama_manifest(root, {"layers": [{"mediaType": "application/vnd.ollama.image.license", "digest": "x"}]},
                    *LIBRARY, "nomodel", "latest")
    ollama_manifest(root, {"layers": "nope"}, *LIBRARY, "odd", "latest")
    blob = ollama_pull(root, ggufs["qwen3moe"], *LIBRARY, "gone", "latest")
    blob.unlink()
    link = hf_download(home / ".cache/huggingface/hub", "org/Partial-GGUF", ggufs["llama"], "partial.gguf")
    os.unlink(link.resolve())  # the snapshot's link, to a blob that never finished

    problems = {m.name: m.problem for m in find_models().models}
    assert "cannot be read" in problems["ollama:broken:latest"]
    assert "has no model layer" in problems["ollama:nomodel:latest"]
    assert "not one Ollama writes" in problems["ollama:odd:latest"]
    assert "is missing" in problems["ollama:gone:latest"]
    assert "link to a missing file" in problems["hf:org/Partial-GGUF/partial.gguf"]
    for name, problem in problems.items():
        with pytest.raises(ModelError) as raised:
            store_file(name)
        assert str(raised.value) == f"{name}: {problem}"


def test_the_hugging_face_name_follows_refs_main(home, ggufs):
    cache = home / ".cache/huggingface/hub"
    old = hf_download(cache, "org/Tiny-GGUF", ggufs["llama"], "tiny.gguf", revision="1" * 40)
    new = hf_download(cache, "org/Tiny-GGUF", ggufs["qwen3moe"], "tiny.gguf", revision="2" * 40)
    assert store_file("hf:org/Tiny-GGUF/tiny.gguf") == new
    (cache / "models--org--Tiny-GGUF/refs/main").write_text("1" * 40)
    assert store_file("hf:org/Tiny-GGUF/tiny.gguf") == old
    with pytest.raises(ModelError, match="not found"):
        store_file("hf:org/Other-GGUF/tiny.gguf")


def test_the_summary_reads_the_header_and_says_whether_the_engine_runs_it(ggufs, tmp_path):
    moe, llama = summarize([ggufs["qwen3moe"]]), summarize([ggufs["llama"]])
    dense = [summarize([ggufs[arch]]) for arch in ("qwen3", "gemma3")]
    assert (moe.architecture, moe.quantization, moe.experts) == ("qwen3moe", "Q8_0", True)
    assert moe.disk_bytes == ggufs["qwen3moe"].stat().st_size and moe.size.expert_parameters > 0
    assert not_runnable(moe) is None
    assert (llama.architecture, llama.quantization, llama.experts) == ("llama", "F16", False)
    assert not_runnable(llama) is None  # dense: its FFN is one expert every token takes
    assert [(d.architecture, d.experts, not_runnable(d)) for d in dense] == [("qwen3", False, None),
                                                                              ("gemma3", False, None)]
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(ggufs["qwen3moe"].read_bytes()[:3000])
    for bad in (damaged, tmp_path / "missing.gguf"):
        with pytest.raises(HEADER_ERRORS):
            summarize([bad])


def test_a_store_that_cannot_be_read_is_said_and_the_others_are_still_listed(home, ggufs, monkeypatch):
    service = model_stores.OLLAMA_SERVICE_MODELS
    ollama_pull(service, ggufs["qwen3moe"], *LIBRARY, "theirs", "latest")
    ollama_pull(home / ".ollama/models", ggufs["qwen3moe"], *LIBRARY, "mine", "latest")
    is_file = Path.is_file

    def denied(path: Path) -> bool:  # as another user's folder can be (the tests run as root, who reads all)
        if path.is_relative_to(service):
            raise PermissionError(13, "Permission denied", str(path))
        return is_file(path)

    monkeypatch.setattr(Path, "is_file", denied)
    found = find_models()
    assert [m.name for m in found.models] == ["ollama:mine:latest"]
    assert len(found.unreadable) == 1 and found.unreadable[0].startswith(f"{service}: ")
    assert "Permission denied" in found.unreadable[0]


@pytest.mark.parametrize("digest", ["../../../secret.gguf", "sha256:../../../secret.gguf", f"sha256:{'A' * 64}",
                                    f"sha256:{'a' * 63}"])
def test_a_manifest_digest_that_is_not_a_sha256_names_no_file(home, ggufs, digest: str) -> None:
    """A digest is joined onto blobs/: unchecked, `../..` in it would name any file the user can read."""
    root = home / ".ollama/models"
    outside = home / "secret.gguf"  # what blobs/../../../secret.gguf reaches
    outside.write_bytes(ggufs["qwen3moe"].read_bytes())
    (root / "blobs").mkdir(parents=True)
    layer = {"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": 1}
    ollama_manifest(root, {"layers": [layer]}, *LIBRARY, "crafted", "latest")

    crafted = next(m for m in find_models().models if m.name == "ollama:crafted:latest")
    assert crafted.files == ()
    assert crafted.problem == (f"manifest {root / 'manifests' / Path(*LIBRARY, 'crafted', 'latest')} names its model "
                               f"layer by {digest!r}, not a sha256 digest (sha256:<64 hex digits>)")


def test_an_architecture_the_engine_does_not_read_is_named_with_those_it_reads_each_once(tmp_path):
    file = tmp_path / "phi3.gguf"
    writer = gguf.GGUFWriter(file, "phi3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert not_runnable(summarize([file])) == ("the engine does not read phi3 GGUF files (it reads gemma3, llama, "
                                               "qwen2, qwen2moe, qwen3, qwen3moe)")
