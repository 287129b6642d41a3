"""GGUF import of llama.cpp's qwen3, lfm2 and granite architectures, on the HF fixtures written
by llama.cpp's own gguf-py (tests/gguf_py_fixtures.py): the converted model against the HF
conversion and the HF reference logits, and against llama.cpp itself on the same GGUF file
(cellm.parity, the harness of the real-model parity tests).

llama-cpp-python is built by .ci/run; set CELLM_REQUIRE_PEER=1 (CI does) to fail rather than
skip when it is missing.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from cellm import LLM
from cellm.convert import convert_gguf, read_header
from cellm.parity import LlamaCpp, compare_logits
from conftest import Reference
from gguf_py_fixtures import write_gguf_py

NAMES = ["qwen3", "lfm2", "granite"]
ATOL = 1e-3  # f32 weights and KV cache against HF's float32 forward, as for the HF path


@pytest.fixture(scope="module")
def gguf_py(tmp_path_factory):
    """`gguf_py(name)` -> (GGUF file, its .cellm conversion), written once per module."""
    root = tmp_path_factory.mktemp("gguf-py")
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            gguf = write_gguf_py(name, root / f"{name}.gguf")
            cache[name] = (gguf, convert_gguf(gguf, root / f"{name}.cellm", progress=False))
        return cache[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_description_matches_hf_conversion(name, gguf_py, converted):
    got = read_header(gguf_py(name)[1])["model"]
    want = read_header(converted(name, "f32"))["model"]
    assert got == want


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_hf_reference(name, gguf_py):
    ref = Reference(name)
    llm = LLM(gguf_py(name)[1], kv_encoding="f32")
    for i in range(len(ref.prompts)):
        err = float(np.abs(llm.logits(ref.sequence(i)) - ref.logits[i]).max())
        assert err < ATOL, f"prompt {i}: max |dlogit| = {err}"


@pytest.fixture(scope="module")
def llama_cpp_available():
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        if os.environ.get("CELLM_REQUIRE_PEER") == "1":
            raise
        pytest.skip("llama-cpp-python is not installed (see .ci/run)")


@pytest.mark.parametrize("name", NAMES)
def test_matches_llama_cpp(name, gguf_py, llama_cpp_available):
    """Both engines on the same f32 GGUF file. llama.cpp keeps its KV cache in f16, which
    moves its logits by up to ~3e-3 from HF's on these fixtures (cellm's f32 cache: ~1e-5);
    the bound of 1e-2 leaves 3x room for that, while a wrong tensor mapping, norm or RoPE
    layout moves logits by whole units. Mean KL is ~1e-7 nats (bound 1e-5); the argmax must
    agree wherever llama.cpp's top two differ by more than twice the logit bound."""
    gguf, cellm_file = gguf_py(name)
    llm = LLM(cellm_file, kv_encoding="f32")
    peer = LlamaCpp(gguf, threads=2)
    ref = Reference(name)
    for i in range(len(ref.prompts)):
        ids = ref.sequence(i)
        theirs, ours = peer.logits(ids), llm.logits(ids)
        assert compare_logits(theirs, ours).mean_kl < 1e-5, i
        assert float(np.abs(theirs - ours).max()) < 1e-2, i
        top2 = np.sort(theirs, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2e-2
        assert clear.mean() > 0.5, clear.mean()
        assert (theirs.argmax(-1) == ours.argmax(-1))[clear].all(), i
