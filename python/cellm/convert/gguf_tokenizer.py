"""The tokenizer stored in GGUF metadata, rebuilt as a Hugging Face ``tokenizers`` tokenizer.json.

What llama.cpp (src/llama-vocab.cpp, src/unicode.cpp) does, expressed with HF components:

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. llama.cpp splits the text with a list of
  regexes chosen by ``tokenizer.ggml.pre``, applied one after the other, each to the pieces the
  previous one produced, keeping the unmatched stretches as pieces too; that is a Sequence of
  ``Split(..., behavior="Isolated")`` pre-tokenizers, then ``ByteLevel`` without its own regex.
  The regexes below are llama.cpp's own (its adapted forms, e.g. ``'[sS]`` for ``(?i:'s)``),
  which Oniguruma reads with the meaning llama.cpp gives them. Some pre types set
  ``ignore_merges`` (a piece that is a whole vocabulary entry is taken as is).
* ``"llama"``: SentencePiece BPE. llama.cpp merges the adjacent pair whose concatenation is the
  best-scoring vocabulary entry; that is BPE with merges ranked by the merged token's score
  (as transformers' GGUF converter derives them), byte fallback to ``<0xXX>`` tokens, spaces
  escaped to U+2581 and, with ``add_space_prefix``, a U+2581 put in front of every stretch of
  text (llama.cpp does that after each special token too: a normaliser runs on each stretch).
* ``"gemma4"`` (and the ``sarvam-moe`` pre type): BPE with merges over raw UTF-8, spaces as
  U+2581, text split only at newline runs, byte fallback.
* Control, user-defined and unknown tokens become added tokens (control and unknown ones
  special), so that they are matched in text before the model runs, as llama.cpp does.

No post-processor: BOS is the caller's (cellm's Tokenizer prepends it when add_bos_token).
"""

from __future__ import annotations

import json as _json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from ..errors import FormatError, UnsupportedArchitecture

# tokenizer.ggml.token_type values (llama.h LLAMA_TOKEN_TYPE_*).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE_MARK = "\u2581"  # "▁", SentencePiece's escaped space

# -- llama.cpp's pre-tokenizer regexes (llm_tokenizer_bpe, src/llama-vocab.cpp) ---------------

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK_RUN = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
# (Literal CR/LF here, as in llama.cpp's source: the same regex as "\\r\\n".)
_ASCII_PUNCT_WORD = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
_DEEPSEEK3 = (
    _ASCII_PUNCT_WORD + "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
)
_NOT_PUNCT = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_UPPER_ISH = r"((?=[\p{L}])([^a-z]))"  # llama.cpp's stand-in for [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]
_LOWER_ISH = r"((?=[\p{L}])([^A-Z]))"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER_ISH}*{_LOWER_ISH}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER_ISH}+{_LOWER_ISH}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CASED_WORDS = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _CONTRACTIONS
    + r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _CONTRACTIONS
    + "?"
)
_NEWLINE_RUNS = r"[^\n]+|[\n]+"

