"""The public generation API's signatures: explicit keywords, a SamplingParams object, and the
GenerationResult that stream() returns."""

from __future__ import annotations

import pytest

from cellm import LLM, GenerationResult, InvalidArgument, SamplingParams


@pytest.fixture(scope="module")
def llm(converted):
    return LLM(converted("llama", "f32"), kv_encoding="f32")


MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("method", ["generate", "stream", "chat"])
def test_wrong_keyword_names_the_public_method(llm, method):
    arg = MESSAGES if method == "chat" else "hello"
    with pytest.raises(
        TypeError, match=rf"{method}\(\) got an unexpected keyword argument 'max_token'"
    ):
        getattr(llm, method)(arg, max_token=3)


def test_params_must_be_sampling_params(llm):
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate("hello", params={"max_tokens": 3})


def test_params_and_keywords_agree(llm):
    kw = dict(max_tokens=6, ignore_eos=True, repeat_penalty=1.3)
    by_keywords = llm.generate("hello", **kw)
    by_params = llm.generate("hello", params=SamplingParams(**kw))
    assert by_params.token_ids == by_keywords.token_ids and len(by_keywords.token_ids) == 6
    assert by_params.text == by_keywords.text
    chat = llm.chat(MESSAGES, params=SamplingParams(**kw))
    assert chat.token_ids == llm.chat(MESSAGES, **kw).token_ids


def test_keywords_override_params(llm):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    assert len(llm.generate("hello", params=params, max_tokens=2).token_ids) == 2
    assert params.max_tokens == 6  # the caller's object is not changed
    with pytest.raises(InvalidArgument, match="max_tokens"):
        llm.generate("hello", params=SamplingParams(max_tokens=0))


def test_stream_returns_the_result(llm):
    events = llm.stream("hello", params=SamplingParams(max_tokens=5, ignore_eos=True))
    pieces = []
    with pytest.raises(StopIteration) as done:
        while True:
            pieces.append(next(events))
    result = done.value.value
    assert isinstance(result, GenerationResult)
    assert result.text == "".join(pieces) and len(result.token_ids) == 5
    assert result.token_ids == llm.generate("hello", max_tokens=5, ignore_eos=True).token_ids
