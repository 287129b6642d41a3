"""The HF -> .cellm converter's RoPE description: inverse frequencies of the default, llama3,
linear, dynamic and yarn rope types re-derived from HF transformers' formulas, legacy config
spellings, unsupported types, and SmolLM3's per-layer NoPE pattern.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cellm.convert import convert_hf, read_header
from cellm.errors import UnsupportedArchitecture
from convert_helpers import DELETE, FIXTURES, copy_fixture, edit_json


def hf_llama3_inv_freq(theta, dim, factor, low_ff, high_ff, old_len) -> np.ndarray:
    """transformers' _compute_llama3_parameters, transcribed to numpy float32."""
    f32 = np.float32
    inv_freq = f32(1.0) / (f32(theta) ** (np.arange(0, dim, 2).astype(f32) / f32(dim)))
    low_freq_wavelen = old_len / low_ff
    high_freq_wavelen = old_len / high_ff
    wavelen = f32(2 * math.pi) / inv_freq
    inv_freq_llama = np.where(wavelen > f32(low_freq_wavelen), inv_freq / f32(factor), inv_freq)
    smooth = (f32(old_len) / wavelen - f32(low_ff)) / f32(high_ff - low_ff)
    smoothed = (f32(1) - smooth) * inv_freq_llama / f32(factor) + smooth * inv_freq_llama
    medium = (wavelen >= f32(high_freq_wavelen)) & (wavelen <= f32(low_freq_wavelen))
    return np.where(medium, smoothed, inv_freq_llama)


def test_llama3_inv_freq_matches_hf_formula(tmp_path: Path) -> None:
    header = read_header(convert_hf(FIXTURES / "llama", tmp_path / "m.cellm", dtype="f32"))
    rp = json.loads((FIXTURES / "llama" / "config.json").read_text())["rope_parameters"]
    expected = hf_llama3_inv_freq(
        rp["rope_theta"],
        16,
        rp["factor"],
        rp["low_freq_factor"],
        rp["high_freq_factor"],
        rp["original_max_position_embeddings"],
    )
    got = np.array(header["model"]["rope"]["inv_freq"], dtype=np.float64)
    # float32 values, stored exactly in the JSON
    assert np.array_equal(got.astype(np.float32).astype(np.float64), got)
    np.testing.assert_allclose(got, expected, rtol=2e-7)
    # the fixture's parameters put frequencies in all three llama3 bands
    plain = 1.0 / (rp["rope_theta"] ** (np.arange(0, 16, 2) / 16))
    assert got[0] == pytest.approx(plain[0])
    assert got[-1] == pytest.approx(plain[-1] / rp["factor"], rel=1e-6)
    assert np.any((got < plain * 0.99) & (got > plain / rp["factor"] * 1.01))


@pytest.mark.parametrize("type_key", ["type", "rope_type"])
def test_legacy_rope_spelling(type_key: str, tmp_path: Path) -> None:
    src = copy_fixture("llama", tmp_path)
    config = json.loads((src / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    params[type_key] = params.pop("rope_type")
    config["rope_scaling"] = params
    (src / "config.json").write_text(json.dumps(config))

    new = read_header(convert_hf(src, tmp_path / "legacy.cellm"))["model"]["rope"]
    ref = read_header(convert_hf(FIXTURES / "llama", tmp_path / "ref.cellm"))["model"]["rope"]
    assert new == ref


def _rope_of(tmp_path: Path, name: str, **config_changes: Any) -> dict[str, Any]:
    src = tmp_path / name
    if not src.exists():
        shutil.copytree(FIXTURES / "qwen2", src)
    edit_json(src / "config.json", **config_changes)
    return read_header(convert_hf(src, tmp_path / f"{name}.cellm"))["model"]["rope"]


def test_linear_dynamic_and_legacy_default_rope(tmp_path: Path) -> None:
    theta, dim = 10000.0, 16
    plain = 1.0 / (theta ** (np.arange(0, dim, 2) / dim))
    legacy = _rope_of(tmp_path, "a", rope_parameters=DELETE, rope_theta=theta)
    assert legacy["type"] == "default" and legacy["theta"] == theta
    np.testing.assert_allclose(legacy["inv_freq"], plain, rtol=1e-6)

    linear = _rope_of(
        tmp_path, "b", rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": theta}
    )
    np.testing.assert_allclose(linear["inv_freq"], plain / 4.0, rtol=1e-6)

    dynamic = _rope_of(
        tmp_path, "c", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": theta}
    )
    assert dynamic["type"] == "dynamic"
    np.testing.assert_allclose(dynamic["inv_freq"], plain, rtol=1e-6)


def test_yarn_rope(tmp_path: Path) -> None:
    theta, dim, factor, orig = 10000.0, 16, 4.0, 512
    rope = _rope_of(
        tmp_path,
        "y",
        rope_parameters={
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": orig,
            "rope_theta": theta,
        },
    )

    # transformers' _compute_yarn_parameters with default beta_fast=32, beta_slow=1.
    def corr(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), dim - 1)
    pos = theta ** (np.arange(0, dim, 2) / dim)
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    extra = 1 - ramp
    expected = (1 / (factor * pos)) * (1 - extra) + (1 / pos) * extra
    np.testing.assert_allclose(rope["inv_freq"], expected, rtol=1e-6)
    assert rope["attention_factor"] == pytest.approx(0.1 * math.log(factor) + 1.0)


def test_unsupported_rope_type(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedArchitecture, match="longrope"):
        _rope_of(
            tmp_path,
            "l",
            rope_parameters={
                "rope_type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [1.0] * 8,
            },
        )


def test_smollm3_rope_layers_from_interval(tmp_path: Path) -> None:
    src = copy_fixture("smollm3", tmp_path)
    edit_json(src / "config.json", no_rope_layers=DELETE, no_rope_layer_interval=2)
    header = read_header(convert_hf(src, tmp_path / "m.cellm"))
    assert header["model"]["rope_layers"] == [True, False, True, False]
