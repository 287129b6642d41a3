"""Checkpoints as their makers publish them: Qwen3.5's `Qwen3_5ForConditionalGeneration`
(`qwen3_5`, the text model under `model.language_model.`, a vision tower beside it) and
Granite 4.0 (`granitemoehybrid`, layer types spelled `mamba`/`attention`). Their logits are
checked against transformers by tests/test_parity.py (fixtures `qwen3_5_vlm`,
`granitemoehybrid`, `granitemoehybrid_attn`); here, what conversion leaves out and says, and
the config rules against transformers' own config classes."""

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


GRANITE = FIXTURES / "granitemoehybrid"


def granite_config(**edits: object) -> dict:
    import json

    return {**json.loads((GRANITE / "config.json").read_text()), **edits}


def test_granite_layer_spellings_and_mamba_shape_follow_transformers() -> None:
    """Published Granite 4.0 configs say `mamba`/`attention` and `mamba_d_head: auto`;
    transformers' config class remaps and derives them, and so must the description."""
    from cellm.convert.hf_config import normalise_config

    transformers = pytest.importorskip("transformers")
    published = ["mamba", "attention", "mamba", "mamba", "attention", "mamba"]
    config = granite_config(layer_types=published, mamba_d_head="auto")
    hf = transformers.GraniteMoeHybridConfig(
        **{k: v for k, v in config.items() if k not in ("model_type", "time_step_limit")}
    )
    model = normalise_config(config)
    assert model["layer_types"] == hf.layer_types
    assert model["mamba"]["head_dim"] == hf.mamba_d_head == 16
    assert model["intermediate_size"] == hf.shared_intermediate_size
    assert model["rope_layers"] == [False] * 6  # position_embedding_type "nope"
    assert (model["mamba"]["dt_min"], model["mamba"]["dt_max"]) == (0.0, None)
    limited = normalise_config(granite_config(time_step_limit=[0.001, 0.1]))["mamba"]
    assert (limited["dt_min"], limited["dt_max"]) == (0.001, 0.1)


@pytest.mark.parametrize(
    ("edits", "needle"),
    [
        ({"num_local_experts": 4}, "routed experts"),
        ({"mamba_d_head": 12}, "mamba_n_heads \\* mamba_d_head"),
        ({"hidden_act": "gelu_pytorch_tanh"}, "need hidden_act silu"),
        ({"time_step_limit": [0.0, "lots"]}, "time_step_limit holds"),
    ],
)
def test_granite_refusals(edits: dict, needle: str) -> None:
    from cellm.convert.hf_config import normalise_config
    from cellm.errors import CellmError

    with pytest.raises(CellmError, match=needle):
        normalise_config(granite_config(**edits))


def test_gemma4_as_published_runs_its_text_model(tmp_path: Path) -> None:
    """Gemma 4 as published (`Gemma4ForConditionalGeneration`): the gemma4_text fixture's
    weights under `model.language_model.`, towers beside them and K/V projections on a
    KV-shared layer (as transformers' checkpoints may hold), its config in `text_config`. The
    text model's logits are the fixture's reference (transformers computes text-only input
    through the same text model)."""
    import json

    import numpy as np

    from cellm import LLM
    from conftest import Reference

    src = tmp_path / "gemma4"
    shutil.copytree(FIXTURES / "gemma4", src)
    text = json.loads((src / "config.json").read_text())
    config = {"model_type": "gemma4", "text_config": text, "vision_config": {}}
    (src / "config.json").write_text(json.dumps(config))
    tensors = {
        "model.language_model." + k[len("model.") :]: v
        for k, v in load_file(src / "model.safetensors").items()
    }
    extra = {
        "model.vision_tower.encoder.weight": tensors["model.language_model.norm.weight"],
        "model.embed_audio.embedding_projection.weight": tensors[
            "model.language_model.norm.weight"
        ],
        # Layer 4 reads layer 3's cache (the fixture's num_kv_shared_layers 2).
        "model.language_model.layers.4.self_attn.k_proj.weight": tensors[
            "model.language_model.layers.3.self_attn.k_proj.weight"
        ],
    }
    save_file({**tensors, **extra}, src / "model.safetensors", metadata={"format": "pt"})
    out = convert_hf(src, tmp_path / "g.cellm", "f32")
    assert read_header(out)["source"]["left_out"] == {
        "Gemma 4's vision tower; cellm runs its text model only": 1,
        "Gemma 4's audio tower; cellm runs its text model only": 1,
        "K/V projections of KV-shared layers, which read an earlier layer's cache": 1,
    }
    ref = Reference("gemma4")
    llm = LLM(out, kv_encoding="f32")
    for i in range(len(ref.prompts)):
        assert np.abs(llm.logits(ref.sequence(i)) - ref.logits[i]).max() < 1e-3
