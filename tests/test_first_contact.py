"""What a new user meets first: the README's Python snippet runs as written, the default model
answers the README's questions correctly at default settings, and base models say they cannot
chat instead of producing noise. The network tests download the default model (469 MiB) once
per run into the shared `network_cache`."""

from __future__ import annotations

import re

import pytest

from cellm import LLM
from cellm.errors import InvalidArgument
from conftest import ROOT

README = (ROOT / "README.md").read_text()
# The README's example questions and the fact each answer must state.
QUESTIONS = [
    ("What is the capital of France?", "Paris"),
    ("What is 12 times 12?", "144"),
    ("Name the largest planet in the solar system.", "Jupiter"),
]


def test_base_models_refuse_chat_without_a_template(converted, monkeypatch):
    llm = LLM(converted("llama", "f32"), threads=1)
    monkeypatch.setattr(llm, "chat_template", None)
    monkeypatch.setattr(llm, "is_base_model", True)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidArgument, match="is a base model with no chat template"):
        llm.chat(messages)
    # Forcing a format is the user's explicit choice.
    assert llm.apply_chat_template(messages, chat_format="chatml").startswith("<|im_start|>")


def test_readme_names_the_questions_it_promises():
    for question, _ in QUESTIONS:
        assert question in README


@pytest.mark.network
def test_default_model_answers_the_readme_questions(network_cache, monkeypatch):
    from cellm.fetch import default_model

    monkeypatch.setenv("CELLM_CACHE_DIR", network_cache)
    llm = LLM(default_model())
    for question, fact in QUESTIONS:
        answer = llm.chat([{"role": "user", "content": question}], max_tokens=32).text
        assert fact in answer, (question, answer)


@pytest.mark.network
def test_readme_python_snippet_runs_as_written(network_cache, monkeypatch, capsys):
    monkeypatch.setenv("CELLM_CACHE_DIR", network_cache)
    (snippet,) = re.findall(r"## Python\n\n```python\n(.*?)```", README, re.S)
    exec(compile(snippet, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "Paris" in out and "Rome" in out  # the conversation's two answers
