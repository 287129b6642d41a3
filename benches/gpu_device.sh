#!/usr/bin/env bash
# The GPU benchmark of docs/benchmarks.md ("GPU (issue 20)") on a machine with an NVIDIA GPU, a
# CUDA toolkit, cmake, ninja and python3 with numpy, but no Rust and no package registry.
# What it needs comes in DIR (default .dev/h20), made on a machine with those, in two parts
# (each call to that machine may carry only a few MiB beside the repository):
#   DIR/llama.cpp.tar.xz   vendor/llama.cpp of the llama-cpp-python==0.3.36 sdist (the CPU
#                          parity peer's source), trimmed to ggml (CPU, Vulkan, CUDA), src,
#                          common and the llama-bench and llama-quantize tools
#   DIR/vk.tar.xz          from Debian trixie: glslc, libshaderc1, the Vulkan headers
#                          (libvulkan-dev) and spirv-headers, unpacked (usr/...)
#   DIR/cellm-*.whl        the abi3 wheel (maturin build --release), or cellm_pkg.tar.xz:
#                          python/cellm with its built extension
#   DIR/gl/*.deb           Debian's libvulkan1 (the Vulkan loader), libglvnd0, and (on some
#                          hosts the NVIDIA ICD finds no vkCreateInstance without them)
#                          libegl1, libgl1, libglx0, libgles2, libopengl0
#   DIR/gpu_bench.py, DIR/random_gguf.py, DIR/gpu_decode_ab.py   copies of benches/
#
#   bash gpu_device.sh build DIR     unpack, then build llama.cpp (Vulkan, then CUDA) in a
#                                    session of its own, which outlives the call
#   bash gpu_device.sh prep DIR      install the wheel, write the random-weight GGUFs (F16,
#                                    then Q4_K_M / Q4_1 by llama-quantize), check cellm's GPU
#                                    logits against its CPU on each
#   bash gpu_device.sh measure DIR   cellm (Vulkan), llama.cpp Vulkan and llama.cpp CUDA on
#                                    each model: pp512, tg64 after 128 and after 2048 tokens
#   bash gpu_device.sh cellm DIR     cellm alone on a fresh machine, in one call: the F16
#                                    GGUFs, a CPU-only llama-quantize for the Q4 ones, logits
#                                    checks, speed, a CELLM_GPU_PROFILE pass (host and GPU time
#                                    per kernel), the shared-memory reductions
#                                    (CELLM_GPU_NO_SUBGROUPS=1) and an A/B of the decode
#                                    knobs (gpu_decode_ab.py) for comparison
#   bash gpu_device.sh prefill DIR   cellm's prefill alone on a fresh machine, in one call:
#                                    logits checks of the cooperative-matrix GEMM, pp512 of
#                                    every model with everything on and with prefill on the
#                                    f32 prefill attention (CELLM_GPU_NO_COOP_ATTN=1; or the
#                                    f32 GEMM: PREFILL_VARIANTS="all f32 all f32", the decode
#                                    attention: "all decode-attn ..."),
#                                    alternating, and a
#                                    CELLM_GPU_PROFILE=prefill pass (GPU time per kernel of
#                                    one 512-token step)
# Results go to $OUT (JSON lines and logs); the build log to /tmp/w/build.log.
set -uo pipefail
phase=$1
D=$(cd "${2:-.dev/h20}" && pwd)
OUT=${OUT:-/tmp/out}
W=/tmp/w
mkdir -p "$W" "$OUT"
export CELLM_CACHE_DIR=$W/cache
export PYTHONPATH=/tmp/site:$W/llama.cpp/gguf-py
export LD_LIBRARY_PATH=/opt/vk/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# The driver's own ICD file (the one under /usr/share may name a library the loader cannot
# use).
if [[ -e /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]]; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
fi
SHAPES="smollm2-135m gemma-3-270m qwen2.5-0.5b llama-3.2-1b llama-3.2-3b"
# The real models' formats for their shapes (SmolLM2's file is Q4_1, the other two Q4_K_M),
# and Llama 3.2 1B/3B in Q4_K_M and F16.
MODELS="smollm2-135m-q4_1 gemma-3-270m-q4_k_m qwen2.5-0.5b-q4_k_m llama-3.2-1b-q4_k_m
llama-3.2-1b-f16 llama-3.2-3b-q4_k_m llama-3.2-3b-f16"
G=$W/gguf

