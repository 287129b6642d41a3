"""cellm's LFM2-VL image preprocessing against transformers' own `Lfm2VlProcessor`, which
needs torch and torchvision (so it is not a test): pixel values, masks, spatial shapes and
prompt ids over sizes from 1x1 to 8000x6000, four processor settings and Pillow's modes.

usage (where torch, torchvision and transformers are installed): python
tools/check_lfm2_vl_processor.py  -> a JSON summary; exit 1 on any difference
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast
from transformers.models.lfm2_vl.image_processing_lfm2_vl import Lfm2VlImageProcessor
from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
from cellm.vision import Lfm2VlImages  # noqa: E402
from cellm.vision.images import to_rgb  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "mm" / "lfm2_vl"
BIRD = ROOT / "tests" / "fixtures" / "images" / "bird.jpg"
SMALL = dict(min_image_tokens=4, max_image_tokens=16, tile_size=64, min_tiles=2, max_tiles=6)
SETTINGS: dict[str, dict[str, Any]] = {
    "fixture": dict(do_image_splitting=False, min_tiles=1, max_tiles=1, use_thumbnail=False,
                    min_image_tokens=4, max_image_tokens=24, tile_size=64),
    "default": {},
    "small-tiles": SMALL,
    "bicubic": {**SMALL, "resample": 3},
}  # fmt: skip
SIZES = [(1, 1), (2, 3), (17, 5), (64, 64), (100, 37), (37, 100), (300, 200), (640, 480),
         (1024, 768), (768, 1024), (1199, 803), (2000, 300), (300, 2000), (1, 4000), (4000, 1),
         (3000, 2000), (8000, 6000)]  # fmt: skip
MODES = ["L", "LA", "P", "RGBA", "CMYK", "I;16", "1"]


def mode_image(mode: str) -> Image.Image:
    base = Image.open(BIRD).resize((300, 200))
    if mode == "I;16":
        return Image.fromarray(np.asarray(base.convert("L"), np.uint16) * 257).convert(mode)
    img = base.convert(mode)
    if mode in ("LA", "RGBA"):
        img.putalpha(Image.linear_gradient("L").resize(img.size))
    return img


def main() -> int:
    tok = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
    fast = PreTrainedTokenizerFast(
        tokenizer_file=str(FIXTURE / "tokenizer.json"),
        bos_token="<|startoftext|>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
    )
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"cases": 0, "pixel_max_diff": 0.0, "differences": [], "hf_fails": []}
    text = "<|im_start|>user\n<image>hi<|im_end|>"
    for name, settings in SETTINGS.items():
        images = []
        for w, h in SIZES:
            if name == "default" or (w, h) != (8000, 6000):
                small = rng.integers(0, 256, (min(h, 64), min(w, 64), 3), dtype=np.uint8)
                images.append(Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR))
        images += [mode_image(m) for m in MODES]
        special = name != "fixture"
        hf_processor = Lfm2VlImageProcessor(**settings, do_convert_rgb=True)
        hf = Lfm2VlProcessor(image_processor=hf_processor, tokenizer=fast)
        ours = Lfm2VlImages(
            {"image_processor": hf_processor.to_dict(), "use_image_special_tokens": special}
        )
        for img in images:
            case = [name, img.mode, list(img.size)]
            try:
                want = hf(text=text, images=[[img]], return_tensors="pt",
                          use_image_special_tokens=special)  # fmt: skip
            except RuntimeError as e:  # HF's own failures (tiles of unequal size)
                out["hf_fails"].append([*case, str(e)[:60]])
                continue
            processed = ours.process(np.asarray(to_rgb(img)))
            got = ours.hf_arrays([processed])
            for key in ("pixel_values", "pixel_attention_mask", "spatial_shapes"):
                w_, g_ = want[key].numpy(), got[key]
                if w_.shape != g_.shape or (key != "pixel_values" and not (w_ == g_).all()):
                    out["differences"].append([*case, key])
            if want["pixel_values"].shape == got["pixel_values"].shape:
                diff = float(np.abs(got["pixel_values"] - want["pixel_values"].numpy()).max())
                out["pixel_max_diff"] = max(out["pixel_max_diff"], diff)
            ids = tok.encode(text.replace("<image>", processed.placeholder)).ids
            if ids != want["input_ids"][0].tolist():
                out["differences"].append([*case, "input_ids"])
            out["cases"] += 1
    print(json.dumps(out, indent=1))
    return 1 if out["differences"] or out["pixel_max_diff"] > 1e-5 else 0


if __name__ == "__main__":
    sys.exit(main())
