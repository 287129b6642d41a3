"""Image preprocessing against HF: the fixtures' processor outputs (made by transformers with
torch), and transformers' own Idefics3 processor (which runs without torch) over many sizes,
aspect ratios and Pillow modes. Bad images are one InvalidArgument line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer

from cellm.errors import InvalidArgument
from cellm.vision import Idefics3Images, Lfm2VlImages, load_rgb
from cellm.vision.images import open_image, to_rgb

ROOT = Path(__file__).resolve().parent / "fixtures"
MM = ROOT / "mm"
BIRD = ROOT / "images" / "bird.jpg"


def fixture(name: str) -> tuple[dict, dict, dict[str, np.ndarray]]:
    d = MM / name
    config = json.loads((d / "processor_config.json").read_text())
    reference = json.loads((d / "reference.json").read_text())
    return config, reference, dict(np.load(d / "reference.npz"))


def expanded_ids(name: str, prompt: str, placeholders: list[str]) -> list[int]:
    parts = prompt.split("<image>")
    assert len(parts) == len(placeholders) + 1
    text = parts[0] + "".join(p + rest for p, rest in zip(placeholders, parts[1:]))
    tok = Tokenizer.from_file(str(MM / name / "tokenizer.json"))
    return tok.encode(text, add_special_tokens=False).ids


def test_idefics3_matches_the_fixture():
    config, ref, arrays = fixture("idefics3")
    images = Idefics3Images(config, patch_size=16)
    frames, rows, cols = images.frames(load_rgb(BIRD))
    np.testing.assert_array_equal(np.stack(frames)[None], arrays["pixel_values"])
    assert arrays["pixel_attention_mask"].all()  # square tiles: nothing padded
    processed = images.process(load_rgb(BIRD))
    assert processed.tokens == ref["n_image_tokens"]
    assert processed.grids == ((4, 4),) * 5
    assert expanded_ids("idefics3", ref["prompt"], [processed.placeholder]) == ref["input_ids"]


def test_lfm2_vl_matches_the_fixture():
    config, ref, arrays = fixture("lfm2_vl")
    # The reference was made with use_image_special_tokens=False (the processor's call option).
    images = Lfm2VlImages({**config, "use_image_special_tokens": False})
    processed = images.process(load_rgb(BIRD))
    ours = images.hf_arrays([processed])
    for key in ("pixel_values", "pixel_attention_mask", "spatial_shapes"):
        np.testing.assert_array_equal(ours[key], arrays[key], err_msg=key)
    assert processed.tokens == ref["n_image_tokens"]
    assert expanded_ids("lfm2_vl", ref["prompt"], [processed.placeholder]) == ref["input_ids"]


@pytest.mark.parametrize(
    "size", [(1, 1), (1, 8000), (8000, 1), (37, 23), (512, 512), (1024, 768), (768, 1024)]
)
def test_lfm2_vl_token_counts_follow_the_grids(size):
    """Default (LFM2.5-VL) settings: tiling with a thumbnail for large images; the prompt's
    image tokens are the tiles' patches over the 2x2 unshuffle."""
    images = Lfm2VlImages({"image_processor": {}})
    processed = images.process(np.zeros((size[1], size[0], 3), np.uint8))
    assert processed.tokens == sum((h // 2) * (w // 2) for h, w in processed.grids)
    assert processed.placeholder.count("<image>") == processed.tokens
    assert processed.patches.shape == (sum(h * w for h, w in processed.grids), 768)
    assert processed.placeholder.startswith("<|image_start|>")
    assert all(h % 2 == 0 and w % 2 == 0 for h, w in processed.grids)
    assert sum(h * w for h, w in processed.grids) <= 10 * 32 * 32 + 1024


def test_lfm2_vl_tiles_a_large_image_with_row_col_tokens_and_a_thumbnail():
    images = Lfm2VlImages({"image_processor": {}})
    processed = images.process(np.zeros((600, 1200, 3), np.uint8))
    assert processed.grids[:-1] == ((32, 32),) * 2  # 2 columns of 512 px tiles
    text = processed.placeholder
    assert "<|img_row_1_col_1|>" in text and "<|img_row_1_col_2|>" in text
    assert "<|img_thumbnail|>" in text and text.endswith("<|image_end|>")


# --- transformers' own Idefics3 processor, where it is installed (a test dependency) ---


@pytest.fixture(scope="module")
def hf_idefics3():
    pytest.importorskip("transformers")
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    return Idefics3Processor.from_pretrained(str(MM / "idefics3"))


def compare_with_hf(hf, image: Image.Image, config: dict | None = None) -> None:
    config = config or json.loads((MM / "idefics3" / "processor_config.json").read_text())
    prompt = "<|im_start|>User:<image>Describe.<end_of_utterance>\nAssistant:"
    want = hf(text=prompt, images=[[image]], return_tensors="np")
    ours = Idefics3Images(config, patch_size=16)
    frames, _, _ = ours.frames(np.asarray(to_rgb(image)))
    got = np.stack(frames)[None]
    assert got.shape == want["pixel_values"].shape
    np.testing.assert_allclose(got, want["pixel_values"], atol=1e-5, rtol=0)
    placeholder = ours.process(np.asarray(to_rgb(image))).placeholder
    assert expanded_ids("idefics3", prompt, [placeholder]) == want["input_ids"][0].tolist()


@pytest.mark.parametrize(
    "size",
    [(1, 1), (2, 1), (1, 2), (63, 64), (64, 64), (65, 64), (100, 37), (37, 100), (128, 86),
     (129, 129), (300, 200), (200, 300), (1199, 803), (1, 8000), (8000, 1), (1000, 10),
     (8000, 6000)],
)  # fmt: skip
def test_idefics3_matches_transformers_over_sizes(hf_idefics3, size):
    rng = np.random.default_rng(size[0] * 10007 + size[1])
    small = rng.integers(0, 256, (min(size[1], 64), min(size[0], 64), 3), dtype=np.uint8)
    image = Image.fromarray(small).resize(size, Image.Resampling.BILINEAR)
    compare_with_hf(hf_idefics3, image)


def test_idefics3_matches_transformers_without_splitting_and_at_other_filters(hf_idefics3):
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    image = Image.open(BIRD)
    for changes in ({"do_image_splitting": False}, {"resample": 3}, {"resample": 2}):
        config = json.loads((MM / "idefics3" / "processor_config.json").read_text())
        config["image_processor"].update(changes)
        hf = Idefics3Processor.from_pretrained(str(MM / "idefics3"), **changes)
        compare_with_hf(hf, image, config)


def mode_image(mode: str) -> Image.Image:
    rgb = Image.open(BIRD).resize((90, 70))
    if mode == "P+transparency":
        p = rgb.convert("P")
        p.info["transparency"] = 0
        return p
    if mode in ("LA", "RGBA", "PA"):
        base = rgb.convert(mode[:-1] if mode != "PA" else "P").convert(mode)
        alpha = Image.linear_gradient("L").resize(base.size)
        base.putalpha(alpha)
        return base
    if mode in ("I;16", "I"):
        return Image.fromarray(np.asarray(rgb.convert("L"), np.uint16) * 257).convert(mode)
    return rgb.convert(mode)


@pytest.mark.parametrize(
    "mode", ["1", "L", "LA", "P", "P+transparency", "PA", "RGBA", "CMYK", "I;16", "I", "F",
             "YCbCr", "RGB"]
)  # fmt: skip
def test_idefics3_matches_transformers_for_every_mode(hf_idefics3, mode):
    compare_with_hf(hf_idefics3, mode_image(mode))


# --- loading ---


def jpeg_bytes(image: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "JPEG", **kw)
    return buf.getvalue()


def test_every_input_form_gives_the_same_pixels(tmp_path):
    want = load_rgb(BIRD)
    data = BIRD.read_bytes()
    assert want.shape == (803, 1199, 3) and want.dtype == np.uint8
    for source in (str(BIRD), data, Image.open(BIRD), want, want[:, :, :3].copy()):
        np.testing.assert_array_equal(load_rgb(source), want)
    gray = want[:, :, 0]
    np.testing.assert_array_equal(load_rgb(gray), np.repeat(gray[:, :, None], 3, axis=2))
    np.testing.assert_array_equal(load_rgb(gray[:, :, None]), load_rgb(gray))


def test_exif_rotation_is_applied_to_decoded_files(tmp_path):
    image = Image.open(BIRD).resize((60, 40))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    path = tmp_path / "rotated.jpg"
    path.write_bytes(jpeg_bytes(image, exif=exif.tobytes()))
    assert load_rgb(path).shape == (60, 40, 3)
    assert load_rgb(path.read_bytes()).shape == (60, 40, 3)


@pytest.mark.parametrize(
    "source, message",
    [
        (b"this is not an image", "not an image"),
        ("/nonexistent/cat.png", "no such file"),
        (np.zeros((4, 4, 2), np.uint8), "must be \\(height, width\\)"),
        (np.zeros((4, 4, 3), np.float32), "must be uint8"),
        (np.zeros((0, 4, 3), np.uint8), "empty"),
        (3.5, "must be a path, bytes"),
    ],
)
def test_bad_images_are_one_clear_error(source, message):
    with pytest.raises(InvalidArgument, match=message):
        load_rgb(source)


def test_a_truncated_jpeg_is_refused():
    data = BIRD.read_bytes()
    with pytest.raises(InvalidArgument, match="cannot be decoded"):
        load_rgb(data[: len(data) // 2])


def test_an_image_over_the_decompression_bomb_limit_is_refused_before_decoding(monkeypatch):
    # Between the limit and twice it Pillow only warns; both are refusals here.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1199 * 803 - 1)
    with pytest.raises(InvalidArgument, match="too large to decode safely"):
        load_rgb(BIRD)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1199 * 803 // 3)
    with pytest.raises(InvalidArgument, match="too large to decode safely"):
        load_rgb(BIRD.read_bytes())
    with pytest.raises(InvalidArgument, match="decompression-bomb limit"):
        open_image(Image.new("L", (1199, 803)))
