"""Constrained decoding (cellm.structured) on the tiny fixtures: outputs sampled at temperature 1
from random-weight models (which, unconstrained, write noise) all validate with `jsonschema`,
match their regular expression or parse with their grammar, through every generation path
(generate, stream, chat, batch, the server); bad constraints fail before any engine step.

Both tokenizer kinds run: the qwen2 fixture's byte-level BPE and the gemma3 fixture's
SentencePiece-style BPE with byte fallback. The fixtures' schemas bound their strings
(maxLength) and forbid extra properties: a random model never chooses to close a free string,
so an unbounded one would end at max_tokens, not in a constraint failure."""

from __future__ import annotations

import json
import random
import re
from contextlib import nullcontext
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from cellm import LLM, SamplingParams
from cellm.sampling import make_sampler
from cellm.structured import GrammarError, TokenConstraint, grammar_for
from cellm.tokenizer import Tokenizer

pytest.importorskip("llguidance")

FIXTURES = Path(__file__).parent / "fixtures" / "hf-tiny"

TOKENIZER_KINDS = ["qwen2", "gemma3"]  # byte-level BPE; BPE with byte fallback

SHORT = {"type": "string", "maxLength": 8}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": SHORT, "id": {"type": "integer", "maximum": 10**6}},
                "required": ["name", "id"],
                "additionalProperties": False,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["user", "ok"],
        "additionalProperties": False,
    },
    "bounded_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum": {"enum": ["red", "green", "blue", 7, None]},
    "number_range": {
        "type": "object",
        "properties": {
            "t": {"type": "number", "minimum": -1.5, "maximum": 2.25},
            "n": {"type": "integer", "exclusiveMinimum": 10, "maximum": 1000},
        },
        "required": ["t", "n"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {"a": SHORT, "b": {"enum": [1, 2, 3]}, "c": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
    },
    "any_of": {
        "anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 99999},
            {
                "type": "object",
                "properties": {"kind": {"const": "text"}, "v": SHORT},
                "required": ["kind", "v"],
                "additionalProperties": False,
            },
        ]
    },
}
SEEDS = range(4)


@pytest.fixture(scope="module", params=TOKENIZER_KINDS)
def llm(request, converted):
    return LLM(converted(request.param, "f32"), kv_encoding="f32", threads=1)


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.mark.parametrize("name", SCHEMAS)
def test_sampled_json_validates(llm, name):
    schema = SCHEMAS[name]
    results = llm.generate_batch(
        ["Answer in JSON:"] * len(SEEDS),
        params=SamplingParams(temperature=1.0, max_tokens=120, response_format=json_format(schema)),
    )
    results += [
        llm.generate(
            "Data", temperature=1.0, seed=s, max_tokens=120, response_format=json_format(schema)
        )
        for s in SEEDS
    ]
    for r in results:
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), schema)


def test_json_object_and_a_bare_schema(llm):
    r = llm.generate(
        "x", temperature=1.0, seed=0, max_tokens=200, response_format={"type": "json_object"}
    )
    # Any object: a random model may wander into free strings, so only a finished one parses.
    if r.finish_reason == "stop":
        assert isinstance(json.loads(r.text), dict)
    else:
        assert r.text.startswith("{")
    schema = SCHEMAS["bounded_array"]
    r = llm.generate(
        "x", temperature=1.0, seed=1, response_format={"type": "json_schema", "json_schema": schema}
    )
    jsonschema.validate(json.loads(r.text), schema)


@pytest.mark.parametrize(
    "pattern", [r"[0-9]{3}-[a-z]{2}", r"(yes|no|maybe)!?", r"\(\d{1,3}\) [A-Z][a-z]{0,4}"]
)
def test_sampled_text_matches_the_regex(llm, pattern):
    for seed in SEEDS:
        r = llm.generate("Say:", temperature=1.0, seed=seed, max_tokens=40, regex=pattern)
        assert r.finish_reason == "stop" and re.fullmatch(pattern, r.text), r.text


# Sums of small integers: the grammar's language, checked by an independent parser below.
SUM_GRAMMAR = r"""
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}/
"""


def _is_sum(text: str) -> bool:
    """Recursive descent over the same language, written independently of the grammar."""
    pos = 0

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal pos
        if text.startswith("(", pos):
            pos += 1
            if not expr() or not text.startswith(")", pos):
                return False
            pos += 1
            return True
        m = re.compile(r"[1-9][0-9]{0,2}").match(text, pos)
        if m is None:
            return False
        pos = m.end()
        return True

    return expr() and pos == len(text)


