"""Checkpoints as their makers publish them: Qwen3.5's `Qwen3_5ForConditionalGeneration`
(`qwen3_5`, the text model under `model.language_model.`, a vision tower beside it). Its
logits are checked against transformers by tests/test_parity.py (fixture `qwen3_5_vlm`); here,
what conversion leaves out and says."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from cellm.convert import convert_hf, read_header
from cellm.convert.__main__ import main as convert_main
from cellm.errors import FormatError
from conftest import FIXTURES

VISION_NOTE = "Qwen3.5's vision tower (model.visual.*); cellm runs its text model only"


def test_the_vision_tower_is_left_out_with_a_note(tmp_path: Path, capsys) -> None:
    out = tmp_path / "q.cellm"
    assert convert_main(["--input", str(FIXTURES / "qwen3_5_vlm"), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    visual = [n for n in load_file(FIXTURES / "qwen3_5_vlm" / "model.safetensors") if "visual" in n]
    assert f"note: left out {len(visual)} checkpoint tensors: {VISION_NOTE}" in printed
    assert read_header(out)["source"]["left_out"] == {VISION_NOTE: len(visual)}
    assert read_header(out)["model"]["model_type"] == "qwen3_5"


def test_a_text_checkpoint_with_stray_tensors_is_still_refused(tmp_path: Path) -> None:
    """Leaving tensors out is the published wrapper's rule, not a blanket licence."""
    src = tmp_path / "qwen3_5"
    shutil.copytree(FIXTURES / "qwen3_5", src)
    tensors = load_file(src / "model.safetensors")
    tensors["model.visual.pos_embed.weight"] = tensors["model.norm.weight"]
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(FormatError, match="does not use: model.visual.pos_embed.weight"):
        convert_hf(src, tmp_path / "x.cellm", "f32")
