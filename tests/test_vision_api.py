"""The vision-language API and CLI on the HF fixtures: chat messages with image parts,
`prompt_ids`, `logits(ids, images=)`, `encode_images`, streaming, multi-turn chats,
`cellm infer --image`, and one clear InvalidArgument for each kind of bad image input."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cellm import LLM, InvalidArgument
from cellm.convert import convert_hf

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MM = FIXTURES / "mm"
BIRD = FIXTURES / "images" / "bird.jpg"
ROOT = FIXTURES.parent.parent
# The lfm2_vl reference was made with the processor's use_image_special_tokens=False.
OPTIONS = {"idefics3": {}, "lfm2_vl": {"use_image_special_tokens": False}}


def user(*parts: object) -> dict:
    content = [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]
    return {"role": "user", "content": content}


def image(source: object = BIRD) -> dict:
    return {"type": "image", "image": source}


class Fixture:
    def __init__(self, name: str, path: Path) -> None:
        self.name, self.path = name, path
        self.ref = json.loads((MM / name / "reference.json").read_text())
        self.arrays = dict(np.load(MM / name / "reference.npz"))
        self.llm = LLM(path, kv_encoding="f32", processor=OPTIONS[name])
        self.messages = [user(image(), "What is in this image?")]


@pytest.fixture(scope="module", params=sorted(OPTIONS))
def fx(request, tmp_path_factory) -> Fixture:
    out = tmp_path_factory.mktemp("vlm-api") / f"{request.param}.cellm"
    return Fixture(request.param, convert_hf(MM / request.param, out, "f32"))


def test_prompt_ids_expand_the_image_as_the_hf_processor_does(fx):
    assert fx.llm.prompt_ids(fx.messages) == fx.ref["input_ids"]


def test_logits_with_images_match_at_every_position(fx):
    ids = fx.ref["input_ids"] + fx.ref["greedy_ids"][:-1]
    logits = fx.llm.logits(ids, images=[BIRD])
    np.testing.assert_allclose(logits, fx.arrays["logits"], atol=1e-3, rtol=0)


def test_encode_images_gives_the_connector_features(fx):
    features = fx.llm.encode_images([BIRD])
    np.testing.assert_allclose(features, fx.arrays["image_features"], atol=1e-4, rtol=0)


def test_chat_and_its_stream_give_the_greedy_ids(fx):
    result = fx.llm.chat(fx.messages, max_tokens=12, ignore_eos=True)
    assert result.token_ids == fx.ref["greedy_ids"]
    assert result.timings.images == 1 and result.timings.image_encode_s > 0
    events = fx.llm.stream_chat(fx.messages, max_tokens=12, ignore_eos=True)
    pieces = []
    while True:
        try:
            pieces.append(next(events))
        except StopIteration as done:
            assert done.value.token_ids == fx.ref["greedy_ids"]
            break
    assert "".join(pieces) == result.text


def test_every_form_of_image_part_is_the_same_image(fx):
    data = BIRD.read_bytes()
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    want = fx.llm.encode_images([BIRD])
    forms = [
        image(str(BIRD)),
        image(data),
        image(Image.open(BIRD)),
        image(np.asarray(Image.open(BIRD))),
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_url", "image_url": {"url": str(BIRD)}},
    ]
    for part in forms:
        messages = [user(part, "What is in this image?")]
        assert fx.llm.prompt_ids(messages) == fx.ref["input_ids"]
        assert (
            fx.llm.chat(messages, max_tokens=3, ignore_eos=True).token_ids
            == fx.ref["greedy_ids"][:3]
        )
    np.testing.assert_array_equal(fx.llm.encode_images([data]), want)


def small_bird() -> Image.Image:
    return Image.open(BIRD).resize((300, 200))


def test_two_images_in_one_prompt(fx):
    messages = [user(image(), "and", image(small_bird()), "compare them")]
    ids = fx.llm.prompt_ids(messages)
    image_tokens = sum(1 for t in ids if t == fx.ref["image_token_id"])
    features = fx.llm.encode_images([BIRD, small_bird()])
    assert image_tokens == len(features) > fx.ref["n_image_tokens"]
    both = fx.llm.logits(ids, images=[BIRD, small_bird()])
    assert both.shape == (len(ids), fx.llm.vocab_size)
    # A black second image of the same size makes the same ids, and other logits after it.
    black = Image.new("RGB", small_bird().size)
    assert fx.llm.prompt_ids([user(image(), "and", image(black), "compare them")]) == ids
    other = fx.llm.logits(ids, images=[BIRD, black])
    first = ids.index(fx.ref["image_token_id"]) + fx.ref["n_image_tokens"]
    np.testing.assert_allclose(other[:first], both[:first], atol=1e-5, rtol=0)
    assert np.abs(other[-1] - both[-1]).max() > 1e-3
    answer = fx.llm.chat(messages, max_tokens=4, ignore_eos=True)
    assert answer.timings.images == 2 and len(answer.token_ids) == 4


def test_an_image_in_the_second_turn(fx):
    first = [user("Hello there")]
    reply = fx.llm.chat(first, max_tokens=4, ignore_eos=True)
    history = [*first, {"role": "assistant", "content": reply.text}]
    messages = [*history, user(image(), "What is in this image?")]
    alone = fx.llm.chat(messages, max_tokens=6, ignore_eos=True)
    chat = fx.llm.conversation()
    chat.messages = list(history)
    turn = chat.send([image(), {"type": "text", "text": "What is in this image?"}])
    while True:
        try:
            next(turn)
        except StopIteration as done:
            result = done.value
            break
    assert result.token_ids[:6] == alone.token_ids
    assert result.timings.images == 1
    # A third turn finds the image's tokens cached: nothing is encoded again (LFM2's
    # recurrent state cannot rewind past the answer's last tokens, so it starts over).
    more = chat.send("And now?")
    while True:
        try:
            next(more)
        except StopIteration as done:
            assert done.value.timings.images == (0 if fx.name == "idefics3" else 1)
            break
    chat.close()


def test_a_vlm_conversation_interleaved_with_a_text_one_gets_its_own_results(fx):
    def run(chat, content) -> list[int]:
        events = chat.send(content)
        while True:
            try:
                next(events)
            except StopIteration as done:
                return list(done.value.token_ids)

    vlm_turns = [[image(), {"type": "text", "text": "What is in this image?"}], "Why?"]
    text_turns = ["Hello", "Tell me more"]
    alone_vlm = [run(c, t) for c in [fx.llm.conversation()] for t in vlm_turns]
    alone_text = [run(c, t) for c in [fx.llm.conversation()] for t in text_turns]
    vlm, text = fx.llm.conversation(), fx.llm.conversation()
    mixed_vlm, mixed_text = [], []
    for v, t in zip(vlm_turns, text_turns):
        mixed_text.append(run(text, t))
        mixed_vlm.append(run(vlm, v))
    assert mixed_vlm == alone_vlm and mixed_text == alone_text


# --- many requests at once (cellm.scheduler) ---


def test_chat_batch_with_images_equals_each_chat_alone(fx):
    """Image, text-only and two-image conversations in one batch: the image one gives the HF
    greedy ids, each the same ids as chat() alone, and the batch's images are encoded once."""
    conversations = [
        fx.messages,
        [user("Hello there")],
        [user(image(small_bird()), "and", image(), "compare them")],
    ]
    batch = fx.llm.chat_batch(conversations, max_tokens=6, ignore_eos=True)
    assert batch[0].token_ids == fx.ref["greedy_ids"][:6]
    for messages, result in zip(conversations, batch):
        assert result.token_ids == fx.llm.chat(messages, max_tokens=6, ignore_eos=True).token_ids
    assert [r.timings.images for r in batch] == [1, 0, 2]
    assert batch[0].timings.image_encode_s == batch[2].timings.image_encode_s > 0


