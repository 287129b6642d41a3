"""Gemma 4's description rules against transformers' own `Gemma4TextConfig` (installed without
torch): which layers share which KV cache, each layer's head width, the `proportional` RoPE,
and the refusals. The model's numbers are checked by tests/test_parity.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cellm.convert.hf_config import normalise_config
from cellm.errors import FormatError, UnsupportedArchitecture

transformers = pytest.importorskip("transformers")

BASE: dict[str, Any] = {
    "model_type": "gemma4_text",
    "vocab_size": 100,
    "vocab_size_per_layer_input": 100,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "hidden_size_per_layer_input": 8,
    "sliding_window": 8,
}


def describe(**edits: Any) -> tuple[dict[str, Any], Any]:
    """Our description and transformers' config object of the same config.json."""
    config = {**BASE, **edits}
    hf = transformers.Gemma4TextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    return normalise_config(config), hf


@pytest.mark.parametrize(
    ("layers", "shared"),
    [
        (["sliding_attention", "full_attention"] * 4, 3),
        (["sliding_attention"] * 4 + ["full_attention"] + ["sliding_attention"] * 2, 2),
        (["sliding_attention", "full_attention"] * 3, 0),
    ],
)
def test_kv_sharing_and_head_widths_follow_transformers(layers: list[str], shared: int) -> None:
    model, hf = describe(
        num_hidden_layers=len(layers),
        layer_types=layers,
        num_kv_shared_layers=shared,
        global_head_dim=64,
        use_double_wide_mlp=True,
    )
    g = model["gemma4"]
    modes = hf.kv_sharing_modes
    assert [src is not None for src in g["kv_from"]] == [m == "reuse" for m in modes]
    for i, src in enumerate(g["kv_from"]):
        if src is not None:  # the last layer of the same type that stores its cache
            store = [j for j, m in enumerate(modes) if m == "store"]
            assert src in store and hf.layer_types[src] == hf.layer_types[i]
    assert g["head_dims"] == [hf.per_layer_config[i].head_dim for i in range(len(layers))]
    assert model["layer_types"] == hf.layer_types  # the last one forced full, as HF does
    assert g["mlp_widths"] == [96 if m == "reuse" else 48 for m in modes]
    assert model["head_dim"] == 64 and model["attention_scale"] == 1.0


def test_proportional_rope_pads_with_zero_frequencies() -> None:
    """transformers' _compute_proportional_rope_parameters in float64: the first
    int(0.25 * 64 // 2) = 8 frequencies base^(-2i/64), then zeros to 32."""
    model, _ = describe(
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], global_head_dim=64
    )
    inv = np.array(model["rope"]["inv_freq"])
    want = np.concatenate([1e6 ** (-np.arange(0, 16, 2) / 64), np.zeros(24)])
    assert inv.shape == (32,) and np.allclose(inv, want, rtol=1e-6, atol=0)
    local = np.array(model["rope_local"]["inv_freq"])
    assert np.allclose(local, 1e4 ** (-np.arange(0, 16, 2) / 16), rtol=1e-6)
    # sqrt(8) as the f32 checkpoint holds it (HF casts the scale to the table's dtype).
    per_layer = {"width": 8, "embed_scale": float(np.float32(8**0.5))}
    assert model["gemma4"]["per_layer_input"] == per_layer
    assert abs(model["embedding_multiplier"] - 32**0.5) < 1e-6


@pytest.mark.parametrize(
    ("edits", "error", "needle"),
    [
        ({"enable_moe_block": True}, UnsupportedArchitecture, "MoE block"),
        ({"num_kv_shared_layers": 2}, UnsupportedArchitecture, "leaves no layer"),
        ({"vocab_size_per_layer_input": 50}, UnsupportedArchitecture, "vocab_size_per_layer"),
        (
            {"per_layer_config": {"1": {"head_dim": 64, "num_key_value_heads": 2}}},
            UnsupportedArchitecture,
            "only head_dim",
        ),
        ({"per_layer_config": {"7": {"head_dim": 64}}}, FormatError, "bad entry '7'"),
    ],
)
def test_refusals_name_the_key(edits: dict[str, Any], error: type, needle: str) -> None:
    config = {**BASE, "num_hidden_layers": 2, **edits}
    with pytest.raises(error, match=needle):
        normalise_config(config)


def test_fixture_describes_as_transformers_configures(tmp_path: Path) -> None:
    import json

    from conftest import FIXTURES

    config = json.loads((FIXTURES / "gemma4" / "config.json").read_text())
    model = normalise_config(config)
    hf = transformers.Gemma4TextConfig.from_pretrained(FIXTURES / "gemma4")
    assert model["gemma4"]["head_dims"] == [hf.per_layer_config[i].head_dim for i in range(6)]
    assert model["gemma4"]["kv_from"] == [None, None, None, None, 3, 2]
