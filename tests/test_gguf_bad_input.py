"""Bad GGUF input to the GGUF -> .cellm converter: truncated files, a wrong magic, unsupported
architectures and ggml types, missing and unused tensors. Each raises a cellm error naming the
problem, and the CLI exits 2 with a one-line message and no output file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cellm.convert import convert_gguf
from cellm.errors import FormatError, UnsupportedArchitecture
from gguf_helpers import BLOCK_SIZES, GGML_F32, GGML_Q2_K, run_convert_cli, write_gguf


def _tiny_gguf(path: Path, arch: str = "llama", gtype: int = GGML_F32) -> Path:
    block, block_bytes = BLOCK_SIZES[gtype]
    shape = (4, max(block, 8))
    md = {"general.architecture": arch, f"{arch}.embedding_length": 8}
    data = bytes(shape[0] * shape[1] // block * block_bytes)
    return write_gguf(path, md, [("token_embd.weight", gtype, shape, data)])


def _bad_inputs(tmp_path: Path) -> dict:
    good = _tiny_gguf(tmp_path / "good.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:-40])
    header_cut = tmp_path / "header_cut.gguf"
    header_cut.write_bytes(good.read_bytes()[:30])
    bad_magic = tmp_path / "magic.gguf"
    bad_magic.write_bytes(b"GGUG" + good.read_bytes()[4:])
    return {
        "truncated": (truncated, FormatError, "truncated"),
        "header_cut": (header_cut, FormatError, "truncated"),
        "bad_magic": (bad_magic, FormatError, "magic"),
        "arch": (_tiny_gguf(tmp_path / "g.gguf", "mamba"), UnsupportedArchitecture, "qwen2"),
        "ggml_type": (
            _tiny_gguf(tmp_path / "k.gguf", gtype=GGML_Q2_K),
            UnsupportedArchitecture,
            "Q2_K",
        ),
    }


@pytest.mark.parametrize("case", ["truncated", "header_cut", "bad_magic", "arch", "ggml_type"])
def test_bad_gguf_raises_and_cli_exits_2(case, tmp_path):
    path, exc, words = _bad_inputs(tmp_path)[case]
    with pytest.raises(exc, match=words):
        convert_gguf(path, tmp_path / "out.cellm")
    proc = run_convert_cli("--input", str(path), "--output", str(tmp_path / "out.cellm"))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0]
    assert not (tmp_path / "out.cellm").exists()


def test_unsupported_arch_names_the_supported_ones(tmp_path):
    supported = "gemma3, granite, lfm2, llama, qwen2, qwen3"
    with pytest.raises(UnsupportedArchitecture, match=rf"'mamba'.*{supported}"):
        convert_gguf(_tiny_gguf(tmp_path / "g.gguf", "mamba"), tmp_path / "o.cellm")


def test_missing_tensor_is_named(from_gguf, gguf_dir, tmp_path):
    from_gguf("qwen2")
    raw = (gguf_dir / "qwen2.gguf").read_bytes()
    # Rename one tensor so the file lacks blk.3.ffn_up.weight (and has an unknown one).
    broken = raw.replace(b"blk.3.ffn_up.weight", b"blk.3.ffn_zz.weight", 1)
    (tmp_path / "broken.gguf").write_bytes(broken)
    with pytest.raises(FormatError, match=r"missing tensor blk\.3\.ffn_up\.weight"):
        convert_gguf(tmp_path / "broken.gguf", tmp_path / "o.cellm")
    # An extra tensor the model does not use is an error too (config and weights disagree).
    from_gguf("llama")
    raw = (gguf_dir / "llama.gguf").read_bytes()
    extra = raw.replace(b"rope_freqs.weight", b"rope_fre_s.weight", 1)
    (tmp_path / "extra.gguf").write_bytes(extra)
    with pytest.raises(FormatError, match="does not use: rope_fre_s.weight"):
        convert_gguf(tmp_path / "extra.gguf", tmp_path / "o.cellm")
