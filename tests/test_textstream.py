"""Incremental detokenisation, stop strings and the Tokenizer wrapper."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers

from cellm.errors import FormatError, InvalidArgument
from cellm.textstream import IncrementalDecoder, StopStringMatcher
from cellm.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "hf-tiny"
TEXT = (
    "Grüße aus Zürich — naïve café. 世界你好，日本語のテキスト。한국어 문장. "
    "Ελληνικά и русский. Emoji: 🎉🚀👩‍👩‍👧 🇫🇷 done\n"
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    d = FIXTURES / "llama"
    cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    return Tokenizer.from_json_str(
        (d / "tokenizer.json").read_text(encoding="utf-8"),
        bos_token=cfg["bos_token"],
        eos_token=cfg["eos_token"],
        add_bos_token=True,
    )


def stream(dec: IncrementalDecoder, ids: list[int]) -> list[str]:
    return [dec.add(i) for i in ids] + [dec.flush()]


def test_multilingual_stream_matches_full_decode_without_broken_pieces(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    # The byte-level fixture splits these characters into byte tokens that decode to U+FFFD alone.
    assert sum("\ufffd" in tok.decode([i]) for i in ids) > 20
    pieces = stream(IncrementalDecoder(tok.raw), ids)
    assert "".join(pieces) == tok.decode(ids) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    assert sum(bool(p) for p in pieces) > 30  # it really streams, not one piece at the end


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_in_stream(tok: Tokenizer, skip: bool) -> None:
    ids = tok.encode(
        "<|im_start|>assistant\n世界 🎉<|im_end|>x<|eot_id|>", add_special_tokens=False
    )
    assert tok.token_to_id("<|im_start|>") in ids
    pieces = stream(IncrementalDecoder(tok, skip_special_tokens=skip), ids)  # wrapper accepted
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in p for p in pieces)


def sentencepiece_style_tokenizer() -> tokenizers.Tokenizer:
    # Llama 2 / Mistral style: "▁" for spaces, byte fallback, and a decoder that strips the
    # first leading space, which a naive per-token decode gets wrong.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for w in ["▁", "▁Hello", "▁world", "!", "▁the", "▁caf", "é"]:
        vocab[w] = len(vocab)
    # No merges: text encodes to "▁", "é", "!" and byte tokens, which is all streaming needs.
    t = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True)
    )
    t.normalizer = tokenizers.normalizers.Sequence(
        [tokenizers.normalizers.Prepend("▁"), tokenizers.normalizers.Replace(" ", "▁")]
    )
    t.decoder = tokenizers.decoders.Sequence(
        [
            tokenizers.decoders.Replace("▁", " "),
            tokenizers.decoders.ByteFallback(),
            tokenizers.decoders.Fuse(),
            tokenizers.decoders.Strip(" ", 1, 0),
        ]
    )
    t.add_special_tokens(["<s>", "</s>"])
    return t


@pytest.mark.parametrize("skip", [True, False])
def test_sentencepiece_byte_fallback_stream(skip: bool) -> None:
    t = sentencepiece_style_tokenizer()
    ids = [1, *t.encode("Hello world! the café 世界 🎉!").ids, 2]
    pieces = stream(IncrementalDecoder(t, skip_special_tokens=skip), ids)
    assert "".join(pieces) == t.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in p for p in pieces)
    if skip:
        assert "".join(pieces) == "Hello world! the café 世界 🎉!"


def test_window_stays_small(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT * 20, add_special_tokens=False)
    dec = IncrementalDecoder(tok.raw)
    longest = 0
    for i in ids:
        dec.add(i)
        longest = max(longest, len(dec._window))
    assert longest <= 12  # O(window) per token: the longest character's bytes plus a prefix


def test_flush_returns_an_incomplete_tail(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🎉", add_special_tokens=False)[:-1]  # drop the emoji's last byte
    dec = IncrementalDecoder(tok.raw)
    pieces = stream(dec, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert pieces[-1].endswith("\ufffd")  # only flush may hand out a broken tail
    assert dec.flush() == ""  # and it resets


def feed_all(m: StopStringMatcher, pieces: list[str]) -> tuple[list[str], list[bool]]:
    out = [m.feed(p) for p in pieces]
    return [o[0] for o in out], [o[1] for o in out]


def test_stop_split_across_pieces_is_caught() -> None:
    m = StopStringMatcher(["<|end|>"])
    texts, hits = feed_all(m, ["Hello <", "|en", "d|> and more", "later"])
    assert texts == ["Hello ", "", "", ""]
    assert hits == [False, False, True, True]
    assert m.stopped and m.matched == "<|end|>"
    assert m.flush() == ""


def test_stop_inside_one_piece() -> None:
    m = StopStringMatcher(["</s>"])
    assert m.feed("foo</s>bar") == ("foo", True)


def test_partial_prefix_that_is_not_a_stop_is_emitted() -> None:
    m = StopStringMatcher(["STOP"])
    texts, hits = feed_all(m, ["abc ST", "ART ", "more S", "TO"])
    assert texts == ["abc ", "START ", "more ", ""]
    assert not any(hits)
    assert m.flush() == "STO"  # the stream ended: what was held is ordinary text


def test_overlapping_prefixes_and_earliest_stop_wins() -> None:
    m = StopStringMatcher(["aab"])
    texts, hits = feed_all(m, ["a", "a", "a", "b", "x"])
    assert "".join(texts) == "a" and hits[3]
    m = StopStringMatcher(["world", "lo w"])
    assert m.feed("hello world") == ("hel", True)
    assert m.matched == "lo w"


def test_no_stops_passes_text_through() -> None:
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


def test_bad_stop_strings_raise() -> None:
    with pytest.raises(InvalidArgument):
        StopStringMatcher([""])
    with pytest.raises(InvalidArgument):
        StopStringMatcher([1])  # type: ignore[list-item]


def test_decoder_and_stop_matcher_together(tok: Tokenizer) -> None:
    text = "答えは 42 です。🎉 Ende\nUser: more text"
    ids = tok.encode(text, add_special_tokens=False)
    dec, m = IncrementalDecoder(tok.raw), StopStringMatcher(["\nUser:"])
    out, hit = [], False
    for i in ids:
        piece, hit = m.feed(dec.add(i))
        out.append(piece)
        if hit:
            break
    assert hit
    assert "".join(out) == text[: text.index("\nUser:")]


def test_tokenizer_matches_transformers_ids() -> None:
    for model, add_bos in [("llama", True), ("qwen2", False)]:
        d = FIXTURES / model
        ref = json.loads((d / "reference.json").read_text(encoding="utf-8"))
        cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        t = Tokenizer.from_json_str(
            (d / "tokenizer.json").read_text(encoding="utf-8"),
            bos_token=cfg.get("bos_token"),
            eos_token=cfg.get("eos_token"),
            add_bos_token=add_bos,
        )
        for prompt in ref["prompts"]:
            assert t.encode(prompt["text"]) == prompt["input_ids"]


def test_tokenizer_api(tok: Tokenizer) -> None:
    bos = tok.token_to_id("<|begin_of_text|>")
    assert tok.bos_token_id == bos and tok.eos_token_id == tok.token_to_id("<|eot_id|>")
    assert tok.vocab_size == tok.raw.get_vocab_size() == 1000
    assert tok.id_to_token(bos) == "<|begin_of_text|>" and tok.id_to_token(10**6) is None
    ids = tok.encode("<|im_start|>hi")
    assert ids[:2] == [bos, tok.token_to_id("<|im_start|>")]
    assert tok.encode("<|begin_of_text|>hi") == [bos] + tok.encode("hi", add_special_tokens=False)
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|><|im_start|>hi"
    for bad in ([1000], [-1]):
        with pytest.raises(InvalidArgument, match="not in the vocabulary"):
            tok.decode(bad)
    with pytest.raises(FormatError):
        Tokenizer.from_json_str("{not json")
    with pytest.raises(InvalidArgument):
        Tokenizer(tok.raw, bos_token="<s>")
