"""The docs for whoever carries on name files that exist."""

from __future__ import annotations

import re

import pytest

from conftest import ROOT

DOCS = ["docs/architecture.md", "docs/adding-a-model.md", "README.md"]
# A repository path in backticks: a known top folder, then anything without spaces.
PATH = re.compile(r"`((?:crates|python|tests|docs|tools|benches|models)/[^`\s]+)`")


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_path_exists(doc):
    text = (ROOT / doc).read_text()
    paths = [p for p in PATH.findall(text) if "<" not in p]  # `<family>.py` is a pattern
    assert paths or doc == "README.md", f"{doc} names no paths (did the pattern break?)"
    missing = [p for p in paths if not (ROOT / p.rstrip("/")).exists()]
    assert not missing, f"{doc} names missing paths: {missing}"
