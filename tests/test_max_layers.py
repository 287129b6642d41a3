"""`max_layers` / `infer --max-layers N`: the forward runs the first N layers, then the final
norm and the head. Checked against the same checkpoint cut to N layers (config and tensors),
converted and run whole: that model is exactly "the first N layers, then the head"."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cellm import LLM, InvalidArgument
from cellm.convert import convert_hf
from conftest import FIXTURES, Reference
from test_bad_input import assert_one_line_error, cli

# Same weights, same math, one path: only summation order may differ.
ATOL = 1e-5


def cut(name: str, layers: int, tmp_path: Path) -> Path:
    """The fixture with only its first `layers` layers."""
    d = tmp_path / f"{name}-{layers}"
    shutil.copytree(FIXTURES / name, d)
    config = json.loads((d / "config.json").read_text())
    config["num_hidden_layers"] = layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:layers]
    (d / "config.json").write_text(json.dumps(config))
    tensors = load_file(d / "model.safetensors")
    kept = {
        k: v
        for k, v in tensors.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    save_file(kept, d / "model.safetensors", metadata={"format": "pt"})
    return d


# A llama-like model, and a hybrid one (recurrent state and KV layers, cut between them).
@pytest.mark.parametrize(("name", "layers"), [("llama", 2), ("granitemoehybrid", 3)])
def test_first_layers_equal_the_cut_model(name: str, layers: int, tmp_path, converted) -> None:
    ref = Reference(name)
    seq, n = ref.sequence(1), len(ref.prompts[1]["input_ids"])
    limited = LLM(converted(name, "f32"), kv_encoding="f32", max_layers=layers)
    small = convert_hf(cut(name, layers, tmp_path), tmp_path / "cut.cellm", "f32")
    want = LLM(small, kv_encoding="f32").logits(seq)
    got = limited.logits(seq)
    assert np.abs(got - want).max() < ATOL
    # And through prefill + token-by-token decode (the sessions' caches of the cut layers).
    engine = limited._engine
    session = engine.create_session()
    rows = [engine.step([(session, seq[:n])])[0]] + [
        engine.step([(session, [t])])[0] for t in seq[n:]
    ]
    assert np.abs(np.stack(rows) - want[n - 1 :]).max() < ATOL
    # Not the whole model's logits: the cut is real.
    assert np.abs(got - ref.logits[1]).max() > 0.1


def test_all_layers_is_the_whole_model(converted) -> None:
    ref = Reference("gemma4")
    llm = LLM(converted("gemma4", "f32"), kv_encoding="f32", max_layers=6)
    assert np.abs(llm.logits(ref.sequence(0)) - ref.logits[0]).max() < 1e-3


def test_out_of_range_is_refused(converted) -> None:
    with pytest.raises(
        InvalidArgument, match=r"max_layers must be 1 to 4 \(the model's layers\), not 5"
    ):
        LLM(converted("llama", "f32"), max_layers=5)
    with pytest.raises(InvalidArgument, match="max_layers must be a positive integer"):
        LLM(converted("llama", "f32"), max_layers=0)


def test_infer_flag(converted) -> None:
    model = str(converted("llama", "f32"))
    args = ("cellm.infer", "--model", model, "--tokens", "1,2,3", "--gen", "2")
    ok = cli(*args, "--max-layers", "1", "--temperature", "0")
    assert ok.returncode == 0, ok.stderr
    assert_one_line_error(cli(*args, "--max-layers", "9"), "max_layers must be 1 to 4")
    assert_one_line_error(cli(*args, "--max-layers", "0"), "--max-layers")
