#!/usr/bin/env bash
# Compiles the GLSL kernels that WGSL cannot express (crates/cellm-gpu/src/shaders/*.comp) to
# the SPIR-V the crate embeds, and records each source's sha256 beside it (tests check that
# the committed SPIR-V was compiled from the committed source). Needs glslang 15.1 or newer
# (GL_NV_cooperative_matrix2) and SPIRV-Tools' spirv-opt and spirv-val of the same age (the
# modules are optimized as glslc -O does, then validated for Vulkan 1.3):
#   GLSLANG=/path/to/glslang SPIRV_TOOLS=/path/to/spirv-tools/bin tools/compile_spirv.sh
set -euo pipefail
GLSLANG=${GLSLANG:-glslang}
OPT=${SPIRV_TOOLS:+$SPIRV_TOOLS/}spirv-opt
VAL=${SPIRV_TOOLS:+$SPIRV_TOOLS/}spirv-val
cd "$(dirname "$0")/../crates/cellm-gpu/src/shaders"
mkdir -p spirv
# gemm_cm2: one build per unroll (loads of 64 columns per loop iteration).
for un in 1 2 4 8; do
  out=spirv/gemm_cm2_un$un.spv
  "$GLSLANG" -V --target-env vulkan1.3 -S comp -DUN=$un gemm_cm2.comp -o "$out.raw" >/dev/null
  "$OPT" -O --target-env=vulkan1.3 "$out.raw" -o "$out"
  "$VAL" --target-env vulkan1.3 "$out"
  rm "$out.raw"
done
sha256sum gemm_cm2.comp | cut -d' ' -f1 > spirv/gemm_cm2.comp.sha256
{ "$GLSLANG" --version | head -1; "$OPT" --version 2>&1 | head -1; } > spirv/compiler.txt
ls -l spirv
