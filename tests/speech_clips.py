"""Speech made offline with espeak-ng (a Debian package; .ci/run installs it) for the real
Whisper tests and benchmarks: ten short English sentences, a 45-second story (two windows,
for long-form seeking) and a 29-second one (one window, the benchmark's clip); and word
error rate against the text spoken."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "She sells sea shells by the sea shore every summer morning.",
    "Please call the office before noon to confirm your appointment.",
    "The weather today is cold and windy with a chance of rain.",
    "My brother bought a new bicycle at the market on Saturday.",
    "We will meet at the library after the meeting ends.",
    "The children played football in the park until it got dark.",
    "A cup of hot tea is the best way to start the day.",
    "The train to the city leaves from platform four at nine.",
    "Open the window and let some fresh air into the room.",
]
STORY = (
    "Once upon a time there was a small village at the edge of a great forest. The people "
    "who lived there were farmers, and every morning they walked out to their fields to work. "
    "In the spring they planted wheat and corn, and in the summer they watched the crops grow "
    "tall under the warm sun. When autumn came, the whole village worked together to bring in "
    "the harvest before the first snow. In the evenings the families gathered around the fire "
    "to share stories, and the children listened quietly until they fell asleep. Winter was "
    "long and cold, but there was always enough bread for everyone."
)
STORY_MORE = (
    " One year a traveler arrived from the mountains with a heavy bag on his back. He asked "
    "for a place to sleep, and an old woman offered him a bed near her kitchen. In the morning "
    "he opened the bag and showed the children a collection of maps, each one drawn by hand."
)
# name -> (text, espeak-ng words per minute)
CLIPS = {
    **{f"sentence{i + 1:02d}": (s, 175) for i, s in enumerate(SENTENCES)},
    "story45": (STORY + STORY_MORE, 175),  # ~45 s: two windows
}
BENCH_CLIP = ("story29", STORY, 190)  # ~29 s: one window


def espeak() -> str | None:
    return shutil.which("espeak-ng")


def make_clip(directory: Path, name: str, text: str, wpm: int) -> Path:
    """`text` spoken by espeak-ng's en-us voice into `directory/name.wav` (22.05 kHz mono)."""
    exe = espeak()
    if exe is None:
        raise RuntimeError("espeak-ng is not installed")
    Path(directory).mkdir(parents=True, exist_ok=True)
    path = Path(directory) / f"{name}.wav"
    if not path.is_file():
        tmp = path.with_suffix(".tmp.wav")
        subprocess.run(
            [exe, "-v", "en-us", "-s", str(wpm), "-w", str(tmp), text],
            check=True,
            capture_output=True,
            timeout=120,
        )
        tmp.replace(path)
    return path


def make_clips(directory: Path) -> dict[str, tuple[Path, str]]:
    """Every test clip: name -> (wav path, the text spoken)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    return {n: (make_clip(directory, n, t, w), t) for n, (t, w) in CLIPS.items()}


_NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve".split()
_SPELLING = {"traveller": "traveler", "seashells": "sea shells", "seashore": "sea shore"}


def normalize(text: str) -> list[str]:
    """Lower case words without punctuation; digits 0-12 spelled out, a few British and
    compound spellings made the reference's (both engines get the same treatment)."""
    text = text.lower().replace("-", " ")
    text = re.sub(r"[^a-z0-9' ]+", " ", text)
    words: list[str] = []
    for w in text.split():
        w = w.strip("'")
        if w.isdigit() and int(w) < len(_NUMBERS):
            w = _NUMBERS[int(w)]
        words.extend(_SPELLING.get(w, w).split())
    return words


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(word-level edit distance, reference words)."""
    ref, hyp = normalize(reference), normalize(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[len(hyp)], len(ref)


def wer(pairs: list[tuple[str, str]]) -> float:
    """Corpus word error rate of (reference, hypothesis) pairs."""
    errors = words = 0
    for ref, hyp in pairs:
        e, n = word_errors(ref, hyp)
        errors += e
        words += n
    return errors / max(1, words)