def test_sampled_text_parses_with_the_lark_grammar(llm):
    finished = 0
    for seed in range(8):
        r = llm.generate("Sum:", temperature=1.0, seed=seed, max_tokens=30, grammar=SUM_GRAMMAR)
        if r.finish_reason == "stop":
            finished += 1
            assert _is_sum(r.text), r.text
        else:  # cut by max_tokens: still a prefix the grammar allows
            assert re.fullmatch(r"[0-9+\-()]+", r.text), r.text
    assert finished >= 4


def test_stream_and_chat_are_constrained_too(llm):
    schema = SCHEMAS["optional_fields"]
    stream = llm.stream("x", temperature=1.0, seed=3, response_format=json_format(schema))
    pieces = []
    try:
        while True:
            pieces.append(next(stream))
    except StopIteration as done:
        result = done.value
    assert "".join(pieces) == result.text
    jsonschema.validate(json.loads(result.text), schema)
    messages = [{"role": "user", "content": "Give me JSON"}]
    chat = llm.chat(
        messages, chat_format="chatml", temperature=1.0, seed=4, response_format=json_format(schema)
    )
    jsonschema.validate(json.loads(chat.text), schema)


def test_the_output_ends_when_the_grammar_does(llm):
    # No end-of-turn token is needed: once nothing may follow, generation stops without
    # another engine step (ignore_eos cannot run it past the end either).
    r = llm.generate("x", regex="abc", ignore_eos=True, max_tokens=50)
    assert (r.text, r.finish_reason, r.stop_token_id) == ("abc", "stop", None)


def test_the_mask_applies_before_greedy_and_the_filters():
    logits = np.array([5.0, 1.0, 3.0, 4.0, 3.0], dtype=np.float32)
    allowed = np.array([1, 2, 4])
    assert make_sampler()(logits, [], allowed) == 2  # best allowed; tie 2/4 -> lowest id
    sampler = make_sampler(SamplingParams(temperature=1.0, top_k=1, seed=0))
    assert {sampler(logits, [], allowed) for _ in range(20)} == {2, 4}  # top-k keeps ties
    sampler = make_sampler(SamplingParams(temperature=1.0, seed=0))
    draws = [sampler(logits, [], allowed) for _ in range(3000)]
    # Renormalised over the allowed ids: p = softmax([1, 3, 3]) = (0.063, 0.468, 0.468).
    freq = np.bincount(draws, minlength=5) / len(draws)
    expected = np.exp([1.0, 3.0, 3.0]) / np.exp([1.0, 3.0, 3.0]).sum()
    assert freq[[0, 3]].sum() == 0
    # 5 binomial standard errors at n=3000 (p=0.47: 0.009).
    assert np.allclose(freq[[1, 2, 4]], expected, atol=0.05)


@pytest.mark.parametrize(
    "constraint, message",
    [
        ({"regex": "a(b"}, "invalid regex"),
        ({"grammar": "start: foo"}, "unknown name"),
        ({"grammar": 5}, "grammar must be a string"),
        (
            {"response_format": json_format({"type": "integer", "minimum": 5, "maximum": 3})},
            "minimum (5) is greater than maximum (3)",
        ),
        ({"response_format": json_format({"type": "strin"})}, "strin"),
        ({"response_format": {"type": "xml"}}, "response_format type"),
        ({"response_format": {"type": "json_schema"}}, "needs a json_schema"),
        ({"regex": "a", "grammar": 'start: "a"'}, "at most one"),
        ({"response_format": json_format({"enum": []})}, "Unsatisfiable"),
    ],
)
def test_bad_constraints_fail_before_any_step(llm, constraint, message):
    pages = llm.kv_stats()[1]
    with pytest.raises(GrammarError) as e:
        llm.generate("x", **constraint)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert llm.kv_stats()[1] == pages  # no session stepped, no page allocated


def test_any_character_is_spelled_by_byte_level_and_byte_fallback_vocabularies(converted):
    for name in TOKENIZER_KINDS:
        llm = LLM(converted(name, "f32"), kv_encoding="f32", threads=1)
        assert llm.generate("x", regex="é☃", max_tokens=10).text == "é☃"