def test_chunked_prefill_splits_an_image_between_steps(fx):
    """A step budget of 7 tokens cuts the image's 20 tokens over several prompt chunks; the
    answer is still the HF greedy one, beside a text request sharing the steps."""
    from cellm.sampling import SamplingParams
    from cellm.scheduler import Request, Scheduler

    params = SamplingParams(max_tokens=12, ignore_eos=True)
    scheduler = Scheduler(fx.llm, token_budget=7)
    images = fx.llm.vision.process([BIRD])
    vlm = scheduler.submit(Request(fx.ref["input_ids"], params, images=images))
    text_ids = fx.llm.prompt_ids([user("Hello there")])
    text = scheduler.submit(Request(text_ids, params))
    steps = 0
    while scheduler.step():
        steps += 1
    assert steps > len(fx.ref["input_ids"]) // 7
    assert drain(vlm.stream()).token_ids == fx.ref["greedy_ids"]
    assert drain(text.stream()).token_ids == fx.llm.generate(text_ids, params=params).token_ids
    with pytest.raises(InvalidArgument, match="image tokens but its images make 0"):
        scheduler.submit(Request(fx.ref["input_ids"], params))


def test_astream_takes_messages_with_images(fx):
    import asyncio

    async def answer() -> list[int]:
        stream = fx.llm.astream(fx.messages, max_tokens=12, ignore_eos=True)
        async for _ in stream:
            pass
        assert stream.result is not None
        return stream.result.token_ids

    try:
        assert asyncio.run(answer()) == fx.ref["greedy_ids"]
    finally:
        fx.llm.close()


