"""openai/privacy-filter: label logits against HF transformers' (the fixture's reference),
BIOES decoding against its definition and brute force, spans against the tokenizer's bytes,
the API and the CLI's refusals."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cellm.bioes import Scheme, log_softmax, token_spans, viterbi
from cellm.convert import convert_hf
from cellm.errors import ContextOverflow, UnsupportedArchitecture
from cellm.pii import PrivacyFilter, redacted

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "mm" / "privacy_filter"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
LOGITS = np.load(FIXTURE / "logits.npz")
# A small BIOES set for brute force: O and two entities.
SMALL = Scheme.parse(["O", "B-a", "I-a", "E-a", "S-a", "B-b", "I-b", "E-b", "S-b"])


@pytest.fixture(scope="module")
def f32(tmp_path_factory) -> Path:
    return convert_hf(FIXTURE, tmp_path_factory.mktemp("pf") / "pf.cellm", "f32")


@pytest.fixture(scope="module")
def pf(f32: Path) -> PrivacyFilter:
    return PrivacyFilter(f32, threads=2)


def test_label_logits_match_transformers_on_both_texts(pf: PrivacyFilter) -> None:
    """Within 1e-3 at every token. The long text (340 tokens) is longer than the fixture's
    band (16 each side), so the band's edges and the sinks are exercised."""
    assert pf.labels == tuple(REFERENCE["labels"])
    assert len(REFERENCE["texts"][1]["input_ids"]) > 2 * 16 + 1
    for i, t in enumerate(REFERENCE["texts"]):
        assert pf._model.encode([t["text"]])[0].ids == t["input_ids"]
        got = pf.logits(t["input_ids"])
        want = LOGITS[f"logits_{i}"]
        assert got.shape == want.shape
        assert np.abs(got - want).max() < 1e-3
        assert [pf.labels[j] for j in got.argmax(-1)] == t["argmax_labels"]


def test_a_batch_gives_each_text_what_it_gets_alone(pf: PrivacyFilter) -> None:
    texts = [t["text"] for t in REFERENCE["texts"]] + ["", "Zoë"]
    batch = pf.detect_batch(texts)
    alone = [pf.detect(t) for t in texts]
    # Scores may differ in the last bits: the kernels tile a batch's rows differently.
    assert [[(s.label, s.start, s.end, s.text) for s in b] for b in batch] == [
        [(s.label, s.start, s.end, s.text) for s in a] for a in alone
    ]
    for b, a in zip(batch, alone):
        assert [s.score for s in b] == pytest.approx([s.score for s in a], abs=1e-5)
    assert batch[2] == []


def test_quantized_conversion_stays_close(tmp_path: Path) -> None:
    """int8 rows (embedding, attention, experts) stay close to HF's float logits. Random
    routers have tiny margins, so int8 noise flips some tokens' experts (a few logits move by
    ~3 here, as the seed saw up to 8 on the real model at int4): the bounds are on the mean
    error (measured 0.066, 7% of the logits' spread) and the argmax agreement (measured
    92%), not the worst token."""
    path = convert_hf(FIXTURE, tmp_path / "q.cellm", "f32", quantize="int8")
    ids = REFERENCE["texts"][1]["input_ids"]
    got = PrivacyFilter(path, threads=2).logits(ids)
    want = LOGITS["logits_1"]
    assert np.mean(got.argmax(-1) == want.argmax(-1)) > 0.85
    assert np.abs(got - want).mean() < 0.1 * want.std()


def brute_force(logits: np.ndarray, scheme: Scheme) -> float:
    """The best total log-probability over every well-formed sequence."""
    logp = log_softmax(logits)
    best = -np.inf
    for path in itertools.product(range(len(scheme.labels)), repeat=len(logits)):
        if scheme.valid(path):
            best = max(best, float(sum(logp[t, k] for t, k in enumerate(path))))
    return best


logit_arrays = st.integers(1, 4).flatmap(
    lambda n: st.lists(
        st.lists(st.floats(-8, 8, allow_nan=False), min_size=9, max_size=9),
        min_size=n,
        max_size=n,
    )
)


@settings(max_examples=60, deadline=None)
@given(logit_arrays)
def test_viterbi_is_well_formed_and_optimal(rows: list[list[float]]) -> None:
    logits = np.array(rows, dtype=np.float32)
    path = viterbi(logits, SMALL)
    assert SMALL.valid(path)
    total = float(sum(log_softmax(logits)[t, k] for t, k in enumerate(path)))
    assert total == pytest.approx(brute_force(logits, SMALL), abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 60).flatmap(
        lambda n: st.lists(st.floats(-30, 30), min_size=n * 33, max_size=n * 33)
    )
)
def test_viterbi_never_opens_or_closes_a_span_badly(values: list[float]) -> None:
    """On the real label set: no I-x after O, no E-y after B-x, nothing left open."""
    scheme = Scheme.parse(REFERENCE["labels"])
    logits = np.array(values, dtype=np.float32).reshape(-1, 33)
    path = viterbi(logits, scheme)
    assert scheme.valid(path)
    tags = [scheme.labels[k] for k in path]
    for a, b in zip(["O", *tags], [*tags, "O"]):
        if a == "O" or a[0] in "ES":
            assert b == "O" or b[0] in "BS", (a, b)
        else:
            assert b[0] in "IE" and b[2:] == a[2:], (a, b)