def test_text_a_vocabulary_cannot_spell_is_refused_before_generating():
    # A SentencePiece-style vocabulary without byte fallback (the gemma3 fixture's tokenizer
    # with its vocabulary cut to a, b, ab): "c" cannot be written at all.
    spec = json.loads((FIXTURES / "gemma3" / "tokenizer.json").read_text())
    spec["model"].update(
        vocab={"<pad>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4, "▁": 5},
        merges=[["a", "b"]],
        byte_fallback=False,
    )
    spec["added_tokens"] = [
        {
            "id": 1,
            "content": "</s>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    ]
    tokenizer = Tokenizer.from_json_str(json.dumps(spec), eos_token="</s>")
    allowed = TokenConstraint(grammar_for(regex="ab+"), tokenizer, frozenset({1})).allowed()
    assert allowed.size and set(allowed) <= {2, 4}  # "a" or "ab"
    with pytest.raises(GrammarError, match="cannot spell any text .* after 0 generated tokens"):
        TokenConstraint(grammar_for(regex="c"), tokenizer, frozenset({1}))


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema drawn from the kinds above (objects with optional fields, bounded arrays,
    enums, numeric ranges, anyOf, const), nested up to three levels; strings are bounded."""
    kinds = ["integer", "number", "boolean", "enum", "string", "const"]
    if depth < 3:
        kinds += ["object", "array", "any_of"]
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        low = rng.uniform(-10, 10)
        return {"type": "number", "minimum": round(low, 2), "maximum": round(low + 5, 2)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        choices = ["a", "b c", 'd"e', 1, 2.5, True, None]
        return {"enum": rng.sample(choices, rng.randint(1, 4))}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "const":
        return {"const": rng.choice(["x", 3, False])}
    if kind == "array":
        low = rng.randint(0, 2)
        items = random_schema(rng, depth + 1)
        high = low + rng.randint(0, 2)
        return {"type": "array", "items": items, "minItems": low, "maxItems": high}
    if kind == "any_of":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(2)]}
    names = rng.sample(["id", "name", "tags", "size", "ok", "kind"], rng.randint(1, 3))
    return {
        "type": "object",
        "properties": {n: random_schema(rng, depth + 1) for n in names},
        "required": rng.sample(names, rng.randint(0, len(names))),
        "additionalProperties": False,
    }


@pytest.mark.parametrize("seed", range(12))
def test_random_schemas_validate(llm, seed):
    schema = random_schema(random.Random(seed))
    r = llm.generate(
        "JSON:", temperature=1.0, seed=seed, max_tokens=200, response_format=json_format(schema)
    )
    assert r.finish_reason == "stop", (schema, r.text)
    jsonschema.validate(json.loads(r.text), schema)


def test_infer_cli_flags(converted, tmp_path, capsys):
    from cellm.infer import main

    model = str(converted("qwen2", "f32"))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMAS["bounded_array"]))
    grammar = tmp_path / "sum.lark"
    grammar.write_text(SUM_GRAMMAR)
    common = ["--model", model, "--prompt", "x", "--temperature", "1", "--seed", "2"]
    assert main([*common, "--json-schema", str(schema)]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), SCHEMAS["bounded_array"])
    assert main([*common, "--regex", "[a-c]{4}"]) == 0
    assert re.fullmatch("[a-c]{4}\n", capsys.readouterr().out)
    assert main([*common, "--grammar", str(grammar), "--gen", "30"]) == 0
    out = capsys.readouterr().out.strip()
    assert re.fullmatch(r"[0-9+\-()]+", out)
    # Bad input: one line naming the problem, exit 2, nothing generated.
    schema.write_text('{"type": "strin"}')
    for argv in (
        ["--json-schema", str(tmp_path / "missing.json")],
        ["--json-schema", str(schema)],
        ["--regex", "a(b"],
        ["--regex", "a", "--grammar", str(grammar)],
    ):
        with pytest.raises(SystemExit) if "--grammar" in argv else nullcontext():
            code = main([*common, *argv])
            assert code == 2
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err


def test_unconstrained_requests_do_not_need_llguidance(monkeypatch):
    """Python 3.9 has no llguidance wheel: a request without a constraint (or asking for plain
    text) must not import it."""
    import cellm.structured as structured

    def missing() -> None:
        raise AssertionError("llguidance imported for an unconstrained request")

    monkeypatch.setattr(structured, "_llguidance", missing)
    assert structured.grammar_for() is None
    assert structured.grammar_for({"type": "text"}) is None
    with pytest.raises(AssertionError, match="llguidance imported"):
        structured.grammar_for(regex="[0-9]+")
