#!/usr/bin/env bash
# The whole test suite: formatting, lints, Rust tests, Python tests. Run after `pip install -e ".[test]"`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
bash tools/test_aarch64.sh
ruff check python tests tools benches
ruff format --check python tests tools benches
python -m mypy  # [tool.mypy] in pyproject.toml: strict, over python/cellm
python -m mypy.stubtest cellm._core  # python/cellm/_core.pyi against the built extension
python -m pytest -q
# The .cellm reader and model loader under libFuzzer, a short fixed budget (a longer run:
# `bash tools/fuzz.sh --seconds 600`).
bash tools/fuzz.sh --runs 3000 --no-fixtures