_PRE_REGEXES: dict[str, list[str]] = {
    "LLAMA3": [_LLAMA3],
    "JAIS2": [
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)"
        r"|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
    ],
    "DEEPSEEK_LLM": [
        "[\r\n]",
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
        "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
        "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
        "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
        "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
        "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
        "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
        "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
        "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
        "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
        "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
        "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
        "\U000118a0-\U000118df\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        r"\p{N}+",
    ],
    "DEEPSEEK3_LLM": [r"\p{N}{1,3}", _CJK_RUN, _DEEPSEEK3],
    "SPARK2_5": [
        r"\p{N}{1,3}",
        _CJK_RUN,
        _ASCII_PUNCT_WORD + "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
        "| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+",
        r"\p{N}",
    ],
    "YOUTU": [
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b"
        "\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + _CJK_RUN,
        _CASED_WORDS + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ],
    "DEEPSEEK_CODER": [
        "[\r\n]",
        r"\s?\p{L}+",
        r"\s?\p{P}+",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        r"\p{N}",
    ],
    "FALCON": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"],
    "STARCODER": [r"\p{N}", _GPT2],
    "GPT2": [_GPT2],
    "QWEN2": [_QWEN2],
    "QWEN35": [
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
    "PORO": [_NOT_PUNCT],
    "VIKING": [_NOT_PUNCT, r"\p{N}"],
    "TEKKEN": [
        rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER_ISH}*{_LOWER_ISH}+"
        rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER_ISH}+{_LOWER_ISH}*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
    "CHAMELEON": [
        "<sentinel:[0-9]+>",
        "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        _GPT2,
    ],
    "GPT4O": [_GPT4O],
    "GRANITE_EMB_MULTI": [
        _GPT4O.replace(r"(?=[\p{L}])", r"(?=[\p{L}\p{M}])"),
    ],
    "TINY_AYA": [
        r"\d{1,3}(?=(?:\d{3})*\b)",
        _CASED_WORDS + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ],
    "BAILINGMOE": [
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
    ],
    "SEED_CODER": [
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
    "UFAKZEKA": [
        r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
    "LAGUNA": [_NEWLINE_RUNS, _QWEN2],
    "EXAONE_MOE": [
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"
    ],
    "MINICPM5": [
        r"\p{N}{1,3}",
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ],
    "DEFAULT": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
    # SentencePiece-style BPE over raw UTF-8 (byte_encode = false in llama.cpp).
    "GEMMA4": [_NEWLINE_RUNS],
}
# Pre types that share another's regexes (the `case A: case B:` groups of llama-vocab.cpp).
for _alias, _same in {
    "DBRX": "LLAMA3",
    "SMAUG": "LLAMA3",
    "CHATGLM4": "LLAMA3",
    "HUNYUAN_DENSE": "DEEPSEEK3_LLM",
    "JOYAI_LLM": "DEEPSEEK3_LLM",
    "HY_V4": "DEEPSEEK3_LLM",
    "REFACT": "STARCODER",
    "COMMAND_R": "STARCODER",
    "SMOLLM": "STARCODER",
    "CODESHELL": "STARCODER",
    "EXAONE": "STARCODER",
    "MINERVA": "STARCODER",
    "MELLUM2": "STARCODER",
    "MPT": "GPT2",
    "OLMO": "GPT2",
    "JAIS": "GPT2",
    "TRILLION": "GPT2",
    "GRANITE_DOCLING": "GPT2",
    "STABLELM2": "QWEN2",
    "HUNYUAN": "QWEN2",
    "SOLAR_OPEN": "QWEN2",
    "GROK_2": "QWEN2",
    "BLOOM": "PORO",
    "GPT3_FINNISH": "PORO",
    "MINIMAX_M2": "GPT4O",
    "SARVAM_MOE": "GEMMA4",
}.items():
    _PRE_REGEXES[_alias] = _PRE_REGEXES[_same]

# Pre types whose llama.cpp splitter is hand-written code with no regex equivalent here.
_UNSUPPORTED_PRE = {
    "KIMI_K2": "a custom Han-aware splitter",
    "AFMOE": "a custom digit-grouping splitter",
    "SUPERBPE": "a zero-width digit-grouping split",
    "WHITESPACE": "a whitespace splitter without byte-level encoding",
}
# Pre types that use SentencePiece-style BPE (raw UTF-8, U+2581 for spaces, <0xXX> fallback).
_RAW_UTF8_PRE = {"GEMMA4", "SARVAM_MOE"}


@dataclass(frozen=True)
class _Pre:
    type: str
    ignore_merges: bool = False
    add_bos: bool = False


def _pre(pre_type: str, *names: str, **flags: bool) -> dict[str, _Pre]:
    return {name: _Pre(pre_type, **flags) for name in names}


# tokenizer.ggml.pre -> llama.cpp pre type and the flags llama_vocab::impl::load sets with it.
PRE_TYPES: dict[str, _Pre] = {
    **_pre("DEFAULT", "default"),
    **_pre("MINICPM5", "minicpm5", ignore_merges=True),
    **_pre(
        "LLAMA3",
        *("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0"),
        *("lfm2", "jina-v5-nano"),
        ignore_merges=True,
        add_bos=True,
    ),
    **_pre("DEEPSEEK_LLM", "deepseek-llm"),
    **_pre("DEEPSEEK_CODER", "deepseek-coder"),
    **_pre("DEEPSEEK3_LLM", "deepseek-v3"),
    **_pre("SPARK2_5", "spark2_5"),
    **_pre("YOUTU", "youtu", ignore_merges=True),
    **_pre("FALCON", "falcon"),
    **_pre("MPT", "mpt"),
    **_pre("STARCODER", "starcoder"),
    **_pre(
        "GPT2",
        *("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de"),
        *("a.x-4.0", "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe"),
        "exaone4",
    ),
    **_pre("JAIS2", "jais-2"),
    **_pre("GEMMA4", "gemma4", "granite-embed-multi-311m", add_bos=True),
    **_pre("SARVAM_MOE", "sarvam-moe"),
    **_pre("WHITESPACE", "whitespace"),
    **_pre("REFACT", "refact"),
    **_pre("COMMAND_R", "command-r"),
    **_pre("QWEN2", "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"),
    **_pre("QWEN35", "qwen35"),
    **_pre("STABLELM2", "stablelm2"),
    **_pre("OLMO", "olmo"),
    **_pre("DBRX", "dbrx"),
    **_pre("SMAUG", "smaug-bpe"),
    **_pre("PORO", "poro-chat"),
    **_pre("CHATGLM4", "chatglm-bpe"),
    **_pre("CHATGLM4", "glm4", "glm5", ignore_merges=True),
    **_pre("VIKING", "viking"),
    **_pre("JAIS", "jais"),
    **_pre("TEKKEN", "tekken", ignore_merges=True, add_bos=True),
    **_pre("SMOLLM", "smollm"),
    **_pre("CODESHELL", "codeshell"),
    **_pre("BLOOM", "bloom"),
    **_pre("GPT3_FINNISH", "gpt3-finnish"),
    **_pre("EXAONE", "exaone"),
    **_pre("EXAONE_MOE", "exaone-moe"),
    **_pre("CHAMELEON", "chameleon", add_bos=True),
    **_pre("MINERVA", "minerva-7b"),
    **_pre("GPT4O", "gpt-4o", "llama4", "kanana2", "talkie"),
    **_pre("GRANITE_EMB_MULTI", "granite-embed-multi-97m", ignore_merges=True),
    **_pre("TINY_AYA", "tiny_aya", "cohere2moe"),
    **_pre("SUPERBPE", "superbpe"),
    **_pre("TRILLION", "trillion"),
    **_pre("GRANITE_DOCLING", "granite-docling"),
    **_pre("BAILINGMOE", "bailingmoe", "bailingmoe2", "llada-moe"),
    **_pre("SEED_CODER", "seed-coder"),
    **_pre("HUNYUAN", "hunyuan"),
    **_pre("HUNYUAN_DENSE", "hunyuan-dense"),
    **_pre("HY_V4", "hy_v4"),
    **_pre("JOYAI_LLM", "joyai-llm"),
    **_pre("KIMI_K2", "kimi-k2"),
    **_pre("UFAKZEKA", "ufakzeka"),
    **_pre("GROK_2", "grok-2"),
    **_pre("AFMOE", "afmoe"),
    **_pre("LAGUNA", "laguna"),
    **_pre("MINIMAX_M2", "minimax-m2"),
    **_pre("SOLAR_OPEN", "solar-open"),
    **_pre("MELLUM2", "mellum2"),
}


@dataclass
class GGUFTokenizer:
    """A GGUF file's tokenizer: `json` is the text of an equivalent tokenizer.json."""

    json: str
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    add_eos_token: bool
    # eos, eot, eom, then the other tokens llama.cpp ends generation at (deduplicated)
    end_of_turn_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None


# -- metadata access ------------------------------------------------------------------------


def _tokens(md: Mapping[str, Any]) -> list[str]:
    tokens = md.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise FormatError("GGUF metadata has no tokenizer.ggml.tokens string array")
    # llama.cpp renames empty tokens so that every token text stays unique.
    return [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]


_N = TypeVar("_N", int, float)


def _numeric_array(md: Mapping[str, Any], key: str, n: int, kind: type[_N]) -> list[_N] | None:
    """The first `n` entries of a numeric metadata array as `kind`, or None when absent."""
    value = md.get(key)
    if value is None:
        return None
    try:
        out = [kind(v) for v in value]
    except (TypeError, ValueError):
        raise FormatError(f"GGUF metadata {key} must be a numeric array") from None
    if len(out) < n:
        raise FormatError(f"GGUF metadata {key} has {len(out)} entries for {n} tokens")
    return out[:n]


def _int_array(md: Mapping[str, Any], key: str, n: int, default: int) -> list[int]:
    out = _numeric_array(md, key, n, int)
    return [default] * n if out is None else out


def _float_array(md: Mapping[str, Any], key: str, n: int) -> list[float] | None:
    return _numeric_array(md, key, n, float)


def _flag(md: Mapping[str, Any], key: str, default: bool) -> bool:
    value = md.get(key)
    if value is None:
        return default
    if isinstance(value, (bool, int, np.bool_, np.integer)):
        return bool(value)
    raise FormatError(f"GGUF metadata {key} must be a bool, got {value!r}")


def _token_id(md: Mapping[str, Any], key: str, n: int, default: int | None) -> int | None:
    """A special-token id; out-of-range ids fall back to the default, as in llama.cpp."""
    value = md.get(key)
    if value is None or isinstance(value, (str, bytes, list)):
        return default if default is not None and 0 <= default < n else None
    value = int(value)
    if 0 <= value < n:
        return value
    return default if default is not None and 0 <= default < n else None


# -- end-of-generation tokens (llama_vocab::impl::load) ----------------------------------------

# Token texts llama.cpp's special_eog_ids holds whatever the metadata says.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
        "[e~[",
    }
)


