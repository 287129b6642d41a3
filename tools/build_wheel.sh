#!/usr/bin/env bash
# Builds the release wheel that a stranger can install: abi3 (one wheel for CPython >= 3.9),
# manylinux_2_28 (runs on any Linux with glibc >= 2.28, whatever glibc this machine has).
#
#   bash tools/build_wheel.sh OUT_DIR
#
# Zig links the extension against glibc 2.28's symbol versions (maturin --zig, through
# cargo-zigbuild). maturin, zig (the `ziglang` package) and auditwheel are pinned and live in
# their own venv, target/wheel-tools, so the developers' environment is left alone; the build
# has its own cargo target dir, target/wheel, so it neither rebuilds nor disturbs what
# `pip install -e .` built. The wheel is checked before it lands in OUT_DIR: auditwheel must
# find it consistent with manylinux_2_28 (or older) for this machine's arch, its file name must
# carry that tag, and every file git tracks under python/cellm must be in it.
set -euo pipefail

MATURIN_VERSION=1.16.0
ZIGLANG_VERSION=0.15.2
AUDITWHEEL_VERSION=6.8.2
GLIBC_MAX=2.28 # the oldest glibc the wheel must run on: its manylinux tag is at most this

if [[ $# -ne 1 ]]; then
    echo "usage: bash tools/build_wheel.sh OUT_DIR" >&2
    exit 2
fi
mkdir -p "$1"
out_dir="$(cd "$1" && pwd)"
cd "$(dirname "$0")/.."
repo="$(pwd)"
arch="$(uname -m)"
start=$SECONDS

# --- tools: pinned, in their own venv -------------------------------------------------------
tools="$repo/target/wheel-tools"
tpy="$tools/bin/python"
want="maturin==$MATURIN_VERSION ziglang==$ZIGLANG_VERSION auditwheel==$AUDITWHEEL_VERSION"
have() {
    "$tpy" - "$@" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version

sys.exit(any(version(n) != v for n, v in (a.split("==") for a in sys.argv[1:])))
EOF
}
# shellcheck disable=SC2086 # $want is a list of requirements
if [[ ! -x "$tpy" ]] || ! have $want; then
    echo "build_wheel: installing $want into target/wheel-tools"
    [[ -x "$tpy" ]] || python3 -m venv "$tools"
    "$tpy" -m pip install --quiet $want
fi
zig_version="$("$tpy" -m ziglang version)"
if [[ "$zig_version" != "$ZIGLANG_VERSION" ]]; then
    echo "build_wheel: python -m ziglang version says '$zig_version', want $ZIGLANG_VERSION" >&2
    exit 1
fi
# cargo-zigbuild takes zig from CARGO_ZIGBUILD_ZIG_PATH before it looks at PATH; name the
# pinned one (the binary inside the ziglang package) so a system zig cannot stand in for it.
CARGO_ZIGBUILD_ZIG_PATH="$("$tpy" -c 'import pathlib, ziglang; print(pathlib.Path(ziglang.__file__).with_name("zig"))')"
CARGO_ZIGBUILD_PYTHON_PATH="$tpy"
export CARGO_ZIGBUILD_ZIG_PATH CARGO_ZIGBUILD_PYTHON_PATH
echo "build_wheel: maturin $MATURIN_VERSION, zig $zig_version, auditwheel $AUDITWHEEL_VERSION"

# --- build into a scratch dir; only a wheel that passes the checks reaches OUT_DIR ------------
scratch="$(mktemp -d "${TMPDIR:-/tmp}/cellm-wheel.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
build_start=$SECONDS
CARGO_TARGET_DIR="$repo/target/wheel" "$tools/bin/maturin" build \
    --release --locked --zig --compatibility "manylinux_${GLIBC_MAX/./_}" \
    --out "$scratch"
build_s=$((SECONDS - build_start))
shopt -s nullglob
wheels=("$scratch"/*.whl)
if [[ ${#wheels[@]} -ne 1 ]]; then
    echo "build_wheel: expected one wheel from maturin, got ${#wheels[@]}" >&2
    exit 1
fi
wheel="${wheels[0]}"

# --- checks ---------------------------------------------------------------------------------
echo "build_wheel: auditwheel show $(basename "$wheel")"
show="$("$tools/bin/auditwheel" show "$wheel")"
echo "$show"
# The tag auditwheel finds the wheel consistent with, and the one its name carries, must both be
# manylinux_X_Y_ARCH with X.Y <= GLIBC_MAX (the legacy aliases manylinux1/2010/2014 are older).
"$tpy" - "$wheel" "$show" "$GLIBC_MAX" "$arch" <<'EOF'
import re
import sys
import zipfile
from pathlib import Path

wheel, show, glibc_max, arch = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
limit = tuple(int(x) for x in glibc_max.split("."))
LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def glibc(tag: str) -> tuple[int, int]:
    """(major, minor) of a manylinux platform tag for `arch`; exits if it is not one."""
    m = re.fullmatch(rf"manylinux_(\d+)_(\d+)_{re.escape(arch)}", tag)
    if m:
        return int(m[1]), int(m[2])
    m = re.fullmatch(rf"(manylinux1|manylinux2010|manylinux2014)_{re.escape(arch)}", tag)
    if m:
        return LEGACY[m[1]]
    sys.exit(f"build_wheel: {tag!r} is not a manylinux tag for {arch}")


# name-version-pythontag-abitag-platformtag(s).whl; platform tags may be dot-joined
parts = wheel.name[: -len(".whl")].split("-")
python_tag, abi_tag, platforms = parts[-3], parts[-2], parts[-1].split(".")
if abi_tag != "abi3":
    sys.exit(f"build_wheel: {wheel.name} is not an abi3 wheel")
for tag in platforms:
    if glibc(tag) > limit:
        sys.exit(f"build_wheel: {wheel.name}: {tag} needs a glibc newer than {glibc_max}")
# auditwheel wraps its lines: match the phrases whatever whitespace splits them.
found = [
    m[1]
    for phrase in ("consistent with the following platform tag:", "constrains the platform tag to")
    for m in re.finditer(r"\s+".join(map(re.escape, phrase.split())) + r'\s*"([^"]+)"', show)
]
if not found:
    sys.exit("build_wheel: auditwheel show did not name a platform tag the wheel is consistent with")
for tag in found:
    if glibc(tag) > limit:
        sys.exit(f"build_wheel: auditwheel says the wheel needs {tag}, newer than glibc {glibc_max}")

# The same platform tags must be in the WHEEL metadata installers read.
with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    meta = next(n for n in names if n.endswith(".dist-info/WHEEL"))
    tags = [line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
            if line.startswith("Tag:")]
expected = sorted(f"{python_tag}-{abi_tag}-{p}" for p in platforms)
if sorted(tags) != expected:
    sys.exit(f"build_wheel: WHEEL says Tag: {tags}, the file name says {expected}")
sos = [n for n in names if n.startswith("cellm/_core") and n.endswith(".so")]
if sos != ["cellm/_core.abi3.so"]:
    sys.exit(f"build_wheel: want exactly cellm/_core.abi3.so in the wheel, found {sos}")
junk = [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
if junk:
    sys.exit(f"build_wheel: compiled leftovers in the wheel: {junk}")
EOF
# Every file git tracks under python/cellm (sources, registry.toml, py.typed, _core.pyi, data/)
# must be in the wheel. Skipped outside a git checkout (e.g. built from an sdist).
if git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
    git -C "$repo" ls-files -z -- python/cellm | "$tpy" -c '
import sys, zipfile
tracked = {p[len("python/"):] for p in sys.stdin.read().split("\0") if p}
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
missing = sorted(tracked - names)
if missing:
    sys.exit(f"build_wheel: tracked files missing from the wheel: {missing}")
print(f"build_wheel: all {len(tracked)} files git tracks under python/cellm are in the wheel")
' "$wheel"
fi

mv -f "$wheel" "$out_dir/"
wheel="$out_dir/$(basename "$wheel")"
name="$(basename "$wheel" .whl)"
echo "build_wheel: wheel    $wheel"
echo "build_wheel: tag      ${name#*-*-}"
echo "build_wheel: size     $(du -h "$wheel" | cut -f1) ($(stat -c %s "$wheel") bytes)"
echo "build_wheel: time     ${build_s}s to build, $((SECONDS - start))s in all"
