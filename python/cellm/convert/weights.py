"""The tensors a conversion writes. The engine declares them (`cellm._core.expected_tensors`:
its model loaders, asked without a file); this module checks a checkpoint against that
declaration and picks each tensor's stored format within what the engine allows."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import _core
from ..errors import FormatError
from ..families import Family
from ..families.base import Checkpoint
from .interleave import VARIANTS, interleaved
from .writer import TensorEntry

# Buffers some older checkpoints saved but that conversion recomputes (`model.rope`).
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_READABLE = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor the engine reads: its name, shape and the formats it accepts there."""

    name: str
    shape: tuple[int, ...]
    formats: tuple[str, ...]  # f32 first

    def stored_format(self, wanted: str) -> str:
        """`wanted` where the engine accepts it, else f32 (vectors, convolution kernels and
        routers are read as f32 whatever the requested dtype)."""
        return wanted if wanted in self.formats else self.formats[0]

    def finished(self, entry: TensorEntry) -> TensorEntry:
        """`entry` in its format's 8-row interleaved layout where the engine accepts that."""
        x8 = VARIANTS.get(entry.format, (None,))[0]
        return interleaved(entry) if x8 in self.formats else entry


def layers_present(names: Iterable[str], pattern: re.Pattern[str]) -> int:
    """1 + the highest layer index `pattern` (group 1) finds in tensor `names`; 0 if none.
    Checked against the declared layer count before the engine is asked for every layer's
    tensors: a corrupted count (10^8 layers) must fail at once, not after minutes."""
    return 1 + max((int(m.group(1)) for n in names if (m := pattern.match(n))), default=-1)


def expected_tensors(model: Mapping[str, Any]) -> list[PlannedTensor]:
    """Every tensor the engine reads for the model description `model`, in load order."""
    return [
        PlannedTensor(name, tuple(shape), tuple(formats))
        for name, shape, formats in _core.expected_tensors(json.dumps(model))
    ]


def left_out(model: Mapping[str, Any], family: Family, checkpoint: Checkpoint) -> dict[str, int]:
    """How many checkpoint tensors the family leaves out on purpose, by its reason."""
    counts: dict[str, int] = {}
    for name in checkpoint:
        why = family.unused_tensor(model, name)
        if why:
            counts[why] = counts.get(why, 0) + 1
    return counts


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def plan_tensors(
    model: Mapping[str, Any], family: Family, checkpoint: Checkpoint
) -> list[PlannedTensor]:
    """The expected tensors, after checking the checkpoint has each one (or the tensor its
    family makes it from) with the right shape and a readable dtype.

    Tensors the model would not use are an error rather than silently dropped: they mean the
    config and the weights disagree (e.g. biases present but `attention_bias` false).
    """
    plan = expected_tensors(model)
    sources = []
    for tensor in plan:
        name, shape = family.tensor_source(model, tensor.name) or (
            family.checkpoint_name(model, tensor.name),
            tensor.shape,
        )
        sources.append(name)
        if name not in checkpoint:
            raise FormatError(
                f"{checkpoint.source} is missing tensor {name} "
                f"(required for model_type {model['model_type']})"
            )
        info = checkpoint.info(name)
        # Size-1 axes may go (Conv1d's [channels, 1, taps] is stored as [channels, taps]).
        if _squeezed(info.shape) != _squeezed(shape):
            raise FormatError(
                f"{info.path}: tensor {name} has shape {list(info.shape)}, expected "
                f"{list(shape)} from config.json"
            )
        if info.dtype not in _READABLE:
            raise FormatError(
                f"{info.path}: tensor {name} has dtype {info.dtype}; only F32, F16 and BF16 "
                "are supported"
            )
    wanted = set(sources)
    # A tied model's lm_head.weight (when a checkpoint stores it anyway) is the embedding.
    skipped = {"lm_head.weight"} if model["tie_word_embeddings"] else set()
    extra = sorted(
        n
        for n in checkpoint
        if n not in wanted
        and n not in skipped
        and not _IGNORED.match(n)
        and not family.unused_tensor(model, n)
    )
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise FormatError(
            f"{checkpoint.source} has tensors a {model['model_type']} model does not use: "
            f"{', '.join(extra[:3])}{more} (does config.json match the weights?)"
        )
    return plan
