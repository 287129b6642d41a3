"""The tokenizer and generation sections of the `.cellm` header, from the HF side files.

`tokenizer.json` is required (it is embedded verbatim as a blob); `tokenizer_config.json`,
`chat_template.jinja` and `generation_config.json` are optional.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..errors import FormatError, TemplateError
from .jsonfiles import parse_json_object, read_bytes, read_json, read_text

TOKENIZER_BLOB = "tokenizer.json"
# Keys that get their own header fields (or are replaced by them) instead of being copied.
_TOKENIZER_CONFIG_DROP = ("chat_template", "added_tokens_decoder")
_GENERATION_OWN = ("eos_token_id", "bos_token_id", "pad_token_id")


@dataclass
class TokenizerFiles:
    tokenizer: dict[str, Any]  # header `tokenizer` section
    generation: dict[str, Any]  # header `generation` section
    tokenizer_json: bytes  # embedded verbatim as the "tokenizer.json" blob


def load_tokenizer_files(directory: Path, config: Mapping[str, Any]) -> TokenizerFiles:
    directory = Path(directory)
    tok_path = directory / "tokenizer.json"
    if not tok_path.exists():
        raise FormatError(
            f"{directory} has no tokenizer.json (only fast-tokenizer checkpoints are supported)"
        )
    tok_bytes = read_bytes(tok_path)
    tok = parse_json_object(tok_bytes, str(tok_path))

    tc_path = directory / "tokenizer_config.json"
    tc = read_json(tc_path, required=False) or {}
    gen_path = directory / "generation_config.json"
    gen = read_json(gen_path, required=False) or {}

    bos = _token_text(tc.get("bos_token"), "bos_token", tc_path)
    eos = _token_text(tc.get("eos_token"), "eos_token", tc_path)
    pad = _token_text(tc.get("pad_token"), "pad_token", tc_path)
    tokenizer = {
        "blob": TOKENIZER_BLOB,
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "add_bos_token": bool(tc.get("add_bos_token", False)),
        "add_eos_token": bool(tc.get("add_eos_token", False)),
        "chat_template": _chat_template(directory, tc, tc_path),
        "config": {k: v for k, v in tc.items() if k not in _TOKENIZER_CONFIG_DROP},
    }

    # Generation stops on any end-of-turn id: config, generation config and the tokenizer's
    # eos_token often disagree (e.g. <|end_of_text|> vs <|eot_id|>), so take them all.
    eos_ids: list[int] = []
    for value, where in (
        (config.get("eos_token_id"), "config.json eos_token_id"),
        (gen.get("eos_token_id"), f"{gen_path} eos_token_id"),
        (_token_id(tok, eos), f"{tc_path} eos_token"),
    ):
        for token_id in _ids(value, where):
            if token_id not in eos_ids:
                eos_ids.append(token_id)

    generation: dict[str, Any] = {
        "eos_token_ids": eos_ids,
        "bos_token_id": _single_id(gen, config, tok, bos, "bos_token_id", gen_path),
        "pad_token_id": _single_id(gen, config, tok, pad, "pad_token_id", gen_path),
    }
    generation.update((k, v) for k, v in gen.items() if k not in _GENERATION_OWN)
    return TokenizerFiles(tokenizer, generation, tok_bytes)


def _token_text(value: Any, key: str, path: Path) -> Optional[str]:
    """A special token as a string: tokenizer_config stores plain strings or AddedToken dicts."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(content := value.get("content"), str):
        return content
    raise FormatError(f"{path}: {key} must be a string or an object with 'content'")


def _chat_template(directory: Path, tc: Mapping[str, Any], tc_path: Path) -> Optional[str]:
    """chat_template.jinja wins (transformers 5 layout); else tokenizer_config's template, else
    chat_template.json's. A template that is not text is a TemplateError naming its file."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return read_text(jinja)
    legacy_path = directory / "chat_template.json"
    legacy = read_json(legacy_path, required=False)
    template, where = tc.get("chat_template"), tc_path
    if template is None and legacy is not None:
        template, where = legacy.get("chat_template"), legacy_path
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        # Named templates: HF uses "default" when no name is asked for.
        for entry in template:
            if isinstance(entry, dict) and entry.get("name") == "default":
                return _as_str(entry.get("template"), where, "chat_template 'default' template")
        return None
    raise TemplateError(
        f"{where}: chat_template must be a string or a list of named templates, got "
        f"{type(template).__name__}"
    )


def _as_str(value: Any, path: Path, what: str) -> str:
    if not isinstance(value, str):
        raise TemplateError(f"{path}: {what} must be a string, got {type(value).__name__}")
    return value


def _token_id(tok: Mapping[str, Any], token: Optional[str]) -> Optional[int]:
    """The id of a token string in tokenizer.json (added tokens first, then the vocab)."""
    if token is None:
        return None
    for added in tok.get("added_tokens") or ():
        if isinstance(added, dict) and added.get("content") == token:
            return added.get("id")
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        return vocab.get(token)
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], id = position
        for i, entry in enumerate(vocab):
            if isinstance(entry, list) and entry and entry[0] == token:
                return i
    return None


def _ids(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise FormatError(f"{where} must be a token id or a list of ids, got {value!r}")
    return values


def _single_id(
    gen: Mapping[str, Any],
    config: Mapping[str, Any],
    tok: Mapping[str, Any],
    token: Optional[str],
    key: str,
    gen_path: Path,
) -> Optional[int]:
    """generation_config, then config.json, then the tokenizer's token string."""
    for value, where in (
        (gen.get(key), f"{gen_path} {key}"),
        (config.get(key), f"config.json {key}"),
    ):
        if value is None:
            continue
        ids = _ids(value, where)
        # A list here (seen in some configs) means several candidates; the first is canonical.
        if ids:
            return ids[0]
    ids = _ids(_token_id(tok, token), f"tokenizer.json id of {token!r}")
    return ids[0] if ids else None