build_llama_cpp() {
    local common=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
        -DLLAMA_OPENSSL=OFF)
    cmake -S $W/llama.cpp -B $W/bvk "${common[@]}" -DGGML_VULKAN=ON \
        -DVulkan_INCLUDE_DIR=/opt/vk/usr/include \
        -DVulkan_LIBRARY=/usr/lib/x86_64-linux-gnu/libvulkan.so.1 \
        -DVulkan_GLSLC_EXECUTABLE=/opt/vk/usr/bin/glslc \
        -DSPIRV-Headers_DIR=/opt/vk/usr/share/cmake/SPIRV-Headers &&
        cmake --build $W/bvk --target llama-bench llama-quantize -j 16 && echo VK_BUILD_OK
    cmake -S $W/llama.cpp -B $W/bcu "${common[@]}" -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 && cmake --build $W/bcu --target llama-bench -j 16 &&
        echo CUDA_BUILD_OK
    echo BUILD_END
}

if [[ $phase == build ]]; then
    for f in "$D"/gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    mkdir -p /opt/vk
    tar xJf "$D/vk.tar.xz" -C /opt/vk
    tar xJf "$D/llama.cpp.tar.xz" -C $W
    {
        nvidia-smi -L
        nvidia-smi --query-gpu=driver_version,clocks.max.sm,clocks.max.mem --format=csv
        command -v cmake ninja gcc nvcc
        nproc
        python3 -V
        ldconfig -p | grep libvulkan
        /opt/vk/usr/bin/glslc --version | head -2
    } 2>&1 | tee $OUT/machine.txt
    export -f build_llama_cpp
    export W
    setsid bash -c build_llama_cpp >$W/build.log 2>&1 </dev/null &
    sleep 20
    tail -5 $W/build.log
fi

if [[ $phase == prep ]]; then
    for f in "$D"/gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    mkdir -p /tmp/site
    if ls "$D"/cellm-*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$D"/cellm-*.whl
    else # python/cellm with the built extension in it, as a tar
        tar xJf "$D"/cellm_pkg.tar.xz -C /tmp/site
    fi
    mkdir -p $G
    python3 "$D/random_gguf.py" --out $G --formats f16 --shapes "${SHAPES// /,}" 2>&1 | tail -5
    while ! grep -q "VK_BUILD_OK\|BUILD_END" $W/build.log && ((SECONDS < 420)); do
        sleep 5
    done
    Q=$W/bvk/bin/llama-quantize
    $Q $G/smollm2-135m-f16.gguf $G/smollm2-135m-q4_1.gguf Q4_1 >/dev/null 2>&1
    for s in gemma-3-270m qwen2.5-0.5b llama-3.2-1b llama-3.2-3b; do
        $Q $G/$s-f16.gguf $G/$s-q4_k_m.gguf Q4_K_M >/dev/null 2>&1
    done
    ls -la $G | tee -a $OUT/machine.txt
    all=$(for m in $MODELS smollm2-135m-f16 gemma-3-270m-f16 qwen2.5-0.5b-f16; do
        printf '%s,' $G/$m.gguf
    done)
    CELLM_GPU_INFO=1 python3 "$D/gpu_bench.py" --check-only --models "${all%,}" 2>&1 |
        tee -a $OUT/check.jsonl
    quantized=$(for m in $MODELS; do [[ $m == *-f16 ]] || printf '%s,' $G/$m.gguf; done)
    python3 "$D/gpu_bench.py" --check-dequantized $W --models "${quantized%,}" 2>&1 |
        tee -a $OUT/check.jsonl
    tail -3 $W/build.log
    cp $W/build.log $OUT/
