"""Random-weight GGUF files with the shapes of real models, for speed benchmarks.

usage: python benches/random_gguf.py [--out DIR] [--shapes smollm2-135m,...] [--formats f16,...]

Writes DIR/<shape>-<format>.gguf for every shape and format: F16, Q8_0 and Q4_0 through gguf-py,
Q4_K_M by llama.cpp's own quantizer (llama-cpp-python) from the F16 file. Weights are N(0, 0.02),
norms 1, and the tokenizer a placeholder SentencePiece vocabulary: the files time arithmetic,
not language. Existing files are kept. Then `python -m cellm.bench --models DIR/x.gguf,...`.
"""

from __future__ import annotations

import argparse
import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    arch: str  # GGUF architecture: llama, qwen2 (q/k/v biases) or gemma3 (Gemma's norms)
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    rope_theta: float
    head_dim: int = 0  # 0: hidden // heads
    sliding_window: int = 0  # gemma3: local layers' window (llama.cpp: every 6th layer full)

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads


SHAPES = {
    "smollm2-135m": Shape("llama", 49152, 576, 1536, 30, 9, 3, 100000.0),
    "qwen2.5-0.5b": Shape("qwen2", 151936, 896, 4864, 24, 14, 2, 1000000.0),
    "llama-3.2-1b": Shape("llama", 128256, 2048, 8192, 16, 32, 8, 500000.0),
    "llama-3.2-3b": Shape("llama", 128256, 3072, 8192, 28, 24, 8, 500000.0),
    "gemma-3-270m": Shape("gemma3", 262144, 640, 2048, 18, 4, 1, 1000000.0, 256, 512),
}
FORMATS = ("f16", "q8_0", "q4_0", "q4_k_m")


def _tensors(shape: Shape, rng: np.random.Generator):
    """(GGUF name, float32 array) of every tensor, the embedding tied to the output."""

    def w(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)

    h, hd = shape.hidden, shape.hd
    q, kv = shape.heads * hd, shape.kv_heads * hd
    yield "token_embd.weight", w(shape.vocab, h)
    for i in range(shape.layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", np.ones(h, np.float32)
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            yield p + name + ".weight", w(rows, h)
            if shape.arch == "qwen2":
                yield p + name + ".bias", np.zeros(rows, np.float32)
        if shape.arch == "gemma3":
            yield p + "attn_q_norm.weight", np.ones(hd, np.float32)
            yield p + "attn_k_norm.weight", np.ones(hd, np.float32)
            yield p + "post_attention_norm.weight", np.ones(h, np.float32)
            yield p + "post_ffw_norm.weight", np.ones(h, np.float32)
        yield p + "attn_output.weight", w(h, q)
        yield p + "ffn_norm.weight", np.ones(h, np.float32)
        yield p + "ffn_gate.weight", w(shape.intermediate, h)
        yield p + "ffn_up.weight", w(shape.intermediate, h)
        yield p + "ffn_down.weight", w(h, shape.intermediate)
    yield "output_norm.weight", np.ones(h, np.float32)


def write_gguf(path: Path, shape: Shape, fmt: str) -> None:
    """F16, Q8_0 or Q4_0 (2-D tensors; vectors stay F32) through gguf-py."""
    import gguf

    qtype = {
        "f16": gguf.GGMLQuantizationType.F16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
        "q4_0": gguf.GGMLQuantizationType.Q4_0,
    }[fmt]
    writer = gguf.GGUFWriter(str(path), shape.arch)
    a = shape.arch
    writer.add_block_count(shape.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_uint32(f"{a}.rope.dimension_count", shape.hd)
    if shape.arch == "gemma3":
        writer.add_key_length(shape.hd)
        writer.add_value_length(shape.hd)
        writer.add_sliding_window(shape.sliding_window)
    writer.add_tokenizer_model("llama")
    # ASCII only: llama.cpp logs a cut-off prefix of this list, which must stay valid UTF-8.
    tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(shape.vocab - 3)]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * shape.vocab)
    writer.add_token_types([2, 3, 3] + [1] * (shape.vocab - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    for name, data in _tensors(shape, rng):
        if data.ndim == 2 and fmt == "f16":
            writer.add_tensor(name, data.astype(np.float16))
        elif data.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize_with_llama_cpp(src: Path, dst: Path, recipe: str = "Q4_K_M") -> None:
    """llama.cpp's own quantization recipe (llama_model_quantize), e.g. Q4_K_M, from F16."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{recipe}")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc}) for {src}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path.home() / ".cache" / "cellm" / "bench"))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--formats", default=",".join(FORMATS))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        for fmt in args.formats.split(","):
            path = out / f"{name}-{fmt}.gguf"
            if path.exists():
                continue
            if fmt == "q4_k_m":
                f16 = out / f"{name}-f16.gguf"
                if not f16.exists():
                    write_gguf(f16, shape, "f16")
                quantize_with_llama_cpp(f16, path, "Q4_K_M")
            else:
                write_gguf(path, shape, fmt)
            print(f"wrote {path} ({path.stat().st_size / 2**20:,.0f} MiB)", flush=True)


if __name__ == "__main__":
    main()
