"""Shared fixtures: the tiny HF reference checkpoints, converted once per session."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hf-tiny"
# Every fixture the engine runs (one per model_type): each directory with a config.json.
MODEL_FIXTURES = sorted(p.parent.name for p in FIXTURES.glob("*/config.json"))


class Reference:
    """One fixture's HF transformers outputs: prompts, greedy ids and per-position logits."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dir = FIXTURES / name
        self.data = json.loads((self.dir / "reference.json").read_text())
        logits = np.load(self.dir / "logits.npz")
        self.logits = [logits[f"logits_{i}"] for i in range(len(self.data["prompts"]))]

    @property
    def prompts(self) -> list[dict]:
        return self.data["prompts"]

    def sequence(self, i: int) -> list[int]:
        """The ids whose next-token logits the reference holds: prompt + greedy[:-1]."""
        p = self.prompts[i]
        return p["input_ids"] + p["greedy_ids"][:-1]


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """`converted(name, dtype)` -> path of the fixture converted once at that dtype."""
    from cellm.convert import convert_hf

    cache: dict[tuple[str, str], Path] = {}
    root = tmp_path_factory.mktemp("converted")

    def get(name: str, dtype: str) -> Path:
        if (name, dtype) not in cache:
            cache[(name, dtype)] = convert_hf(
                FIXTURES / name, root / f"{name}-{dtype}.cellm", dtype
            )
        return cache[(name, dtype)]

    return get


@pytest.fixture(scope="session")
def gguf_dir(tmp_path_factory) -> Path:
    """Where `from_gguf` writes the fixtures' GGUF files (`<name>[-<variant>].gguf`)."""
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="session")
def from_gguf(gguf_dir):
    """`from_gguf(name, **variant)` -> .cellm converted from the fixture's GGUF (cached)."""
    from cellm.convert import convert_gguf
    from gguf_helpers import hf_fixture_to_gguf

    cache: dict = {}

    def get(name: str, **variant) -> Path:
        key = (name, tuple(sorted(variant.items())))
        if key not in cache:
            tag = "-".join([name] + [k for k, v in sorted(variant.items()) if v])
            gguf = hf_fixture_to_gguf(name, gguf_dir / f"{tag}.gguf", **variant)
            cache[key] = convert_gguf(gguf, gguf_dir / f"{tag}.cellm")
        return cache[key]

    return get


@pytest.fixture(scope="session")
def network_cache(tmp_path_factory) -> str:
    """One model cache for the network tests of a run (the user's, when CELLM_CACHE_DIR is set),
    so each registry model is downloaded once."""
    import os

    return os.environ.get("CELLM_CACHE_DIR") or str(tmp_path_factory.mktemp("cellm-cache"))