fi

if [[ $phase == measure ]]; then
    # cellm first: llama.cpp's CUDA build may still be running (then its rows come last).
    for m in $MODELS; do
        CELLM_GPU_INFO=1 python3 "$D/gpu_bench.py" --speed-only --models $G/$m.gguf 2>&1 |
            tee -a $OUT/cellm.jsonl
    done
    for b in bvk bcu; do
        while [[ $b == bcu ]] && ! grep -q BUILD_END $W/build.log && ((SECONDS < 560)); do
            sleep 5
        done
        [[ -x $W/$b/bin/llama-bench ]] || { echo "no $b/bin/llama-bench"; continue; }
        for m in $MODELS; do
            for args in "-p 512 -n 0" "-p 0 -n 64 -d 128,2048"; do
                # shellcheck disable=SC2086
                $W/$b/bin/llama-bench -m $G/$m.gguf -ngl 99 -r 3 -o jsonl $args \
                    2>>$OUT/llama_bench.err | sed "s/^{/{\"build\": \"$b\", /" |
                    tee -a $OUT/llama.jsonl
            done
        done
    done
    cp $W/build.log $OUT/
fi

# The cellm and prefill phases on a fresh machine: the Vulkan loader, cellm, the F16 GGUFs
# (a CPU-only llama-quantize builds meanwhile, in a session of its own) and a logits check.
fresh_machine_setup() {
    for f in "$D"/gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    mkdir -p /tmp/site $G
    if ls "$D"/cellm-*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$D"/cellm-*.whl
    else
        tar xJf "$D"/cellm_pkg.tar.xz -C /tmp/site
    fi
    tar xJf "$D/llama.cpp.tar.xz" -C $W
    export PYTHONPATH=/tmp/site:$W/llama.cpp/gguf-py CELLM_GPU_INFO=1 PYTHONUNBUFFERED=1
    build_quantize() {
        cmake -S $W/llama.cpp -B $W/bq -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
            -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF &&
            cmake --build $W/bq --target llama-quantize -j 12
        echo Q_END
    }
    export -f build_quantize
    export W
    setsid bash -c build_quantize >$W/q.log 2>&1 </dev/null &
    python3 "$D/random_gguf.py" --out $G --formats f16 --shapes "${SHAPES// /,}" 2>&1 | tail -1
    B="python3 $D/gpu_bench.py"
    $B --check-only --models $G/llama-3.2-1b-f16.gguf,$G/gemma-3-270m-f16.gguf | tee $OUT/check.jsonl
}

# The Q4 files, once build_quantize is done: SmolLM2 in Q4_1, the others in Q4_K_M.
quantize_q4() {
    while ! grep -q Q_END $W/q.log; do sleep 3; done
    Q=$W/bq/bin/llama-quantize
    $Q $G/smollm2-135m-f16.gguf $G/smollm2-135m-q4_1.gguf Q4_1 >/dev/null 2>&1
    for s in gemma-3-270m qwen2.5-0.5b llama-3.2-1b llama-3.2-3b; do
        $Q $G/$s-f16.gguf $G/$s-q4_k_m.gguf Q4_K_M >/dev/null 2>&1
    done
}

