"""DeepSeek-V3 style models: multi-head latent attention (MLA) and a mixture of experts with
a grouped top-k router. Conversion splits `kv_b_proj` per head into the absorbed key and value
up-projections, and undoes `rope_interleave`."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from ..errors import FormatError, UnsupportedArchitecture
from .base import MAX_HEAD_DIM, Checkpoint, ConfigReader, Dims, Family, ModelType, Transform
from .llama import COMMON_DEFAULTS
from .rope import rope_description, rope_parameters

_K_ABSORB, _V_UP = ".kv_b_proj.k_absorb.weight", ".kv_b_proj.v_up.weight"


def _extras(r: ConfigReader, dims: Dims) -> dict[str, Any]:
    """Multi-head latent attention and the MoE router's shape. The q/k head is `nope + rope`
    wide; RoPE covers the `rope` part (HF's `head_dim`), and yarn scaling also scales the
    softmax by mscale^2."""
    nope = r.get_int("qk_nope_head_dim", maximum=MAX_HEAD_DIM)
    rope = r.get_int("qk_rope_head_dim", maximum=MAX_HEAD_DIM)
    # An explicit null means a plain q_proj; only an absent key takes the default rank.
    q_lora = r.config["q_lora_rank"] if "q_lora_rank" in r.config else r.get("q_lora_rank")
    if r.get_bool("attention_bias"):
        raise UnsupportedArchitecture(f"{r.source}: MLA with attention_bias is not supported")
    rope_desc = rope_description(r.config, r.model_type, rope, dims.max_pos, r.source)
    params = rope_parameters(r.config, r.model_type, r.source)
    scale = (nope + rope) ** -0.5
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        factor = float(params["factor"])
        if factor > 1:  # HF's yarn_get_mscale
            mscale = 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0
            scale *= mscale * mscale
    return {
        "head_dim": nope + rope,
        "rope": rope_desc,
        "attention_scale": scale,
        "mla": {
            "q_lora_rank": None if q_lora is None else r.get_int("q_lora_rank"),
            "kv_lora_rank": r.get_int("kv_lora_rank"),
            "nope_dim": nope,
            "rope_dim": rope,
            "v_dim": r.get_int("v_head_dim"),
            "rope_interleave": r.get_bool("rope_interleave"),
        },
        "moe": {
            "experts": r.get_int("n_routed_experts"),
            "experts_per_token": r.get_int("num_experts_per_tok"),
            "groups": r.get_int("n_group"),
            "groups_per_token": r.get_int("topk_group"),
            "norm_topk_prob": r.get_bool("norm_topk_prob"),
            "routed_scaling_factor": r.get_float("routed_scaling_factor", positive=True),
            "shared_experts": r.get_int("n_shared_experts", minimum=0),
            "expert_intermediate_size": r.get_int("moe_intermediate_size"),
            "first_moe_layer": r.get_int("first_k_dense_replace", minimum=0),
        },
    }


_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


def _settle_from_weights(model: dict[str, Any], checkpoint: Checkpoint) -> None:
    """Refuses more routed experts than the checkpoint holds before the engine is asked for
    that many experts' tensors (a corrupted count of 10^8 would take minutes to list)."""
    declared = model["moe"]["experts"]
    present = 1 + max((int(m.group(1)) for n in checkpoint if (m := _EXPERT.match(n))), default=-1)
    if declared > present:
        raise FormatError(
            f"{checkpoint.source}: n_routed_experts is {declared:,} but the checkpoint has "
            f"tensors for {present} experts"
        )


def _tensor_source(model: Mapping[str, Any], name: str) -> Optional[tuple[str, tuple[int, ...]]]:
    """`k_absorb` and `v_up` are both made from the checkpoint's `kv_b_proj`."""
    if not name.endswith((_K_ABSORB, _V_UP)):
        return None
    m = model["mla"]
    prefix = name.rsplit(".kv_b_proj.", 1)[0]
    shape = (model["num_heads"] * (m["nope_dim"] + m["v_dim"]), m["kv_lora_rank"])
    return prefix + ".kv_b_proj.weight", shape


def _mla_layout(model: Mapping[str, Any], name: str) -> Optional[Transform]:
    """MLA weights in the engine's layout: `kv_b_proj` split per head into `W_UK^T`
    (`k_absorb`, `rank x nope`) and `W_UV` (`v_up`, `v x rank`); with `rope_interleave`, the
    rope rows of q and of the shared key reordered from (x0, x1), (x2, x3)... pairs to HF's
    half-split layout (evens, then odds), which is the same rotation."""
    m, heads = model["mla"], model["num_heads"]
    nope, rope, rank, v = m["nope_dim"], m["rope_dim"], m["kv_lora_rank"], m["v_dim"]
    if name.endswith(_K_ABSORB):
        return lambda w: (
            w.reshape(heads, nope + v, rank)[:, :nope, :].transpose(0, 2, 1).reshape(-1, nope)
        )
    if name.endswith(_V_UP):
        return lambda w: w.reshape(heads, nope + v, rank)[:, nope:, :].reshape(-1, rank)
    if not m["rope_interleave"]:
        return None
    half_split = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    if name.endswith(("q_proj.weight", "q_b_proj.weight")):
        order = np.concatenate(
            [h * (nope + rope) + np.r_[np.arange(nope), nope + half_split] for h in range(heads)]
        )
        return lambda w: w[order]
    if name.endswith(("kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias")):
        order = np.r_[np.arange(rank), rank + half_split]
        return lambda w: w[order]
    return None


FAMILY = Family(
    architecture="deepseek_v3",
    model_types={
        "deepseek_v3": ModelType(
            {
                **COMMON_DEFAULTS,
                "max_position_embeddings": 4096,
                "tie_word_embeddings": False,
                "q_lora_rank": 1536,
                "kv_lora_rank": 512,
                "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64,
                "v_head_dim": 128,
                "rope_interleave": True,
                "n_routed_experts": 256,
                "num_experts_per_tok": 8,
                "n_group": 8,
                "topk_group": 4,
                "norm_topk_prob": True,
                "routed_scaling_factor": 2.5,
                "n_shared_experts": 1,
                "moe_intermediate_size": 2048,
                "first_k_dense_replace": 3,
            },
            fixed={"mlp_bias": False, "qk_norm": False, "attention_out_bias": False},
            extras=_extras,
        ),
    },
    tensor_source=_tensor_source,
    tensor_transform=_mla_layout,
    settle_from_weights=_settle_from_weights,
)