def _end_of_generation(
    tokens: list[str], types: list[int], first: tuple[int | None, ...]
) -> list[int]:
    """`first` (eos, eot, eom from the metadata), then the control tokens that llama.cpp also
    ends generation at because of their text (<|eot_id|>, <|im_end|>, <end_of_turn>, ...), by
    id. Unlike llama.cpp, a token of that text that is not a control token (Qwen's ordinary
    "</s>") is left out, and FIM tokens are not included."""
    ids: list[int] = [i for i in first if i is not None]
    for i, text in enumerate(tokens):
        if text in _EOG_TEXTS and types[i] == CONTROL:
            ids.append(i)
    ids = list(dict.fromkeys(ids))
    texts = {tokens[i]: i for i in ids}
    # o200k_harmony (gpt-oss) / solar-open: <|end|> ends a message, not the generation.
    if "<|end|>" in texts and (
        {"<|return|>", "<|call|>"} <= texts.keys() or {"<|calls|>", "<|flush|>"} <= texts.keys()
    ):
        ids.remove(texts["<|end|>"])
    # Gemma 4 and PLaMo 2 have an ordinary </s> token.
    if "</s>" in texts and {"<|tool_response>", "<|plamo:eos|>"} & texts.keys():
        ids.remove(texts["</s>"])
    return ids