def drain(events):
    while True:
        try:
            next(events)
        except StopIteration as done:
            return done.value


# --- the chat REPL ---


def test_the_repl_attaches_images_to_the_next_message(fx, tmp_path, capsys):
    import io

    from cellm.repl import chat_loop
    from cellm.sampling import SamplingParams

    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("not pixels")
    lines = iter([
        f"/image {not_an_image}\n",
        "What is in this image?\n",  # dropped with its bad image
        "/image /no/such/file.png\n",
        f"/image '{BIRD}'\n",
        "What is in this image?\n",
        "/exit\n",
    ])  # fmt: skip
    out = io.StringIO()
    conversation = fx.llm.conversation(params=SamplingParams(max_tokens=12, ignore_eos=True))
    chat_loop(conversation, lambda: next(lines, None), out)
    err = capsys.readouterr().err
    assert "not an image Pillow can read" in err and "/no/such/file.png: no such file" in err
    want = fx.llm.chat(fx.messages, max_tokens=12, ignore_eos=True).text
    assert out.getvalue() == "\n" + want + "\n"  # the failed turn's line, then the answer
    assert len(conversation.messages) == 2  # the failed turn left nothing behind
    conversation.close()


# --- bad input ---


def test_placeholders_and_images_must_pair_up(fx):
    with pytest.raises(InvalidArgument, match="2 image placeholders .* but 1 images"):
        fx.llm.prompt_ids([user(image(), "what is <image>?")])
    ids = fx.llm.prompt_ids([user("no image here")])
    with pytest.raises(InvalidArgument, match="0 image tokens but its images make"):
        fx.llm.logits(ids, images=[BIRD])
    with pytest.raises(InvalidArgument, match="image tokens but its images make 0"):
        fx.llm.generate(fx.ref["input_ids"], max_tokens=1)


@pytest.mark.parametrize(
    "source, message",
    [
        (b"GIF89a not really", "not an image Pillow can read"),
        (BIRD.read_bytes()[:5000], "cannot be decoded"),
        ("/no/such/image.png", "no such file"),
        (np.zeros((4, 4), np.float64), "must be uint8"),
    ],
)
def test_bad_images_are_one_invalid_argument_and_change_nothing(fx, source, message):
    chat = fx.llm.conversation()
    before = fx.llm.kv_stats()[0]
    with pytest.raises(InvalidArgument, match=message):
        next(chat.send([image(source), {"type": "text", "text": "hi"}]))
    assert chat.messages == [] and fx.llm.kv_stats()[0] == before
    with pytest.raises(InvalidArgument, match=message):
        fx.llm.encode_images([source])


def test_a_bomb_is_refused_before_decoding(fx, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(InvalidArgument, match="too large to decode safely"):
        fx.llm.chat(fx.messages, max_tokens=1)


def test_image_urls_other_than_data_and_paths_are_refused(fx):
    for url, message in [
        ("https://example.invalid/cat.png", "only data: URLs and file paths"),
        ("data:image/png,rawbytes", "must be base64"),
        ("data:image/png;base64,%%%", "invalid base64"),
    ]:
        part = {"type": "image_url", "image_url": {"url": url}}
        with pytest.raises(InvalidArgument, match=message):
            fx.llm.prompt_ids([user(part, "hi")])


def test_a_text_only_model_refuses_images(converted):
    llm = LLM(converted("llama", "f32"))
    with pytest.raises(InvalidArgument, match="text-only model"):
        llm.chat([user(image(), "hi")], max_tokens=1)
    with pytest.raises(InvalidArgument, match="text-only model"):
        llm.encode_images([BIRD])
    with pytest.raises(InvalidArgument, match="text-only model"):
        llm.chat_batch([[user(image(), "hi")]], max_tokens=1)


# --- the command line ---


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env)


def test_cellm_infer_with_an_image(fx):
    if fx.name != "idefics3":
        pytest.skip("one model is enough for the CLI")
    proc = cli("cellm", "infer", "--model", str(fx.path), "--image", str(BIRD), "--prompt",
               "What is in this image?", "--gen", "12", "--kv-encoding", "f32")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "images: 1 encoded in" in proc.stderr
    want = fx.llm.chat(fx.messages, max_tokens=12).text
    assert proc.stdout.rstrip("\n") == want
    bad = cli("cellm", "infer", "--model", str(fx.path), "--image", str(BIRD) + ".missing",
              "--prompt", "hi")  # fmt: skip
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and "no such file" in lines[0], bad.stderr
