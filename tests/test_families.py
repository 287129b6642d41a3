"""The family plug-ins against the engine's registry: one list of architectures, one
declaration of each model's tensors (the engine's), and a fixture for every model type."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cellm import _core
from cellm.convert.hf_config import normalise_config
from cellm.convert.weights import expected_tensors
from cellm.errors import FormatError, UnsupportedArchitecture
from cellm.families import FAMILIES, SUPPORTED_MODEL_TYPES, by_architecture
from conftest import FIXTURES, MODEL_FIXTURES


def fixture_model(name: str) -> dict:
    return normalise_config(json.loads((FIXTURES / name / "config.json").read_text()))


def test_python_families_are_exactly_the_engines_architectures():
    assert sorted(FAMILIES) == sorted(_core.architectures())


def test_every_model_type_has_a_reference_fixture():
    def model_type(config: Path) -> str:
        return str(json.loads(config.read_text())["model_type"])

    types = {model_type(FIXTURES / n / "config.json") for n in MODEL_FIXTURES}
    # Vision-language fixtures (tests/fixtures/mm) hold other kinds of model too.
    multimodal = {model_type(c) for c in (FIXTURES.parent / "mm").glob("*/config.json")}
    assert types | (multimodal & set(SUPPORTED_MODEL_TYPES)) == set(SUPPORTED_MODEL_TYPES)
    assert types <= set(SUPPORTED_MODEL_TYPES)


def test_every_builtin_chat_format_a_family_names_exists():
    from cellm.chat import BUILTIN_TEMPLATES

    assert {f.chat_format for f in FAMILIES.values()} <= set(BUILTIN_TEMPLATES)


def test_declaration_lists_tensors_in_forward_order_with_their_formats():
    plan = expected_tensors(fixture_model("llama"))
    names = [t.name for t in plan]
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "model.norm.weight"
    assert names.index("model.layers.0.self_attn.q_proj.weight") < names.index(
        "model.layers.1.input_layernorm.weight"
    )
    norm = plan[names.index("model.layers.0.input_layernorm.weight")]
    assert norm.formats == ("f32",) and norm.stored_format("q4_0") == "f32"
    q = plan[names.index("model.layers.0.self_attn.q_proj.weight")]
    assert {"f16", "q4_0", "q4_0x8"} <= set(q.formats) and q.stored_format("q4_0") == "q4_0"


def test_row_sliced_mla_tensors_refuse_interleaved_formats():
    """DeepSeek's absorbed key and value up-projections are multiplied a head's rows at a
    time, which 8-row groups would split, so the engine declares them without x8 formats."""
    plan = {t.name: t for t in expected_tensors(fixture_model("deepseek_v3"))}
    absorb = plan["model.layers.0.self_attn.kv_b_proj.k_absorb.weight"]
    assert "q4_0" in absorb.formats and not any(f.endswith("x8") for f in absorb.formats)
    router = next(t for n, t in plan.items() if n.endswith("mlp.gate.weight"))
    assert router.formats == ("f32",)


def test_declaration_follows_the_config():
    model = fixture_model("qwen2")
    names = {t.name for t in expected_tensors(model)}
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    assert "lm_head.weight" not in names  # tied
    untied = {t.name for t in expected_tensors({**model, "tie_word_embeddings": False})}
    assert untied - names == {"lm_head.weight"}


def test_bad_descriptions_get_the_engines_errors():
    model = fixture_model("llama")
    with pytest.raises(UnsupportedArchitecture, match="'mamba' is not supported"):
        expected_tensors({**model, "architecture": "mamba"})
    with pytest.raises(FormatError, match="heads"):
        expected_tensors({**model, "num_kv_heads": 3})
    with pytest.raises(FormatError, match="bad model description"):
        _core.expected_tensors("{not json")


def test_unknown_architecture_in_a_file_is_one_clear_error():
    with pytest.raises(UnsupportedArchitecture, match="supported: .*llama"):
        by_architecture("mamba")
