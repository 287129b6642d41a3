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
# Each module the crate embeds: (file, its source, invocations of its `main`, the crate's
# bindings of its kernel by the GLSL block that reads each: kernels.rs's
# KernelId::Coopmat2Gemm, Coopmat2Glu and Coopmat2Attn; step 7 is every kernel's).
GEMM_BINDINGS = {"W": 5, "Step": 7, "XH": 12, "Acc": 14}
GLU_BINDINGS = {"W": 5, "WU": 6, "Step": 7, "XH": 12, "Out": 14}
ATTN_BINDINGS = {"Qkv": 1, "Ctx": 2, "Pool": 5, "Step": 7}
MODULES = (
    [(f"gemm_cm2_un{u}.spv", "gemm_cm2.comp", 256, GEMM_BINDINGS) for u in (1, 2, 4, 8)]
    + [(f"gemm_cm2_glu_un{u}.spv", "gemm_cm2.comp", 256, GLU_BINDINGS) for u in (1, 2, 4, 8)]
    + [
        (f"attn_prefill_cm2_hd{hd}{out}.spv", "attn_prefill_cm2.comp", 128, ATTN_BINDINGS)
        for hd in (64, 128)
        for out in ("", "_half")
    ]
)
# Opcodes and decorations read below (SPIR-V 1.6 specification).
OP_NAME, OP_EXTENSION, OP_ENTRY_POINT, OP_EXECUTION_MODE = 5, 10, 15, 16
OP_TYPE_POINTER, OP_VARIABLE, OP_DECORATE = 32, 59, 71
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


@pytest.mark.parametrize("source", sorted({m[1] for m in MODULES}))
def test_spirv_was_compiled_from_the_committed_source(source):
    digest = hashlib.sha256((SHADERS / source).read_bytes()).hexdigest()
    recorded = (SPIRV / f"{source}.sha256").read_text().strip()
    assert digest == recorded, f"{source} changed: run tools/compile_spirv.sh"


@pytest.mark.parametrize("module,source,invocations,crate", MODULES, ids=[m[0] for m in MODULES])
def test_module_declares_what_the_crate_binds(module, source, invocations, crate):
    """Vulkan 1.3's SPIR-V (1.6), the cooperative-matrix extensions the device is opened
    with, one `main` of the invocations nv_coopmat2.rs passes (256 at most: the workgroup
    scope the driver lists), and each block at the binding wgpu-hal's Vulkan backend gives
    the crate's: a layout's entries numbered densely from 0 in binding order (the GEMM's
    weights 5 -> 0, step 7 -> 1, inputs 12 -> 2, sums 14 -> 3). The crate's own numbers
    there left every block unbound and hung the H200 (the Khronos validation layer named
    them)."""
    extensions, local, entry = set(), None, []
    names, pointee, var_type, binding = {}, {}, {}, {}
    for op, words in instructions(SPIRV / module):
        if op == "version":
            assert words == 0x00010600
        elif op == OP_EXTENSION:
            extensions.add(literal(words))
        elif op == OP_ENTRY_POINT:
            entry.append(literal(words[2:]))
        elif op == OP_EXECUTION_MODE and words[1] == LOCAL_SIZE:
            local = tuple(words[2:5])
        elif op == OP_NAME:
            names[words[0]] = literal(words[1:])
        elif op == OP_TYPE_POINTER:
            pointee[words[0]] = words[2]
        elif op == OP_VARIABLE:
            var_type[words[1]] = words[0]
        elif op == OP_DECORATE and words[1] == BINDING:
            binding[words[0]] = words[2]
    assert {"SPV_KHR_cooperative_matrix", "SPV_NV_cooperative_matrix2"} <= extensions
    assert entry == ["main"]
    assert local == (invocations, 1, 1)
    blocks = {names[pointee[var_type[v]]]: b for v, b in binding.items()}
    ranked = sorted(crate.items(), key=lambda kv: kv[1])
    assert blocks == {name: rank for rank, (name, _) in enumerate(ranked)}