# -- tokenizer.json pieces ------------------------------------------------------------------


def _added_tokens(tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    """Tokens llama.cpp matches in text before tokenising (its special-token cache)."""
    out = []
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind in (CONTROL, USER_DEFINED, UNKNOWN):
            out.append(
                {
                    "id": i,
                    "content": text,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": kind != USER_DEFINED,
                }
            )
    return out


def _merges_field(merges: list[tuple[str, str]]) -> list[Any]:
    # "a b" strings load in every tokenizers version; pairs (tokenizers >= 0.20) are needed
    # only when a merge part itself holds a space.
    if any(" " in a or " " in b for a, b in merges):
        return [[a, b] for a, b in merges]
    return [f"{a} {b}" for a, b in merges]


def _gguf_merges(md: Mapping[str, Any], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    raw = md.get("tokenizer.ggml.merges")
    if not isinstance(raw, list) or not all(isinstance(m, str) for m in raw):
        raise FormatError("GGUF metadata has no tokenizer.ggml.merges string array")
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for m in raw:
        pos = m.find(" ", 1)  # as llama.cpp: the first space after the first character
        if pos < 0:
            continue
        pair = (m[:pos], m[pos + 1 :])
        # llama.cpp keeps the first rank of a repeated pair; HF refuses merges whose parts or
        # result are not in the vocabulary (llama.cpp would fall back to bytes for those).
        if pair in seen or pair[0] not in vocab or pair[1] not in vocab:
            continue
        if pair[0] + pair[1] not in vocab:
            continue
        seen.add(pair)
        merges.append(pair)
    return merges


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama.cpp's SentencePiece merging: every split of a vocabulary
    entry into two vocabulary entries, ranked by the entry's score (best first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, token in enumerate(tokens):
        for k in range(1, len(token)):
            left, right = token[:k], token[k:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                ranked.append((-scores[i], i, k, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _bpe_model(
    vocab: dict[str, int],
    merges: list[tuple[str, str]],
    *,
    unk_token: str | None = None,
    byte_fallback: bool = False,
    ignore_merges: bool = False,
) -> dict[str, Any]:
    model: dict[str, Any] = {
        "type": "BPE",
        "dropout": None,
        "unk_token": unk_token,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": unk_token is not None,
        "byte_fallback": byte_fallback,
    }
    if ignore_merges:  # the key only exists in newer tokenizers versions
        model["ignore_merges"] = True
    model["vocab"] = vocab
    model["merges"] = _merges_field(merges)
    return model


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _replace(old: str, new: str) -> dict[str, Any]:
    return {"type": "Replace", "pattern": {"String": old}, "content": new}


_SPM_DECODER = [_replace(SPACE_MARK, " "), {"type": "ByteFallback"}, {"type": "Fuse"}]


def _document(
    model: dict[str, Any],
    added: list[dict[str, Any]],
    normalizer: dict[str, Any] | None,
    pre_tokenizer: dict[str, Any] | None,
    decoder: dict[str, Any],
) -> str:
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": decoder,
        "model": model,
    }
    return _json.dumps(doc, ensure_ascii=False)


# -- the three tokenizer kinds ----------------------------------------------------------------


def _byte_level_bpe(md: Mapping[str, Any], tokens: list[str], pre: _Pre) -> dict[str, Any]:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _gguf_merges(md, vocab)
    splits = [_split(r) for r in _PRE_REGEXES[pre.type]]
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    return {
        "model": _bpe_model(vocab, merges, ignore_merges=pre.ignore_merges),
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [*splits, byte_level]},
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
    }


def _raw_utf8_bpe(md: Mapping[str, Any], tokens: list[str], pre: _Pre) -> dict[str, Any]:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _gguf_merges(md, vocab)
    return {
        "model": _bpe_model(vocab, merges, byte_fallback=True, ignore_merges=pre.ignore_merges),
        "normalizer": _replace(" ", SPACE_MARK),
        "pre_tokenizer": _split(_NEWLINE_RUNS),
        "decoder": {"type": "Sequence", "decoders": _SPM_DECODER},
    }


def _sentencepiece_bpe(
    md: Mapping[str, Any], tokens: list[str], unk_id: int | None, add_space_prefix: bool
) -> dict[str, Any]:
    scores = _float_array(md, "tokenizer.ggml.scores", len(tokens))
    if scores is None:
        raise FormatError("a llama (SentencePiece) GGUF tokenizer needs tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None else None
    normalizers: list[dict[str, Any]] = []
    decoders = list(_SPM_DECODER)
    if add_space_prefix:
        normalizers.append({"type": "Prepend", "prepend": SPACE_MARK})
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    normalizers.append(_replace(" ", SPACE_MARK))
    return {
        "model": _bpe_model(vocab, _spm_merges(tokens, scores), unk_token=unk, byte_fallback=True),
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
    }


def _pre_of(md: Mapping[str, Any]) -> _Pre:
    name = md.get("tokenizer.ggml.pre")
    if name is None or name == "":
        return PRE_TYPES["default"]  # llama.cpp: "missing pre-tokenizer type, using: 'default'"
    if not isinstance(name, str):
        raise FormatError(f"GGUF metadata tokenizer.ggml.pre must be a string, got {name!r}")
    pre = PRE_TYPES.get(name)
    if pre is None:
        raise UnsupportedArchitecture(
            f"GGUF pre-tokenizer type {name!r} is unknown to cellm (and to llama.cpp's list)"
        )
    if pre.type in _UNSUPPORTED_PRE:
        raise UnsupportedArchitecture(
            f"GGUF pre-tokenizer type {name!r} uses {_UNSUPPORTED_PRE[pre.type]} in llama.cpp, "
            "which cellm does not reproduce"
        )
    return pre


def tokenizer_from_gguf(metadata: Mapping[str, Any]) -> GGUFTokenizer:
    """Build the tokenizer.json equivalent of a GGUF file's tokenizer metadata.

    FormatError for malformed metadata, UnsupportedArchitecture for tokenizer kinds cellm does
    not reproduce (bert/WordPiece, t5/Unigram, rwkv, plamo2, ...)."""
    md = metadata
    kind = md.get("tokenizer.ggml.model")
    if kind is None:
        raise FormatError("GGUF metadata has no tokenizer.ggml.model")
    if kind not in ("gpt2", "llama", "gemma4"):
        raise UnsupportedArchitecture(
            f"GGUF tokenizer model {kind!r} is not supported: cellm reads 'gpt2' (byte-level "
            "BPE), 'llama' (SentencePiece BPE) and 'gemma4' tokenizers"
        )
    tokens = _tokens(md)
    n = len(tokens)
    if len(set(tokens)) != n:
        raise FormatError("GGUF metadata tokenizer.ggml.tokens has repeated entries")
    types = _int_array(md, "tokenizer.ggml.token_type", n, NORMAL)

    bos_default: int | None
    eos_default: int | None
    unk_default: int | None
    if kind == "llama":
        bos_default, eos_default, unk_default = 1, 2, 0
        add_bos_default = True
    else:
        bos_default = eos_default = unk_default = None
        add_bos_default = False
    bos = _token_id(md, "tokenizer.ggml.bos_token_id", n, bos_default)
    eos = _token_id(md, "tokenizer.ggml.eos_token_id", n, eos_default)
    unk = _token_id(md, "tokenizer.ggml.unknown_token_id", n, unk_default)
    eot = _token_id(md, "tokenizer.ggml.eot_token_id", n, None)
    eom = _token_id(md, "tokenizer.ggml.eom_token_id", n, None)

    pre_type = None
    if kind == "llama":
        parts = _sentencepiece_bpe(
            md, tokens, unk, _flag(md, "tokenizer.ggml.add_space_prefix", True)
        )
    else:
        pre = PRE_TYPES["gemma4"] if kind == "gemma4" else _pre_of(md)
        pre_type, add_bos_default = pre.type, pre.add_bos
        if pre.type in _RAW_UTF8_PRE:
            parts = _raw_utf8_bpe(md, tokens, pre)
        else:
            parts = _byte_level_bpe(md, tokens, pre)

    add_bos = _flag(md, "tokenizer.ggml.add_bos_token", add_bos_default)
    if pre_type == "GEMMA4":
        add_bos = True  # llama.cpp overrides add_bos_token=false for Gemma 4
    add_eos = _flag(md, "tokenizer.ggml.add_eos_token", False)
    if add_bos and bos is None:
        raise FormatError("GGUF tokenizer asks for a BOS token but has no valid bos_token_id")

    ends = _end_of_generation(tokens, types, (eos, eot, eom))
    text = _document(
        parts["model"],
        _added_tokens(tokens, types),
        parts["normalizer"],
        parts["pre_tokenizer"],
        parts["decoder"],
    )
    template = md.get("tokenizer.chat_template")
    return GGUFTokenizer(
        json=text,
        bos_token=tokens[bos] if bos is not None else None,
        eos_token=tokens[eos] if eos is not None else None,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        end_of_turn_ids=ends,
        chat_template=template if isinstance(template, str) and template else None,
    )


__all__ = ["GGUFTokenizer", "PRE_TYPES", "tokenizer_from_gguf"]
