"""BERT-style sentence encoders (all-MiniLM-L6-v2): learned absolute positions and token
types, post-LayerNorm layers, erf GELU. An encoder (`cellm.Embedder`), not a generator; the
pooler head and the saved position ids are left out (sentence embeddings mean-pool the last
hidden states)."""

from __future__ import annotations

import re
from typing import Any

from ..errors import UnsupportedArchitecture
from .base import ConfigReader, Family, ModelType

# The HF BertConfig defaults.
_DEFAULTS = {
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "position_embedding_type": "absolute",
}
_UNUSED = re.compile(r"^(embeddings\.position_ids|pooler\..*)$")


def describe(r: ConfigReader) -> dict[str, Any]:
    act = r.get("hidden_act")
    if act != "gelu":
        raise UnsupportedArchitecture(f"{r.source}: hidden_act {act!r} is not supported (gelu)")
    positions = r.get("position_embedding_type")
    if positions != "absolute":
        raise UnsupportedArchitecture(
            f"{r.source}: position_embedding_type {positions!r} is not supported (absolute)"
        )
    return {
        "architecture": "bert",
        "model_type": r.config["model_type"],
        "vocab_size": r.get_int("vocab_size"),
        "hidden_size": r.get_int("hidden_size"),
        "intermediate_size": r.get_int("intermediate_size"),
        "num_layers": r.get_int("num_hidden_layers"),
        "num_heads": r.get_int("num_attention_heads"),
        "norm_eps": r.get_float("layer_norm_eps", positive=True),
        "max_position_embeddings": r.get_int("max_position_embeddings"),
        "type_vocab_size": r.get_int("type_vocab_size"),
        "tie_word_embeddings": False,
    }


FAMILY = Family(
    architecture="bert",
    model_types={"bert": ModelType(defaults=_DEFAULTS, eps_key="layer_norm_eps")},
    describe=describe,
    unused_tensor=lambda model, name: (
        "not read by the encoder (pooler head, saved position ids)" if _UNUSED.match(name) else None
    ),
)
