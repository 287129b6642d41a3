"""Generation semantics on a fixture: stopping, streaming, seeding and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cellm import LLM
from conftest import ROOT, Reference


@pytest.fixture(scope="module")
def llm(converted):
    return LLM(converted("llama", "f32"), kv_encoding="f32")


def test_stops_on_end_of_turn_id(llm):
    greedy = Reference("llama").prompts[1]
    ids, first = greedy["input_ids"], greedy["greedy_ids"][0]
    out = llm.generate(ids, max_tokens=5, stop_token_ids=[first])
    assert out.finish_reason == "stop" and out.token_ids == []
    out = llm.generate(ids, max_tokens=5, ignore_eos=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_stop_string_cuts_the_text(llm):
    full = llm.generate("def main(argv):", max_tokens=12, ignore_eos=True)
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop, full.text
    cut = llm.generate("def main(argv):", max_tokens=12, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


def test_stream_concatenates_to_generate(llm):
    kw = dict(max_tokens=20, temperature=0.9, top_k=40, seed=7, ignore_eos=True)
    assert (
        "".join(llm.stream("The quick brown fox", **kw))
        == llm.generate("The quick brown fox", **kw).text
    )


def test_seed_reproduces_and_varies(llm):
    kw = dict(max_tokens=16, temperature=1.0, ignore_eos=True)
    a = llm.generate("hello", seed=1, **kw).token_ids
    assert a == llm.generate("hello", seed=1, **kw).token_ids
    assert a != llm.generate("hello", seed=2, **kw).token_ids


def test_result_carries_timings(llm):
    r = llm.generate("hello", max_tokens=4, ignore_eos=True)
    assert r.prompt_tokens == r.timings.prefill_tokens == len(llm.encode("hello"))
    assert r.timings.decode_tokens == 3 and r.timings.decode_tps > 0


def test_infer_cli_streams_text_and_reports_timings(converted):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    path = str(converted("llama", "f32"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cellm.infer",
            "--model",
            path,
            "--prompt",
            "hi",
            "--chat",
            "--system",
            "be brief",
            "--gen",
            "6",
            "--kv-encoding",
            "f32",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "prefill:" in proc.stderr and "decode:" in proc.stderr
    llm = LLM(path, kv_encoding="f32", threads=1)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    want = llm.chat(messages, max_tokens=6)
    assert proc.stdout == want.text + "\n"


def test_held_back_text_is_emitted_when_an_end_id_stops(llm):
    """A possible stop-string prefix held back by the matcher is text, not a stop: when an
    end-of-turn id ends generation it must still come out."""
    prompt = "def main(argv):"
    full = llm.generate(prompt, max_tokens=12, ignore_eos=True)
    end = full.token_ids[6]
    before = full.token_ids[: full.token_ids.index(end)]
    want = llm.tokenizer.decode(before)
    assert len(want) >= 2
    # The text's last two characters start this stop string, so the matcher holds them back.
    stop = want[-2:] + "\x00never"
    out = llm.generate(prompt, max_tokens=12, stop_token_ids=[end], stop=[stop])
    assert out.finish_reason == "stop" and out.token_ids == before
    assert out.text == want
