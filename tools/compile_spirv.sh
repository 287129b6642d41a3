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
build() {  # source output defines...
  local src=$1 out=$2; shift 2
  "$GLSLANG" -V --target-env vulkan1.3 -S comp "$@" "$src" -o "$out.raw" >/dev/null
  "$OPT" -O --target-env=vulkan1.3 "$out.raw" -o "$out"
  "$VAL" --target-env vulkan1.3 "$out"
  rm "$out.raw"
}
# gemm_cm2: one build per unroll (loads of 64 columns per loop iteration), plain and GLU.
for un in 1 2 4 8; do
  build gemm_cm2.comp spirv/gemm_cm2_un$un.spv -DUN=$un
  build gemm_cm2.comp spirv/gemm_cm2_glu_un$un.spv -DUN=$un -DGLU
done
# attn_prefill_cm2: one build per head dim, writing f32 or f16.
for hd in 64 128; do
  build attn_prefill_cm2.comp spirv/attn_prefill_cm2_hd$hd.spv -DHD=$hd
  build attn_prefill_cm2.comp spirv/attn_prefill_cm2_hd${hd}_half.spv -DHD=$hd -DHALF_OUT
done
for src in gemm_cm2.comp attn_prefill_cm2.comp; do
  sha256sum $src | cut -d' ' -f1 > spirv/$src.sha256
done
{ "$GLSLANG" --version | head -1; "$OPT" --version 2>&1 | head -1; } > spirv/compiler.txt
ls -l spirv
