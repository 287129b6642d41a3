"""The SPIR-V the GPU crate embeds (crates/cellm-gpu/src/shaders/spirv/, made by
tools/compile_spirv.sh from the GLSL beside it, which WGSL cannot express): compiled from the
committed source, and declaring what nv_coopmat2.rs and kernels.rs assume of it (no GPU
needed: the module's words are read here)."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest

SHADERS = Path(__file__).resolve().parents[1] / "crates" / "cellm-gpu" / "src" / "shaders"
SPIRV = SHADERS / "spirv"
UNROLLS = (1, 2, 4, 8)
# Opcodes and decorations read below (SPIR-V 1.6 specification).
OP_EXTENSION, OP_ENTRY_POINT, OP_EXECUTION_MODE, OP_DECORATE = 10, 15, 16, 71
LOCAL_SIZE, BINDING = 17, 33


def instructions(path: Path):
    words = struct.unpack(f"<{path.stat().st_size // 4}I", path.read_bytes())
    assert words[0] == 0x07230203, "SPIR-V magic"
    yield ("version", words[1])
    at = 5
    while at < len(words):
        count, op = words[at] >> 16, words[at] & 0xFFFF
        assert count > 0
        yield (op, words[at + 1 : at + count])
        at += count


def literal(words) -> str:
    return b"".join(struct.pack("<I", w) for w in words).split(b"\0")[0].decode()


def test_spirv_was_compiled_from_the_committed_source():
    digest = hashlib.sha256((SHADERS / "gemm_cm2.comp").read_bytes()).hexdigest()
    recorded = (SPIRV / "gemm_cm2.comp.sha256").read_text().strip()
    assert digest == recorded, "gemm_cm2.comp changed: run tools/compile_spirv.sh"


@pytest.mark.parametrize("unroll", UNROLLS)
def test_gemm_cm2_declares_what_the_crate_binds(unroll):
    """Vulkan 1.3's SPIR-V (1.6), the cooperative-matrix extensions the device is opened
    with, one `main` of 256 invocations (the workgroup scope the driver lists), and the
    bindings of KernelId::Coopmat2Gemm: weights 5, step 7, inputs 12, sums 14."""
    extensions, bindings, local = set(), set(), None
    entry = []
    for op, words in instructions(SPIRV / f"gemm_cm2_un{unroll}.spv"):
        if op == "version":
            assert words == 0x00010600
        elif op == OP_EXTENSION:
            extensions.add(literal(words))
        elif op == OP_ENTRY_POINT:
            entry.append(literal(words[2:]))
        elif op == OP_EXECUTION_MODE and words[1] == LOCAL_SIZE:
            local = tuple(words[2:5])
        elif op == OP_DECORATE and words[1] == BINDING:
            bindings.add(words[2])
    assert {"SPV_KHR_cooperative_matrix", "SPV_NV_cooperative_matrix2"} <= extensions
    assert entry == ["main"]
    assert local == (256, 1, 1)
    assert bindings == {5, 7, 12, 14}