if [[ $phase == cellm ]]; then
    fresh_machine_setup
    F=$G/llama-3.2-1b-f16.gguf,$G/smollm2-135m-f16.gguf,$G/llama-3.2-3b-f16.gguf
    $B --speed-only --models $F | tee $OUT/speed.jsonl
    quantize_q4
    M=$(for m in $MODELS; do [[ $m == *-f16 ]] || printf '%s,' $G/$m.gguf; done)
    $B --speed-only --models "${M%,}" | tee -a $OUT/speed.jsonl
    C=$G/smollm2-135m-q4_1.gguf,$G/qwen2.5-0.5b-q4_k_m.gguf,$G/llama-3.2-1b-q4_k_m.gguf
    $B --check-dequantized $W --models $C | tee -a $OUT/check.jsonl
    P=$G/smollm2-135m-q4_1.gguf,$G/llama-3.2-1b-q4_k_m.gguf,$G/llama-3.2-3b-f16.gguf
    CELLM_GPU_PROFILE=1 $B --speed-only --runs 1 --models $P 2>&1 | grep -v "^{" |
        tee $OUT/profile.txt
    CELLM_GPU_NO_SUBGROUPS=1 $B --speed-only --runs 1 --models $P | tee $OUT/nosg.jsonl
    V="base=,plain=CELLM_GPU_MATVEC_PLAIN:1,nowide=CELLM_GPU_MATVEC_WIDE:64.0.0"
    V+=",steps2=CELLM_GPU_MATVEC_STEPS:2,noimm=CELLM_GPU_NO_IMMEDIATES:1"
    V+=",noahead=CELLM_GPU_NO_AHEAD:1,nofuse=CELLM_GPU_NO_FUSE:1,f16v2=CELLM_GPU_F16_VEC4:0"
    V+=",nod16=CELLM_GPU_MATVEC_D16:0,nocombfuse=CELLM_GPU_ATTN_FUSE:0,notp=CELLM_GPU_ATTN_TP:0"
    V+=",novv=CELLM_GPU_ATTN_VV:0,noi8=CELLM_GPU_MATVEC_I8:0,not64=CELLM_GPU_MATVEC_T64:0"
    # (the wide build runs only on Qwen2.5's and Gemma 3's down projections)
    A=$P,$G/qwen2.5-0.5b-q4_k_m.gguf,$G/gemma-3-270m-q4_k_m.gguf
    python3 "$D/gpu_decode_ab.py" $A "$V" 2 2>&1 | grep -v "^cellm-gpu: " | tee $OUT/ab.jsonl
fi

if [[ $phase == prefill ]]; then
    fresh_machine_setup
    quantize_q4
    M=$(for m in $MODELS; do printf '%s,' $G/$m.gguf; done)
    # Variants, alternating: everything on; the f32 GEMM; prefill running the decode
    # attention; the f32 prefill attention instead of the cooperative one (f32-attn)
    # (PREFILL_VARIANTS picks others).
    for v in ${PREFILL_VARIANTS:-all f32-attn all f32-attn}; do
        unset CELLM_GPU_NO_COOPMAT CELLM_GPU_NO_PREFILL_ATTN CELLM_GPU_NO_COOP_ATTN
        [[ $v == f32 ]] && export CELLM_GPU_NO_COOPMAT=1
        [[ $v == decode-attn ]] && export CELLM_GPU_NO_PREFILL_ATTN=1
        [[ $v == f32-attn ]] && export CELLM_GPU_NO_COOP_ATTN=1
        $B --speed-only --prefill-only --models "${M%,}" | sed "s/^{/{\"variant\": \"$v\", /" |
            tee -a $OUT/prefill.jsonl
    done
    unset CELLM_GPU_NO_COOPMAT CELLM_GPU_NO_PREFILL_ATTN CELLM_GPU_NO_COOP_ATTN
    C=$G/smollm2-135m-q4_1.gguf,$G/qwen2.5-0.5b-q4_k_m.gguf,$G/llama-3.2-1b-q4_k_m.gguf
    $B --check-dequantized $W --models $C | tee -a $OUT/check.jsonl
    P=$G/llama-3.2-1b-q4_k_m.gguf,$G/llama-3.2-3b-f16.gguf
    CELLM_GPU_PROFILE=prefill $B --speed-only --prefill-only --runs 1 --models $P 2>&1 |
        grep profile | tee $OUT/profile.txt
fi
