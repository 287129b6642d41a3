"""Random-weight HF checkpoints with the shapes of real vision-language models, for speed
benchmarks (`benches/vision_bench.py`): SmolVLM-256M (SigLIP-base/16 at 512 px tiles, pixel
shuffle 4, SmolLM2-135M) and LFM2.5-VL-450M (SigLIP2 NaFlex 12 x 768, 2x2 unshuffle, projector
3072 -> 2048 -> 1024, LFM2-350M). Weights are N(0, 0.02) in f16, norms 1; the tokenizer is the
tiny fixture's (its ids are a subset of the vocabulary). They time arithmetic, not language.

usage: python benches/random_vlm.py [--out DIR] [--shapes smolvlm-256m,lfm2.5-vl-450m]
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "mm"
SHAPES = ("smolvlm-256m", "lfm2.5-vl-450m")


def siglip(prefix: str, hidden: int, inter: int, layers: int, patch_in: list[int], positions: int):
    """(name, shape) of a SigLIP tower: patch embedding, positions, layers, post norm."""
    e = f"{prefix}embeddings."
    yield e + "patch_embedding.weight", [hidden, *patch_in]
    yield e + "patch_embedding.bias", [hidden]
    yield e + "position_embedding.weight", [positions, hidden]
    for i in range(layers):
        p = f"{prefix}encoder.layers.{i}."
        for n in ("layer_norm1", "layer_norm2"):
            yield p + n + ".weight", [hidden]
            yield p + n + ".bias", [hidden]
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            yield p + f"self_attn.{n}.weight", [hidden, hidden]
            yield p + f"self_attn.{n}.bias", [hidden]
        yield p + "mlp.fc1.weight", [inter, hidden]
        yield p + "mlp.fc1.bias", [inter]
        yield p + "mlp.fc2.weight", [hidden, inter]
        yield p + "mlp.fc2.bias", [hidden]
    yield prefix + "post_layernorm.weight", [hidden]
    yield prefix + "post_layernorm.bias", [hidden]


def smolvlm() -> tuple[dict, dict, Iterator]:
    vocab, h, inter, layers, heads, kv = 49280, 576, 1536, 30, 9, 3
    hd = h // heads
    text = {"model_type": "llama", "hidden_size": h, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
            "max_position_embeddings": 8192, "tie_word_embeddings": False}  # fmt: skip
    vision = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
              "num_attention_heads": 12, "image_size": 512, "patch_size": 16}  # fmt: skip
    config = {"model_type": "idefics3", "architectures": ["Idefics3ForConditionalGeneration"],
              "image_token_id": 14, "scale_factor": 4, "text_config": text,
              "vision_config": vision, "tie_word_embeddings": False,
              "vocab_size": vocab}  # fmt: skip
    processor = {"image_seq_len": 64, "image_processor": {
        "image_processor_type": "Idefics3ImageProcessor", "do_image_splitting": True,
        "max_image_size": {"longest_edge": 512}, "size": {"longest_edge": 2048}, "resample": 1,
        "rescale_factor": 1 / 255, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}}  # fmt: skip

    def tensors():
        yield from siglip("model.vision_model.", 768, 3072, 12, [3, 16, 16], 1024)
        yield "model.connector.modality_projection.proj.weight", [h, 768 * 16]
        yield "model.text_model.embed_tokens.weight", [vocab, h]
        for i in range(layers):
            p = f"model.text_model.layers.{i}."
            yield p + "input_layernorm.weight", [h]
            yield p + "self_attn.q_proj.weight", [heads * hd, h]
            yield p + "self_attn.k_proj.weight", [kv * hd, h]
            yield p + "self_attn.v_proj.weight", [kv * hd, h]
            yield p + "self_attn.o_proj.weight", [h, heads * hd]
            yield p + "post_attention_layernorm.weight", [h]
            yield p + "mlp.gate_proj.weight", [inter, h]
            yield p + "mlp.up_proj.weight", [inter, h]
            yield p + "mlp.down_proj.weight", [h, inter]
        yield "model.text_model.norm.weight", [h]
        yield "lm_head.weight", [vocab, h]

    return config, processor, tensors()


def lfm2_vl() -> tuple[dict, dict, Iterator]:
    vocab, h, ff, layers, heads, kv = 65536, 1024, 4608, 16, 16, 8
    attention = [2, 5, 8, 10, 12, 14]
    hd = h // heads
    text = {"model_type": "lfm2", "hidden_size": h, "intermediate_size": 6656,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "vocab_size": vocab, "norm_eps": 1e-5, "conv_L_cache": 3, "full_attn_idxs": attention,
            "rope_theta": 1000000.0, "max_position_embeddings": 128000,
            "tie_word_embeddings": True}  # fmt: skip
    vision = {"model_type": "siglip2_vision_model", "hidden_size": 768, "intermediate_size": 3072,
              "num_hidden_layers": 12, "num_attention_heads": 12, "num_patches": 256,
              "patch_size": 16, "vision_use_head": False}  # fmt: skip
    config = {"model_type": "lfm2_vl", "architectures": ["Lfm2VlForConditionalGeneration"],
              "image_token_id": 14, "downsample_factor": 2, "projector_hidden_size": 2048,
              "projector_hidden_act": "gelu", "text_config": text, "vision_config": vision,
              "tie_word_embeddings": True, "vocab_size": vocab}  # fmt: skip
    # The seed's setting: one tile (min/max tiles 1, no thumbnail), up to 256 tokens.
    processor = {"use_image_special_tokens": False, "image_processor": {
        "image_processor_type": "Lfm2VlImageProcessor", "do_image_splitting": False,
        "min_image_tokens": 64, "max_image_tokens": 256, "min_tiles": 1, "max_tiles": 1,
        "use_thumbnail": False, "encoder_patch_size": 16, "downsample_factor": 2,
        "tile_size": 512}}  # fmt: skip

    def tensors():
        yield from siglip("model.vision_tower.", 768, 3072, 12, [768], 256)
        m = "model.multi_modal_projector."
        yield m + "layer_norm.weight", [3072]
        yield m + "layer_norm.bias", [3072]
        yield m + "linear_1.weight", [2048, 3072]
        yield m + "linear_1.bias", [2048]
        yield m + "linear_2.weight", [h, 2048]
        yield m + "linear_2.bias", [h]
        yield "model.language_model.embed_tokens.weight", [vocab, h]
        for i in range(layers):
            p = f"model.language_model.layers.{i}."
            yield p + "operator_norm.weight", [h]
            yield p + "ffn_norm.weight", [h]
            if i in attention:
                for n, rows in (("q_proj", h), ("k_proj", kv * hd), ("v_proj", kv * hd)):
                    yield p + f"self_attn.{n}.weight", [rows, h]
                yield p + "self_attn.out_proj.weight", [h, h]
                yield p + "self_attn.q_layernorm.weight", [hd]
                yield p + "self_attn.k_layernorm.weight", [hd]
            else:
                yield p + "conv.in_proj.weight", [3 * h, h]
                yield p + "conv.conv.weight", [h, 1, 3]
                yield p + "conv.out_proj.weight", [h, h]
            yield p + "feed_forward.w1.weight", [ff, h]
            yield p + "feed_forward.w3.weight", [ff, h]
            yield p + "feed_forward.w2.weight", [h, ff]
        yield "model.language_model.embedding_norm.weight", [h]

    return config, processor, tensors()


def write_safetensors(path: Path, tensors: Iterator, seed: int) -> None:
    """F16 tensors, N(0, 0.02) except norms (1) and biases (0), written one at a time."""
    rng = np.random.default_rng(seed)
    shapes = list(tensors)
    header, offset = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "F16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in shapes:
            if "norm" in name and name.endswith(".weight"):
                a = np.ones(shape, np.float16)
            elif name.endswith(".bias"):
                a = np.zeros(shape, np.float16)
            else:
                a = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
            f.write(a.tobytes())


def make(shape: str, out: Path) -> Path:
    """DIR/<shape>/, a complete HF checkpoint directory (kept if it exists)."""
    d = out / shape
    if (d / "model.safetensors").exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    config, processor, tensors = smolvlm() if shape == "smolvlm-256m" else lfm2_vl()
    fixture = FIXTURES / ("idefics3" if shape == "smolvlm-256m" else "lfm2_vl")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(fixture / name, d / name)
    (d / "config.json").write_text(json.dumps(config, indent=1))
    (d / "processor_config.json").write_text(json.dumps(processor, indent=1))
    write_safetensors(d / "model.safetensors.partial", tensors, seed=len(shape))
    (d / "model.safetensors.partial").rename(d / "model.safetensors")
    return d


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "target" / "bench-models")
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
        print(make(shape, args.out))


if __name__ == "__main__":
    main()
