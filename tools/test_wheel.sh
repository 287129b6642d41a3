#!/usr/bin/env bash
# Smoke test of a built wheel, as a stranger would use it: a fresh venv, `pip install` of the
# wheel (its dependencies from the index pip is configured with), run from outside the repo.
#
#   bash tools/test_wheel.sh [--python PY] WHEEL_DIR|WHEEL
#
# PY (default python3) makes the venv: an older CPython tests the abi3 floor (3.9).
# Checks that `import cellm` comes from the venv's site-packages, that every module of the
# installed package imports (a file left out of the wheel shows up here), that the package data
# is there, that the `cellm` command runs, and that a tiny checkpoint shipped in the repo
# converts and generates text. Prints "wheel smoke test: ok" at the end.
set -euo pipefail

python=python3
if [[ $# -eq 3 && "$1" == --python ]]; then
    python="$2"
    shift 2
fi
if [[ $# -ne 1 ]]; then
    echo "usage: bash tools/test_wheel.sh [--python PY] WHEEL_DIR|WHEEL" >&2
    exit 2
fi
repo="$(cd "$(dirname "$0")/.." && pwd)"
if [[ -d "$1" ]]; then
    shopt -s nullglob
    wheels=("$1"/cellm-*.whl)
    if [[ ${#wheels[@]} -ne 1 ]]; then
        echo "test_wheel: want exactly one cellm-*.whl in $1, found ${#wheels[@]}" >&2
        exit 1
    fi
    wheel="${wheels[0]}"
else
    wheel="$1"
fi
wheel="$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")"
start=$SECONDS

work="$(mktemp -d "${TMPDIR:-/tmp}/cellm-wheel-test.XXXXXX")"
trap 'rm -rf "$work"' EXIT
# Nothing from the repo may leak in: no PYTHONPATH, no user site, and the cwd is not the repo.
unset PYTHONPATH PYTHONHOME
export PYTHONNOUSERSITE=1
cd "$work"
"$python" -m venv "$work/venv"
py="$work/venv/bin/python"
echo "test_wheel: pip install $(basename "$wheel") into a venv of $("$py" --version)"
"$py" -m pip install --quiet "$wheel"

"$py" - "$repo" <<'EOF'
import importlib
import pkgutil
import sys
import sysconfig
from importlib.resources import files
from pathlib import Path

repo = Path(sys.argv[1]).resolve()
site = {Path(sysconfig.get_path(k)).resolve() for k in ("purelib", "platlib")}

import cellm  # noqa: E402
import cellm._core  # noqa: E402

for mod in (cellm, cellm._core):
    where = Path(mod.__file__).resolve()
    if repo in where.parents or not any(s in where.parents for s in site):
        sys.exit(f"test_wheel: {mod.__name__} comes from {where}, not the venv's site-packages")
print(f"test_wheel: cellm {cellm.__version__} from {Path(cellm.__file__).parent}")

bad = []
names = []
for info in pkgutil.walk_packages(cellm.__path__, "cellm."):
    names.append(info.name)
    try:
        importlib.import_module(info.name)
    except Exception as e:  # report them all, not just the first
        bad.append(f"{info.name}: {e!r}")
if bad:
    sys.exit("test_wheel: modules that do not import:\n  " + "\n  ".join(bad))
if "cellm.families" not in names:
    sys.exit("test_wheel: the cellm.families package is not in the wheel")
print(f"test_wheel: all {len(names)} modules of the installed package import")

pkg = files("cellm")
data = [p.name for p in (pkg / "data").iterdir()] if (pkg / "data").is_dir() else []
for name in ("registry.toml", "py.typed", "_core.pyi"):
    if not (pkg / name).is_file():
        sys.exit(f"test_wheel: cellm/{name} is not in the installed package")
if not data:
    sys.exit("test_wheel: cellm/data/ is missing or empty in the installed package")
from cellm.fetch import load_registry  # noqa: E402

entries, default = load_registry()
print(f"test_wheel: package data there (data/: {', '.join(sorted(data))}); "
      f"registry: {len(entries)} models, default {default}")
EOF

"$work/venv/bin/cellm" --version
"$py" -m cellm.convert --input "$repo/tests/fixtures/hf-tiny/llama" --output "$work/tiny.cellm"
text="$("$py" -m cellm.infer --model "$work/tiny.cellm" --prompt hello --gen 8)"
if [[ -z "$text" ]]; then
    echo "test_wheel: cellm.infer printed no text" >&2
    exit 1
fi
printf 'test_wheel: generated: %q\n' "$text"
echo "test_wheel: $((SECONDS - start))s"
echo "wheel smoke test: ok"
