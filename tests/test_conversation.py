"""Multi-turn chats that keep their KV session (`LLM.conversation`, `cellm chat`): each turn
must answer exactly as a fresh chat over the whole conversation would, while prefilling
only what the cache does not hold."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cellm import LLM
from cellm.errors import ContextOverflow
from conftest import ROOT

QUESTIONS = ["hello there", "and then?", "one more"]


def drain(events):
    pieces = []
    while True:
        try:
            pieces.append(next(events))
        except StopIteration as done:
            return "".join(pieces), done.value


@pytest.mark.parametrize("name", ["llama", "lfm2"])  # attention only; with recurrent state
def test_each_turn_matches_a_fresh_chat_and_prefills_only_the_new_part(name, converted):
    llm = LLM(converted(name, "f32"), kv_encoding="f32", threads=1)
    conversation = llm.conversation(system="be brief", params=None)
    messages = [{"role": "system", "content": "be brief"}]
    for i, question in enumerate(QUESTIONS):
        text, result = drain(conversation.send(question))
        messages.append({"role": "user", "content": question})
        fresh = llm.chat(messages, max_tokens=256)
        assert text == result.text == fresh.text
        assert result.token_ids == fresh.token_ids
        if i and name == "llama":
            # The cache held the earlier turns: fewer tokens were prefilled than the
            # prompt holds (a fresh chat now starts from the prefix cache too).
            assert result.timings.prefill_tokens < result.prompt_tokens
        messages.append({"role": "assistant", "content": fresh.text})
    assert conversation.messages == messages
    conversation.close()


def test_reset_forgets_the_turns_but_keeps_the_system_message(converted):
    llm = LLM(converted("llama", "f32"), kv_encoding="f32", threads=1)
    conversation = llm.conversation(system="sys")
    drain(conversation.send("hello"))
    conversation.reset()
    assert conversation.messages == [{"role": "system", "content": "sys"}]
    assert conversation.cached_tokens == 0
    _, result = drain(conversation.send("hello"))
    fresh = llm.chat([{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}])
    assert result.token_ids == fresh.token_ids


def test_a_turn_past_the_context_leaves_the_conversation_as_it_was(converted):
    llm = LLM(converted("llama", "f32"), kv_encoding="f32", threads=1, context_length=64)
    conversation = llm.conversation()
    drain(conversation.send("hi"))
    before = list(conversation.messages)
    with pytest.raises(ContextOverflow):
        drain(conversation.send("word " * 80))
    assert conversation.messages == before


def test_cellm_chat_reads_turns_from_stdin(converted):
    model = str(converted("llama", "f32"))
    turns = "hello there\n/reset\nhello there\n/exit\nnot read\n"
    proc = subprocess.run(
        [sys.executable, "-m", "cellm", "chat", "--model", model, "--gen", "8", "--threads", "1"],
        input=turns,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()
    llm = LLM(model, threads=1)
    want = llm.chat([{"role": "user", "content": "hello there"}], max_tokens=8).text
    assert first == second == want  # /reset started over; /exit ended before "not read"
    assert "conversation cleared" in proc.stderr
