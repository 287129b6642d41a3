"""Constrained decoding on the registry's real models (network: fetched once into the model
cache, as the parity tests fetch them): JSON sampled at temperature 1 validates with
`jsonschema` for every schema of tests/test_structured.py plus one with longer strings, on a
byte-level BPE vocabulary (SmolLM2, Qwen2.5-Coder) and a SentencePiece one with byte
fallback (Gemma 3, a base model: prompted with text, not a chat)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cellm import LLM, SamplingParams
from cellm.fetch import fetch
from test_structured import SCHEMAS, json_format

pytestmark = pytest.mark.network

# Samples per schema: fewer on the larger models, to keep this under ~2.5 minutes on CI.
MODELS = {"smollm2-135m-instruct": 4, "qwen2.5-coder-0.5b-instruct": 2, "gemma-3-270m": 2}
REAL_SCHEMAS = {
    **SCHEMAS,
    # Strings of sentence length. Unbounded ones validate whenever they end, but at
    # temperature 1 a 135M model can run on inside one past any token budget.
    "sentences": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "author": {"type": "string", "maxLength": 40},
            "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        },
        "required": ["title", "author", "year"],
        "additionalProperties": False,
    },
}
TOPICS = ["a user account", "a book", "the weather", "a shopping list"]


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return LLM(fetch(request.param, progress=False), threads=2), MODELS[request.param]


def prompts(llm, samples, schema):
    """One prompt per topic (so the samples differ), in a chat where the model has one."""
    topics = TOPICS[:samples]
    texts = [f"Describe {t} as JSON matching this schema: {json.dumps(schema)}" for t in topics]
    if llm.is_base_model:
        return [f"{t}\nJSON: " for t in texts]
    return [llm.prompt_ids([{"role": "user", "content": t}]) for t in texts]


@pytest.mark.parametrize("name", REAL_SCHEMAS)
def test_sampled_json_validates_on_real_models(model, name):
    llm, samples = model
    schema = REAL_SCHEMAS[name]
    params = SamplingParams(
        temperature=1.0, seed=0, max_tokens=200, response_format=json_format(schema)
    )
    for r in llm.generate_batch(prompts(llm, samples, schema), params=params):
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), schema)
