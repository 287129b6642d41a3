"""What `--model` / `cellm.LLM(...)` accept besides paths: registry names (with a "did you
mean" on a typo) and Hugging Face Hub ids, found offline in a cache laid out as
huggingface_hub lays it out. Also the `cellm` command's own usage."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cellm import LLM
from cellm.errors import FormatError
from cellm.fetch import registry_names
from cellm.resolve import resolve_model
from conftest import FIXTURES, ROOT

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo_id: str, fixture: str) -> Path:
    """`root` as a HF hub cache holding `repo_id` at one commit: blobs, refs/main and a
    snapshot folder (files copied, where the hub would symlink them into blobs/)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "blobs").mkdir()
    shutil.copytree(FIXTURES / fixture, repo / "snapshots" / COMMIT)
    return root


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cellm", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **env},
    )


def test_hub_id_is_read_from_the_offline_hf_cache(tmp_path):
    hub = hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", "llama")
    env = {
        "HF_HUB_CACHE": str(hub),
        "HF_HUB_OFFLINE": "1",
        "CELLM_CACHE_DIR": str(tmp_path / "cellm"),
    }
    proc = cli(
        "infer", "--model", "tiny-org/tiny-llama", "--prompt", "hello", "--gen", "6", env=env
    )
    assert proc.returncode == 0, proc.stderr
    want = LLM(FIXTURES / "llama", threads=1).generate("hello", max_tokens=6).text
    assert proc.stdout == want + "\n"
    assert list((tmp_path / "cellm" / "converted").glob("*.cellm")), "converted into the cache"

    missing = cli("infer", "--model", "tiny-org/absent", "--prompt", "x", env=env)
    assert missing.returncode == 2
    (line,) = missing.stderr.strip().splitlines()
    assert line.startswith("error: tiny-org/absent: not in the Hugging Face cache")


def test_unknown_names_suggest_the_registry_names():
    names = registry_names()
    with pytest.raises(FormatError) as e:
        resolve_model("smollm2")
    assert f"Did you mean {names[names.index('smollm2-135m-instruct')]!r}?" in str(e.value)
    assert all(n in str(e.value) for n in names)
    with pytest.raises(FormatError, match="qwen2.5-coder-0.5b-instruct"):
        resolve_model("qwen2.5-coder-0.5b-instrct")  # a typo
    with pytest.raises(FormatError, match="no such file, registry model or Hugging Face id"):
        resolve_model("./not/here.cellm")


def test_cellm_command_usage_and_bad_commands():
    ok = cli("--help", env={})
    assert ok.returncode == 0 and "chat" in ok.stdout and "infer" in ok.stdout
    bad = cli("serve-me", env={})
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown command 'serve-me'")
    version = cli("--version", env={})
    assert version.returncode == 0 and version.stdout.startswith("cellm ")
