"""Whisper on the engine against HF transformers (`tests/fixtures/mm/whisper`, a random-weight
checkpoint with the reference made by `../shared/tools/make_mm_fixtures.py`): the log-mel
front end within 1e-4 of `WhisperFeatureExtractor`, the encoder states and the decoder logits
at every position within 1e-3, and greedy ids equal, in one prefill and token by token on the
paged KV cache; then bad input through the CLI (one line, exit 2)."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

import cellm
from cellm.audio import MelFrontEnd, load_audio
from cellm.convert import convert_hf
from cellm.errors import FormatError, InvalidArgument

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "mm" / "whisper"
REF = json.loads((FIXTURE / "reference.json").read_text())
ARRAYS = dict(np.load(FIXTURE / "reference.npz"))
# f32 weights and KV: what is left is float32 summation order (measured: features 1.2e-5,
# encoder 9e-6, logits 4e-6); 1e-4 and 1e-3 are the bounds.
FEATURES_TOL = 1e-4
STATES_TOL = 1e-3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return convert_hf(FIXTURE, tmp_path_factory.mktemp("whisper") / "whisper.cellm", "f32")


@pytest.fixture(scope="module")
def whisper(model_path) -> cellm.Whisper:
    return cellm.Whisper(model_path, kv_encoding="f32")


def test_features_match_the_feature_extractor():
    got = MelFrontEnd(80).features(load_audio(FIXTURE / "audio.wav"))
    assert got.shape == (80, 3000) and got.dtype == np.float32
    np.testing.assert_allclose(got, ARRAYS["input_features"], rtol=0, atol=FEATURES_TOL)


def test_features_match_transformers_on_other_audio():
    """Independent of the fixture: transformers' own extractor on speech-like noise of
    another length, and with 128 bins (large-v3's front end)."""
    fe_mod = pytest.importorskip("transformers.models.whisper.feature_extraction_whisper")
    rng = np.random.default_rng(3)
    audio = (0.1 * rng.standard_normal(16000 * 7 + 123)).astype(np.float32)
    for bins in (80, 128):
        want = fe_mod.WhisperFeatureExtractor(feature_size=bins)(
            audio, sampling_rate=16000, return_tensors="np"
        ).input_features[0]
        got = MelFrontEnd(bins).features(audio)
        np.testing.assert_allclose(got, want, rtol=0, atol=FEATURES_TOL)


def test_encoder_states_match(whisper):
    states = whisper.encoder_states(ARRAYS["input_features"])
    assert states.shape == ARRAYS["encoder_states"].shape
    np.testing.assert_allclose(states, ARRAYS["encoder_states"], rtol=0, atol=STATES_TOL)


def test_logits_at_every_position_and_greedy_ids(whisper):
    ids = REF["decoder_prefix"] + REF["greedy_ids"][:-1]
    logits = whisper.logits(FIXTURE / "audio.wav", ids)
    np.testing.assert_allclose(logits, ARRAYS["logits"], rtol=0, atol=STATES_TOL)
    prefix = len(REF["decoder_prefix"])
    assert logits.argmax(-1)[prefix - 1 :].tolist() == REF["greedy_ids"]


def test_greedy_token_by_token_on_the_kv_cache(whisper, model_path):
    """The decode path: one session, the prefix in one step, then one token per step."""
    engine = cellm._core.Engine(str(model_path), kv_encoding="f32")
    session = engine.create_session()
    engine.encode_speech(session, ARRAYS["input_features"])
    row = engine.step([(session, REF["decoder_prefix"])])[0]
    got = []
    for j in range(len(REF["greedy_ids"])):
        np.testing.assert_allclose(row, ARRAYS["logits"][len(REF["decoder_prefix"]) - 1 + j],
                                   rtol=0, atol=STATES_TOL)  # fmt: skip
        got.append(int(row.argmax()))
        row = engine.step([(session, [got[-1]])])[0]
    assert got == REF["greedy_ids"]
    # Rewinding keeps the window: the same prefix gives the same logits again.
    engine.truncate_session(session, 0)
    again = engine.step([(session, REF["decoder_prefix"])])[0]
    np.testing.assert_allclose(again, ARRAYS["logits"][len(REF["decoder_prefix"]) - 1],
                               rtol=0, atol=STATES_TOL)  # fmt: skip


def test_the_convolutions_are_stored_tap_major(model_path):
    header = json.loads(cellm._core.Engine(str(model_path)).header_json())
    conv = next(t for t in header["tensors"] if t["name"] == "model.encoder.conv1.weight")
    assert conv["shape"] == [64, 3 * 80]
    assert header["model"]["whisper"]["source_positions"] == 1500
    assert header["model"]["hidden_act"] == "gelu"


def test_audio_inputs_agree(whisper):
    samples = load_audio(FIXTURE / "audio.wav")
    as_bytes = whisper.features((FIXTURE / "audio.wav").read_bytes())
    np.testing.assert_array_equal(as_bytes, whisper.features(samples))


def test_bad_audio_in_python(whisper, tmp_path):
    with pytest.raises(InvalidArgument, match="empty"):
        whisper.features(np.zeros(0, dtype=np.float32))
    with pytest.raises(InvalidArgument, match="floats"):
        whisper.features(np.zeros(16000, dtype=np.int16))
    with pytest.raises(InvalidArgument, match="one channel"):
        whisper.features(np.zeros((2, 16000), dtype=np.float32))
    with pytest.raises(FormatError, match="no such file"):
        whisper.features(tmp_path / "missing.wav")
    with pytest.raises(InvalidArgument, match="not one this model knows"):
        whisper.transcribe(FIXTURE / "audio.wav", language="xx")
    with pytest.raises(InvalidArgument, match="task"):
        whisper.transcribe(FIXTURE / "audio.wav", task="summarize")
    with pytest.raises(InvalidArgument, match="speech encoder|feature values"):
        whisper.encoder_states(np.zeros((80, 100), dtype=np.float32))


def _wav_bytes(samples: np.ndarray, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype(np.int16).tobytes())
    return buf.getvalue()


def _unsupported_format_wav() -> bytes:
    """A RIFF/WAVE file whose fmt chunk declares format tag 0x1234 (no codec has it)."""
    fmt = struct.pack("<HHIIHH", 0x1234, 1, 16000, 32000, 2, 16)
    data = b"\0" * 64
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


BAD_FILES = {
    "not-audio.wav": (b"this is a text file, not audio\n" * 10, "not a readable audio file"),
    "empty.wav": (_wav_bytes(np.zeros(0)), "empty"),
    "corrupt.wav": (_wav_bytes(np.ones(4000))[:30], "not a readable audio file"),
    "format.wav": (_unsupported_format_wav(), "not a readable audio file"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_cli_bad_files(name, model_path, tmp_path):
    data, needle = BAD_FILES[name]
    audio = tmp_path / name
    audio.write_bytes(data)
    r = _cli(["--model", str(model_path), "--audio", str(audio)])
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    assert needle in r.stderr


def test_cli_unknown_language_and_missing_file(model_path, tmp_path):
    r = _cli(
        ["--model", str(model_path), "--audio", str(FIXTURE / "audio.wav"), "--language", "xx"]
    )
    assert r.returncode == 2 and "language 'xx'" in r.stderr and r.stderr.count("\n") == 1
    r = _cli(["--model", str(model_path), "--audio", str(tmp_path / "none.wav")])
    assert r.returncode == 2 and "no such file" in r.stderr


def test_cli_json(model_path):
    r = _cli(["--model", str(model_path), "--audio", str(FIXTURE / "audio.wav"), "--json",
              "--timestamps", "--language", "en"])  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["language"] == "en" and out["duration"] == 2.5 and isinstance(out["segments"], list)


def _cli(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cellm.transcribe", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_whisper_model_is_not_a_text_model(model_path):
    """`cellm infer --model whisper-base` (a registry name now) says what to use instead."""
    with pytest.raises(cellm.errors.UnsupportedArchitecture, match="cellm.Whisper"):
        cellm.LLM(model_path)
    r = subprocess.run(
        [sys.executable, "-m", "cellm.infer", "--model", str(model_path), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
