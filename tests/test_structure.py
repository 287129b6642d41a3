"""The module structure stays a DAG: no crate and no part of the Python package imports
itself in a loop (tools/module_deps.py finds the edges)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT

TREES = [
    *[[str(p.relative_to(ROOT))] for p in sorted((ROOT / "crates").glob("*/src"))],
    ["python", "--python"],
]


@pytest.mark.parametrize("args", TREES, ids=lambda a: a[0])
def test_no_module_cycles(args):
    proc = subprocess.run(
        [sys.executable, "tools/module_deps.py", *args], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    *edges, last = proc.stdout.splitlines()
    files = list((ROOT / args[0]).rglob("*.rs" if len(args) == 1 else "*.py"))
    # A crate of a few files may use none of its own modules; a larger one always does.
    assert edges or len(files) <= 3, "no edges found: the scan is broken"
    assert last == "cycles: none", last
