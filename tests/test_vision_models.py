"""SmolVLM (Idefics3) and LFM2-VL on the engine: the HF fixtures converted, image features
from the Rust tower within 1e-4 of transformers', and logits within 1e-3 at every position
with the features placed at the image tokens, in one prefill and token by token."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cellm import _core
from cellm.convert import convert_hf
from cellm.errors import InvalidArgument
from cellm.vision import Idefics3Images, Lfm2VlImages, ProcessedImage, load_rgb

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MM = FIXTURES / "mm"
BIRD = FIXTURES / "images" / "bird.jpg"
NAMES = ["idefics3", "lfm2_vl"]


class Fixture:
    def __init__(self, name: str, path: Path) -> None:
        d = MM / name
        self.name, self.path = name, path
        self.ref = json.loads((d / "reference.json").read_text())
        self.arrays = dict(np.load(d / "reference.npz"))
        config = json.loads((d / "processor_config.json").read_text())
        if name == "idefics3":
            self.images: Idefics3Images | Lfm2VlImages = Idefics3Images(config, patch_size=16)
        else:
            # The reference was made with use_image_special_tokens=False.
            self.images = Lfm2VlImages({**config, "use_image_special_tokens": False})

    def engine(self, **kw) -> _core.Engine:
        return _core.Engine(self.path, kv_encoding="f32", **kw)

    def image(self) -> ProcessedImage:
        return self.images.process(load_rgb(BIRD))

    def image_rows(self, ids: list[int]) -> list[int]:
        return [i for i, t in enumerate(ids) if t == self.ref["image_token_id"]]


@pytest.fixture(scope="module", params=NAMES)
def fx(request, tmp_path_factory) -> Fixture:
    out = tmp_path_factory.mktemp("vlm") / f"{request.param}.cellm"
    return Fixture(request.param, convert_hf(MM / request.param, out, "f32"))


def test_the_vision_tower_and_connector_come_first_then_the_text_model(fx):
    header = json.loads(fx.engine().header_json())
    names = [t["name"] for t in header["tensors"]]
    assert names[0] == "vision.embeddings.patch_embedding.weight"
    assert names.index("vision.post_layernorm.weight") < names.index("model.embed_tokens.weight")
    patch = next(t for t in header["tensors"] if t["name"] == names[0])
    assert patch["shape"] == [32, 3 * 16 * 16]
    assert header["model"]["vision"]["connector"] == fx.name
    assert header["processor"]["image_processor"]["image_processor_type"].endswith("Processor")


def test_image_features_match_transformers(fx):
    image = fx.image()
    features = fx.engine().encode_images(image.patches, list(image.grids))
    want = fx.arrays["image_features"]
    assert features.shape == want.shape == (image.tokens, 64)
    np.testing.assert_allclose(features, want, atol=1e-4, rtol=0)


def test_logits_match_at_every_position_in_one_prefill(fx):
    e = fx.engine()
    image = fx.image()
    features = e.encode_images(image.patches, list(image.grids))
    ids = fx.ref["input_ids"] + fx.ref["greedy_ids"][:-1]
    logits = e.step(
        [(e.create_session(), ids)], all_logits=True, embeds=[(0, fx.image_rows(ids), features)]
    )
    np.testing.assert_allclose(logits, fx.arrays["logits"], atol=1e-3, rtol=0)


def test_prefill_then_token_by_token_decode_gives_the_greedy_ids(fx):
    e = fx.engine()
    image = fx.image()
    features = e.encode_images(image.patches, list(image.grids))
    prompt = fx.ref["input_ids"]
    s = e.create_session()
    logits = e.step([(s, prompt)], embeds=[(0, fx.image_rows(prompt), features)])
    want = fx.arrays["logits"][len(prompt) - 1 :]
    got, rows = [], [logits[0]]
    for _ in fx.ref["greedy_ids"]:
        got.append(int(rows[-1].argmax()))
        rows.append(e.step([(s, [got[-1]])])[0])
    assert got == fx.ref["greedy_ids"]
    np.testing.assert_allclose(np.stack(rows[: len(want)]), want, atol=1e-3, rtol=0)


def test_a_vlm_session_batched_with_a_text_session_gets_its_own_results(fx):
    e = fx.engine()
    image = fx.image()
    features = e.encode_images(image.patches, list(image.grids))
    prompt = fx.ref["input_ids"]
    text = [t for t in prompt if t != fx.ref["image_token_id"]][:20]
    alone_text = e.step([(e.create_session(), text)], all_logits=True)
    vlm, txt = e.create_session(), e.create_session()
    both = e.step(
        [(txt, text), (vlm, prompt)],
        all_logits=True,
        embeds=[(1, fx.image_rows(prompt), features)],
    )
    np.testing.assert_allclose(both[: len(text)], alone_text, atol=1e-5, rtol=0)
    np.testing.assert_allclose(
        both[len(text) :], fx.arrays["logits"][: len(prompt)], atol=1e-3, rtol=0
    )


def test_two_images_in_one_prompt_take_their_features_in_order(fx):
    """The features of two images concatenated are those of each image alone."""
    e = fx.engine()
    one = fx.image()
    small = fx.images.process(load_rgb(BIRD)[::3, ::2].copy())
    first = e.encode_images(one.patches, list(one.grids))
    second = e.encode_images(small.patches, list(small.grids))
    both = e.encode_images(np.concatenate([one.patches, small.patches]), [*one.grids, *small.grids])
    np.testing.assert_allclose(both, np.concatenate([first, second]), atol=1e-5, rtol=0)


def test_tiles_past_one_chunk_of_the_tower_keep_their_features(fx):
    """The tower passes tiles through its layers in chunks of about 1024 patches (whole
    tiles): enough copies of one image to fill several chunks, and one tile larger than a
    chunk, give each tile the features it has alone."""
    e = fx.engine()
    one = fx.image()
    alone = e.encode_images(one.patches, list(one.grids))
    # Each copy scaled differently, so a chunk given another chunk's patches shows.
    copies = [one.patches * (1 - 0.02 * i) for i in range(1100 // one.patches.shape[0] + 2)]
    many = e.encode_images(np.concatenate(copies), list(one.grids) * len(copies))
    each = [e.encode_images(c, list(one.grids)) for c in copies]
    np.testing.assert_allclose(many, np.concatenate(each), atol=1e-5, rtol=0)
    if fx.name == "lfm2_vl":  # NaFlex takes any grid: one 34x34 tile, over 1024 patches
        rng = np.random.default_rng(0)
        big = rng.uniform(-1, 1, (34 * 34, one.patches.shape[1])).astype(np.float32)
        got = e.encode_images(np.concatenate([big, one.patches]), [(34, 34), *one.grids])
        want = e.encode_images(big, [(34, 34)])
        np.testing.assert_allclose(got, np.concatenate([want, alone]), atol=1e-5, rtol=0)


def test_quantized_text_keeps_a_float_vision_tower(tmp_path):
    path = convert_hf(MM / "lfm2_vl", tmp_path / "q.cellm", "f16", quantize="q8_0")
    header = json.loads(_core.Engine(path).header_json())
    formats = {t["name"]: t["format"] for t in header["tensors"]}
    assert formats["vision.encoder.layers.0.mlp.fc1.weight"] == "f16"
    assert formats["connector.linear_1.weight"] == "f16"
    assert formats["model.layers.0.feed_forward.w1.weight"].startswith("q8_0")
    fx = Fixture("lfm2_vl", path)
    image = fx.image()
    features = fx.engine().encode_images(image.patches, list(image.grids))
    np.testing.assert_allclose(features, fx.arrays["image_features"], atol=2e-2, rtol=0)


def test_vision_quantize_asks_for_an_int8_tower(tmp_path):
    path = convert_hf(MM / "lfm2_vl", tmp_path / "v8.cellm", "f16", vision_quantize="int8")
    header = json.loads(_core.Engine(path).header_json())
    formats = {t["name"]: t["format"] for t in header["tensors"]}
    assert formats["vision.encoder.layers.0.self_attn.q_proj.weight"] == "i8_row"
    assert formats["connector.linear_2.weight"] == "i8_row"
    assert formats["model.layers.0.feed_forward.w1.weight"] == "f16"
    assert header["source"]["vision_quantize"] == "int8"
    fx = Fixture("lfm2_vl", path)
    image = fx.image()
    features = fx.engine().encode_images(image.patches, list(image.grids))
    # int8 rows on random weights: about 1% of the features' scale (3-4).
    np.testing.assert_allclose(features, fx.arrays["image_features"], atol=0.1, rtol=0)


def test_vision_quantize_needs_a_vision_tower(tmp_path):
    with pytest.raises(InvalidArgument, match="no vision tower"):
        convert_hf(FIXTURES / "hf-tiny" / "llama", tmp_path / "x.cellm", vision_quantize="int8")


def test_bad_vision_input_is_refused(fx):
    e = fx.engine()
    image = fx.image()
    with pytest.raises(InvalidArgument, match="patch values"):
        e.encode_images(image.patches[:-1], list(image.grids))
    with pytest.raises(InvalidArgument, match="multiple of 2"):
        e.encode_images(image.patches[:15], [(3, 5)])
    features = e.encode_images(image.patches, list(image.grids))
    s = e.create_session()
    with pytest.raises(InvalidArgument, match="embedding for token 5 of 5"):
        e.step([(s, [1, 2, 3, 4, 5])], embeds=[(0, [5], features[:1])])
    with pytest.raises(InvalidArgument, match="embedding values"):
        e.step([(s, [1, 2, 3])], embeds=[(0, [0, 1], features[:1])])
    with pytest.raises(InvalidArgument, match="batch entry 1"):
        e.step([(s, [1, 2, 3])], embeds=[(1, [0], features[:1])])
    assert e.session_len(s) == 0


def test_a_text_only_model_takes_no_images(converted):
    e = _core.Engine(converted("llama", "f32"))
    with pytest.raises(InvalidArgument, match="takes no images"):
        e.encode_images(np.zeros((4, 768), np.float32), [(2, 2)])