def test_spans_follow_the_tokens_bytes_on_multibyte_text(pf: PrivacyFilter) -> None:
    """Byte-level BPE splits characters across tokens; each span must be the smallest run
    of whole characters covering its tokens' bytes (the tokens' bytes laid end to end are
    the text's UTF-8)."""
    text = "Zoë Ångström (ñandú@exämple.com) 🎉 lives at 東京都 1-2-3, tel ☎ +81 3 1234 5678 ✓"
    raw = pf._model.tokenizer.raw
    enc = raw.encode(text)
    # Each token's bytes: the byte-level alphabet maps back to bytes one symbol each.
    alphabet = _byte_level_alphabet()
    token_bytes = [bytes(alphabet[c] for c in tok) for tok in enc.tokens]
    assert b"".join(token_bytes) == text.encode()
    ends = list(itertools.accumulate(len(b) for b in token_bytes))
    starts = [e - len(b) for e, b in zip(ends, token_bytes)]
    logits = pf.logits(enc.ids)
    spans = pf._spans(text, logits, enc.offsets)
    assert spans, "random weights give some spans on this text"
    char_at_byte = [i for i, ch in enumerate(text) for _ in ch.encode()]
    path = viterbi(logits, pf.scheme)
    for span, ts in zip(spans, token_spans(path, pf.scheme)):
        first_char = char_at_byte[starts[ts.first]]
        last_char = char_at_byte[ends[ts.last] - 1]
        assert (span.start, span.end) == (first_char, last_char + 1)
        assert span.text == text[span.start : span.end]


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted (a written-out definition)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def test_redaction_replaces_each_span(pf: PrivacyFilter) -> None:
    text = REFERENCE["texts"][0]["text"]
    spans = pf.detect(text)
    out = pf.redact(text, style="<label>")
    assert out == redacted(text, spans, "<label>")
    # Rebuild the text from the redaction and the spans: nothing else changed.
    rebuilt, at = out, 0
    for s in spans:
        marker = f"<{s.label}>"
        pos = rebuilt.index(marker, at)
        rebuilt = rebuilt[:pos] + s.text + rebuilt[pos + len(marker) :]
        at = pos + len(s.text)
    assert rebuilt == text


def test_too_long_text_is_refused(f32: Path, tmp_path: Path) -> None:
    config = json.loads((FIXTURE / "config.json").read_text())
    short = tmp_path / "short"
    short.mkdir()
    for f in FIXTURE.iterdir():
        (short / f.name).write_bytes(f.read_bytes())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    pf = PrivacyFilter(convert_hf(short, tmp_path / "short.cellm", "f32"), threads=1)
    with pytest.raises(ContextOverflow, match="340 tokens, more than the model's 64"):
        pf.detect(REFERENCE["texts"][1]["text"])


def test_an_encoder_is_not_a_language_model(f32: Path) -> None:
    from cellm import LLM

    with pytest.raises(UnsupportedArchitecture, match="is an encoder"):
        LLM(f32)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cellm.pii", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_prints_spans_and_redactions(f32: Path) -> None:
    text = REFERENCE["texts"][0]["text"]
    run = cli("--model", str(f32), "--text", text, "--redact", "--json", "--threads", "1")
    assert run.returncode == 0, run.stderr
    (doc,) = json.loads(run.stdout)
    pf = PrivacyFilter(f32, threads=1)
    assert [s["label"] for s in doc["spans"]] == [s.label for s in pf.detect(text)]
    assert doc["redacted"] == pf.redact(text)
    lines = cli("--model", str(f32), "--text", text).stdout.splitlines()
    assert lines[0] == f"=== {text}" and len(lines) == 1 + len(doc["spans"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--text", ""], "error: text 1 is empty"),
        (["--file", "MISSING"], "No such file"),
        (["--file", "BINARY"], "is not UTF-8 text (byte 2)"),
        (["--text", "x", "--threads", "0"], "out of range"),
        (["--text", "x", "--file", "BINARY"], "not allowed with"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(f32: Path, tmp_path: Path, args, message) -> None:
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"ab\xffcd")
    args = [
        str(binary) if a == "BINARY" else str(tmp_path / "nope") if a == "MISSING" else a
        for a in args
    ]
    run = cli("--model", str(f32), *args)
    assert message in run.stderr
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
