#!/usr/bin/env bash
# The kernel and KV tests built for aarch64 and run under qemu's user-mode emulator, once on a
# CPU model with the dot product extension (both NEON paths) and once on a Cortex-A72 (plain
# NEON only, as on a Raspberry Pi 4), each failing if its paths are not detected.
# Needs the Rust aarch64 target, a cross linker and qemu-user (`--install` fetches them with
# rustup and apt-get); without them it says so and skips. Emulated timings mean nothing:
# this checks the NEON kernels' results, not their speed.
set -euo pipefail
cd "$(dirname "$0")/.."
target=aarch64-unknown-linux-gnu
if [[ "${1:-}" == "--install" ]]; then
    rustup target add "$target" >/dev/null 2>&1 || echo "aarch64: rustup could not add $target"
    if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
        { apt-get update -qq && apt-get install -y -qq gcc-aarch64-linux-gnu \
            libc6-dev-arm64-cross qemu-user; } >/dev/null 2>&1 ||
            echo "aarch64: apt-get could not install the cross linker and qemu-user"
    fi
    exit 0
fi
missing=()
rustup target list --installed 2>/dev/null | grep -qx "$target" || missing+=("the $target std")
command -v aarch64-linux-gnu-gcc >/dev/null || missing+=(aarch64-linux-gnu-gcc)
command -v qemu-aarch64 >/dev/null || missing+=(qemu-aarch64)
if ((${#missing[@]})); then
    echo "aarch64 NEON tests SKIPPED: missing $(IFS=,; echo "${missing[*]}") (tools/test_aarch64.sh --install)"
    exit 0
fi
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
sysroot=/usr/aarch64-linux-gnu
for cpu in max cortex-a72; do
    if [[ $cpu == max ]]; then required=neon,neon-dotprod; else required=neon; fi
    echo "aarch64 kernel tests under qemu -cpu $cpu (paths required: $required)"
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -cpu $cpu -L $sysroot" \
        CELLM_REQUIRE_ISA=$required \
        cargo test --release --locked -q -p cellm-kernels -p cellm-kv --target "$target"
done
