"""GGUF tokenizer metadata -> tokenizer.json, checked against llama.cpp's own test vectors.

The vectors (vocabulary-only GGUF files with .inp/.out cases, from the pinned llama-cpp-python
sdist) are fetched once into the cache by tools/fetch_llama_cpp_vectors.py; the tests skip only
if that download fails. Cases are tokenised as llama.cpp's test-tokenizer-0 does: no BOS/EOS,
special tokens in the text not parsed.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache, lru_cache
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from cellm.convert.gguf import GGUFFile
from cellm.convert.gguf_tokenizer import PRE_TYPES, tokenizer_from_gguf
from cellm.errors import FormatError, UnsupportedArchitecture
from cellm.tokenizer import Tokenizer

TOOLS = Path(__file__).resolve().parent.parent / "tools"

# These must pass every case.
REQUIRED = ("llama-spm", "llama-bpe", "qwen2", "gpt-2", "phi-3", "starcoder")
# Tokenizer kinds cellm does not reproduce: WordPiece (bert) and Unigram (t5).
UNSUPPORTED = {
    "bert-bge": "tokenizer.ggml.model 'bert' (WordPiece) is not supported",
    "nomic-bert-moe": "tokenizer.ggml.model 't5' (Unigram) is not supported",
}


def _tool(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


vectors = _tool("fetch_llama_cpp_vectors")
table = _tool("tokenizer_table")


@lru_cache(maxsize=1)
def _root() -> Path | str:
    try:
        return vectors.fetch()
    except Exception as e:  # no network, proxy, disk full...
        return f"llama.cpp test vectors could not be downloaded: {type(e).__name__}: {e}"


def _vocab_params() -> list:
    root = _root()
    if isinstance(root, str):
        return [pytest.param(None, marks=pytest.mark.skip(reason=root), id="no-vectors")]
    params = []
    for path in vectors.vocab_files(root):
        name = table.vocab_name(path)
        marks = []
        if name in UNSUPPORTED:
            reason = UNSUPPORTED[name]
            marks.append(
                pytest.mark.xfail(raises=UnsupportedArchitecture, strict=True, reason=reason)
            )
        params.append(pytest.param(path, id=name, marks=marks))
    return params


def _path(name: str) -> Path:
    root = _root()
    if isinstance(root, str):
        pytest.skip(root)
    return root / "models" / f"ggml-vocab-{name}.gguf"


@cache
def _metadata(path: Path) -> dict:
    return GGUFFile(path).metadata


@cache
def _converted(path: Path):
    return tokenizer_from_gguf(_metadata(path))


def _tokenizer(path: Path, parse_special: bool = False) -> Tokenizer:
    tok = _converted(path)
    t = Tokenizer.from_json_str(
        tok.json, bos_token=tok.bos_token, eos_token=tok.eos_token, add_bos_token=tok.add_bos_token
    )
    t.raw.encode_special_tokens = not parse_special
    return t


def test_required_vocabularies_are_present():
    root = _root()
    if isinstance(root, str):
        pytest.skip(root)
    names = {table.vocab_name(p) for p in vectors.vocab_files(root)}
    assert set(REQUIRED) <= names


@pytest.mark.parametrize("path", _vocab_params())
def test_llama_cpp_vectors(path: Path):
    cases = vectors.read_cases(path)
    tok = _tokenizer(path)  # UnsupportedArchitecture for the xfail ones
    if cases is None:  # vocabularies shipped without cases: the tokenizer must still round-trip
        for text in ("Hello world", "  3333 x\n\n y\t", "🦙.cpp нещо 我想"):
            ids = tok.encode(text, add_special_tokens=False)
            assert tok.decode(ids, skip_special_tokens=False) == text
        return
    failures = []
    for text, expected in cases:
        got = tok.encode(text, add_special_tokens=False)
        if got != expected:
            failures.append(f"{text!r}: expected {expected}, got {got}")
    assert not failures, f"{len(failures)}/{len(cases)} cases differ:\n" + "\n".join(failures)


@pytest.mark.parametrize("name", REQUIRED)
def test_decode_round_trips(name: str):
    path = _path(name)
    tok = _tokenizer(path)
    for text, _ in vectors.read_cases(path):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_table_lists_every_vocabulary():
    root = _root()
    if isinstance(root, str):
        pytest.skip(root)
    results = [table.check_vocab(p) for p in vectors.vocab_files(root) if "llama-spm" in p.name]
    text = table.table(results)
    assert "| llama-spm | 46 | 46 |" in text


# -- special tokens, BOS/EOS and end-of-turn ids ---------------------------------------------


def test_qwen2_special_tokens_in_text_map_to_their_ids():
    path = _path("qwen2")
    tok = _tokenizer(path, parse_special=True)
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert (start, end) == (151644, 151645)
    body = tok.encode("user\nHi there", add_special_tokens=False)
    got = tok.encode("<|im_start|>user\nHi there<|im_end|>", add_special_tokens=False)
    assert got == [start, *body, end]
    # With parse_special off (llama.cpp's default for user text) they are plain text.
    plain = _tokenizer(path).encode("<|im_start|>", add_special_tokens=False)
    assert start not in plain and len(plain) > 1
    # Control tokens are special (skipped when decoding); user-defined ones are not.
    assert tok.decode([start, *body, end]) == "user\nHi there"
    assert tok.decode([151646]) == "[PAD151646]"  # a user-defined token of this vocabulary
    # User-defined tokens are matched in text even with parse_special off, as in llama.cpp.
    assert _tokenizer(path).encode("x[PAD151646]", add_special_tokens=False)[-1] == 151646


def test_spm_prefix_space_follows_special_tokens_like_llama_cpp():
    # llama.cpp puts the SentencePiece space prefix before every text fragment that follows a
    # special token (and before the first one).
    path = _path("phi-3")
    tok = _tokenizer(path, parse_special=True)
    user, end = tok.token_to_id("<|user|>"), tok.token_to_id("<|end|>")
    hi = tok.encode("Hi", add_special_tokens=False)
    assert hi == [tok.token_to_id("\u2581Hi")]
    assert tok.encode("<|user|>Hi<|end|>", add_special_tokens=False) == [user, *hi, end]


@pytest.mark.parametrize(
    ("name", "bos", "eos", "add_bos", "ends"),
    [
        ("llama-spm", "<s>", "</s>", True, [2]),
        ("phi-3", "<s>", "<|endoftext|>", True, [32000, 32007]),  # + <|end|>
        ("llama-bpe", "<|begin_of_text|>", "<|end_of_text|>", True, [128001, 128009]),
        ("qwen2", "<|endoftext|>", "<|endoftext|>", False, [151643, 151645]),  # + <|im_end|>
        ("gpt-2", "<|endoftext|>", "<|endoftext|>", False, [50256]),
        ("command-r", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", True, [255001]),
    ],
)
def test_special_token_fields(name, bos, eos, add_bos, ends):
    path = _path(name)
    tok = _converted(path)
    assert (tok.bos_token, tok.eos_token, tok.add_bos_token) == (bos, eos, add_bos)
    assert tok.add_eos_token is False
    assert tok.end_of_turn_ids == ends
    t = _tokenizer(path)
    ids = t.encode("Hello", add_special_tokens=True)
    assert (ids[0] == t.bos_token_id) == add_bos
    assert ids[-1] != t.eos_token_id


def test_chat_template_is_passed_through():
    path = _path("qwen2")
    tok = _converted(path)
    assert tok.chat_template == _metadata(path)["tokenizer.chat_template"]
    assert _converted(_path("gpt-2")).chat_template is None


# -- errors on synthetic metadata ------------------------------------------------------------


def _bpe_md(**extra) -> dict:
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": ["a", "b", "ab", "<|end|>"],
        "tokenizer.ggml.token_type": np.array([1, 1, 1, 3], dtype=np.int32),
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": 3,
        "tokenizer.ggml.eot_token_id": 3,
    }
    md.update(extra)
    return md


def test_synthetic_bpe_tokenizer():
    tok = tokenizer_from_gguf(_bpe_md())
    t = Tokenizer.from_json_str(tok.json, eos_token=tok.eos_token)
    assert t.encode("abba<|end|>") == [2, 1, 0, 3]
    assert tok.end_of_turn_ids == [3]
    assert tok.bos_token is None and tok.add_bos_token is False


def test_end_of_turn_ids_add_llama_cpp_eog_control_tokens():
    md = _bpe_md(
        **{
            "tokenizer.ggml.tokens": ["a", "b", "ab", "<|end|>", "<|im_end|>", "</s>"],
            "tokenizer.ggml.token_type": np.array([1, 1, 1, 3, 3, 1], dtype=np.int32),
            "tokenizer.ggml.eot_token_id": None,
            "tokenizer.ggml.eos_token_id": 4,
        }
    )
    md = {k: v for k, v in md.items() if v is not None}
    # eos first; then <|end|> (control, an EOG text in llama.cpp); "</s>" is an ordinary token.
    assert tokenizer_from_gguf(md).end_of_turn_ids == [4, 3]


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        ({"tokenizer.ggml.model": "bert"}, UnsupportedArchitecture, "'bert' is not supported"),
        ({"tokenizer.ggml.model": "t5"}, UnsupportedArchitecture, "'t5' is not supported"),
        ({"tokenizer.ggml.model": "rwkv"}, UnsupportedArchitecture, "'rwkv' is not supported"),
        ({"tokenizer.ggml.pre": "no-such-pre"}, UnsupportedArchitecture, "no-such-pre"),
        ({"tokenizer.ggml.pre": "kimi-k2"}, UnsupportedArchitecture, "kimi-k2"),
        ({"tokenizer.ggml.model": None}, FormatError, "tokenizer.ggml.model"),
        ({"tokenizer.ggml.tokens": None}, FormatError, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.tokens": ["a", "a", "ab", "x"]}, FormatError, "repeated"),
        ({"tokenizer.ggml.merges": None}, FormatError, "merges"),
        ({"tokenizer.ggml.token_type": np.array([1], dtype=np.int32)}, FormatError, "entries"),
        ({"tokenizer.ggml.add_bos_token": True}, FormatError, "bos_token_id"),
    ],
)
def test_bad_metadata(extra, error, match):
    md = {k: v for k, v in _bpe_md(**extra).items() if v is not None}
    with pytest.raises(error, match=match):
        tokenizer_from_gguf(md)


def test_llama_needs_scores():
    md = _bpe_md(**{"tokenizer.ggml.model": "llama"})
    with pytest.raises(FormatError, match="scores"):
        tokenizer_from_gguf(md)


def test_pre_types_cover_smollm2_and_qwen25():
    # SmolLM2 GGUFs carry pre "smollm", Qwen2.5 ones "qwen2" (llama.cpp's convert_hf_to_gguf).
    assert PRE_TYPES["smollm"].type == "SMOLLM"
    assert PRE_TYPES["qwen2"].type == "QWEN2"
    for pre in PRE_TYPES.values():
        assert not pre.type.startswith("_")
