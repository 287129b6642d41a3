"""Encoder speed: all-MiniLM-L6-v2 (the registry's, f32) and a privacy-filter checkpoint of the
real model's shape (640 hidden, 8 layers, 14/2 heads of 64, 128 experts top-4 of 640, vocab
200064; random f16 weights, written by this script) on a batch of 64 texts of 128 tokens, in
tokens/s and in GFLOP/s of their matmuls against the machine's float FMA peak measured in the
same run on the same threads, before and after (`cellm._core.fma_peak`; numpy's BLAS GEMM is
printed beside it for context). MiniLM also runs in ONNX
Runtime on the same weights, from an ONNX graph built here with the `onnx` package's helpers
(no torch); its hidden states are checked against cellm's before timing.

usage: python benches/encoder_bench.py [--threads 2] [--runs 3] [--models DIR] [--out FILE.md]
       (ONNX Runtime needs `pip install onnx onnxruntime`; without them that row is skipped)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
BATCH, SEQ = 64, 128

# The real openai/privacy-filter's options (its config.json), random weights.
PRIVACY_FILTER = {
    "hidden_size": 640,
    "head_dim": 64,
    "intermediate_size": 640,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "num_hidden_layers": 8,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "vocab_size": 200064,
    "sliding_window": 128,
}


def fma_peak(threads: int) -> float:
    """The machine's float FMA peak in GFLOP/s on `threads` threads (`cellm._core.fma_peak`,
    best of 3 passes): the denominator issue 24's target names."""
    from cellm import _core

    return float(_core.fma_peak(threads, 3))


def blas_gemm(threads: int) -> float:
    """GFLOP/s of a 4096^3 f32 GEMM in numpy's BLAS on `threads` threads (set through the
    BLAS environment variables before numpy loads): what a tuned library reaches, for context."""
    import numpy as np

    n = 4096
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def timed(fn: Callable[[], Any], runs: int) -> float:
    """Median seconds of `runs` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# --- MiniLM ---------------------------------------------------------------------------------


def minilm_batch(embedder: Any) -> list[list[int]]:
    """64 sequences of 128 tokens: [CLS], 126 consecutive tokens of the perplexity text, [SEP]."""
    text = (ROOT / "python" / "cellm" / "data" / "perplexity.txt").read_text(encoding="utf-8")
    raw = embedder._model.tokenizer.raw
    body = raw.encode(text, add_special_tokens=False).ids
    cls, sep = raw.token_to_id("[CLS]"), raw.token_to_id("[SEP]")
    step = (len(body) - (SEQ - 2)) // BATCH
    return [[cls] + body[i * step : i * step + SEQ - 2] + [sep] for i in range(BATCH)]


def bert_matmul_gflop(config: dict[str, Any], tokens: int) -> float:
    h, inter = config["hidden_size"], config["intermediate_size"]
    per_token = 2 * (4 * h * h + 2 * h * inter) + 4 * SEQ * h  # projections, MLP, QK^T and PV
    return config["num_hidden_layers"] * per_token * tokens / 1e9


def minilm_onnx(weights: dict[str, Any], config: dict[str, Any]) -> bytes:
    """BERT's encoder as an ONNX graph (opset 20) for `input_ids` of [batch, 128]: the last
    hidden states [batch, 128, hidden]. Token type 0, no padding (every text is 128 tokens)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    h, heads, eps = config["hidden_size"], config["num_attention_heads"], config["layer_norm_eps"]
    hd = h // heads
    inits: list[Any] = []
    nodes: list[Any] = []
    count = iter(range(1 << 30))

    def const(arr: Any) -> str:
        name = f"c{next(count)}"
        inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def op(kind: str, *inputs: str, **attrs: Any) -> str:
        out = f"t{next(count)}"
        nodes.append(helper.make_node(kind, list(inputs), [out], **attrs))
        return out

    def w(name: str) -> Any:
        return np.asarray(weights[name], dtype=np.float32)

    def linear(name: str, x: str) -> str:
        return op("Add", op("MatMul", x, const(w(f"{name}.weight").T)), const(w(f"{name}.bias")))

    def norm(name: str, x: str) -> str:
        return op(
            "LayerNormalization",
            x,
            const(w(f"{name}.weight")),
            const(w(f"{name}.bias")),
            axis=-1,
            epsilon=eps,
        )

    e = "embeddings"
    positions = (
        w(f"{e}.position_embeddings.weight")[:SEQ] + w(f"{e}.token_type_embeddings.weight")[0]
    )
    x = op("Gather", const(w(f"{e}.word_embeddings.weight")), "input_ids")
    x = norm(f"{e}.LayerNorm", op("Add", x, const(positions)))
    split = const(np.array([0, 0, heads, hd], np.int64))
    merge = const(np.array([0, 0, h], np.int64))
    scale = const(np.array(1 / math.sqrt(hd), np.float32))
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}"
        q, k, v = (
            op("Reshape", linear(f"{p}.attention.self.{m}", x), split)
            for m in ("query", "key", "value")
        )
        q = op("Transpose", q, perm=[0, 2, 1, 3])
        k = op("Transpose", k, perm=[0, 2, 3, 1])
        v = op("Transpose", v, perm=[0, 2, 1, 3])
        probs = op("Softmax", op("Mul", op("MatMul", q, k), scale), axis=-1)
        ctx = op("Reshape", op("Transpose", op("MatMul", probs, v), perm=[0, 2, 1, 3]), merge)
        x = norm(
            f"{p}.attention.output.LayerNorm",
            op("Add", x, linear(f"{p}.attention.output.dense", ctx)),
        )
        mid = op("Gelu", linear(f"{p}.intermediate.dense", x))
        x = norm(f"{p}.output.LayerNorm", op("Add", x, linear(f"{p}.output.dense", mid)))
    nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"]))
    graph = helper.make_graph(
        nodes,
        "minilm",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", SEQ])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", SEQ, h])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9
    return bytes(model.SerializeToString())


def bench_minilm(threads: int, runs: int) -> dict[str, Any]:
    import numpy as np
    from safetensors.numpy import load_file

    from cellm import Embedder
    from cellm.fetch import fetch_gguf

    weights_path = fetch_gguf("all-minilm-l6-v2", progress=False)  # the published checkpoint
    config = json.loads((weights_path.parent / "config.json").read_text())
    embedder = Embedder("all-minilm-l6-v2", threads=threads)
    ids = minilm_batch(embedder)
    result: dict[str, Any] = {"gflop": bert_matmul_gflop(config, BATCH * SEQ)}
    ours = embedder.token_states(ids)
    fns: dict[str, Callable[[], Any]] = {"cellm": lambda: embedder.token_states(ids)}
    try:
        import onnxruntime as ort
    except ImportError:
        print("onnxruntime not installed: its row is skipped", file=sys.stderr)
    else:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        session = ort.InferenceSession(
            minilm_onnx(load_file(str(weights_path)), config),
            options,
            providers=["CPUExecutionProvider"],
        )
        feed = {"input_ids": np.array(ids, dtype=np.int64)}
        theirs = session.run(None, feed)[0]
        result["ort_max_diff"] = float(np.abs(np.stack(ours) - theirs).max())
        result["ort_version"] = ort.__version__
        fns["onnxruntime"] = lambda: session.run(None, feed)
    # Alternate the engines run by run, so that load from elsewhere falls on both.
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(runs):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t)
    result["seconds"] = {k: statistics.median(v) for k, v in samples.items()}
    return result


# --- privacy-filter of the real shape -------------------------------------------------------


def privacy_filter_checkpoint(out: Path) -> Path:
    """DIR/privacy-filter-real-shape/ (kept if it exists): the fixture's config and tokenizer
    with the real model's sizes, random f16 weights."""
    import shutil

    sys.path.insert(0, str(ROOT / "benches"))
    from random_vlm import write_safetensors

    d = out / "privacy-filter-real-shape"
    if (d / "model.safetensors").exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    fixture = ROOT / "tests" / "fixtures" / "mm" / "privacy_filter"
    config = json.loads((fixture / "config.json").read_text())
    config.update(PRIVACY_FILTER)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fixture / name, d / name)
    (d / "config.json").write_text(json.dumps(config, indent=1))
    c = PRIVACY_FILTER
    h, hd, inter, e = (
        c["hidden_size"],
        c["head_dim"],
        c["intermediate_size"],
        c["num_local_experts"],
    )
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    labels = len(config["id2label"])
    tensors: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [c["vocab_size"], h])]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors += [
            (f"{p}.input_layernorm.weight", [h]),
            (f"{p}.post_attention_layernorm.weight", [h]),
            (f"{p}.self_attn.q_proj.weight", [q, h]),
            (f"{p}.self_attn.q_proj.bias", [q]),
            (f"{p}.self_attn.k_proj.weight", [kv, h]),
            (f"{p}.self_attn.k_proj.bias", [kv]),
            (f"{p}.self_attn.v_proj.weight", [kv, h]),
            (f"{p}.self_attn.v_proj.bias", [kv]),
            (f"{p}.self_attn.o_proj.weight", [h, q]),
            (f"{p}.self_attn.o_proj.bias", [h]),
            (f"{p}.self_attn.sinks", [c["num_attention_heads"]]),
            (f"{p}.mlp.router.weight", [e, h]),
            (f"{p}.mlp.router.bias", [e]),
            (f"{p}.mlp.experts.gate_up_proj", [e, h, 2 * inter]),
            (f"{p}.mlp.experts.gate_up_proj_bias", [e, 2 * inter]),
            (f"{p}.mlp.experts.down_proj", [e, inter, h]),
            (f"{p}.mlp.experts.down_proj_bias", [e, h]),
        ]
    tensors += [("model.norm.weight", [h]), ("score.weight", [labels, h]), ("score.bias", [labels])]
    write_safetensors(d / "model.safetensors.partial", iter(tensors), seed=640)
    (d / "model.safetensors.partial").rename(d / "model.safetensors")
    return d


def privacy_filter_gflop(tokens: int) -> float:
    """Active matmul work: attention projections, the router, 4 experts, QK^T and PV."""
    c = PRIVACY_FILTER
    h, hd, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    window = min(SEQ, 2 * c["sliding_window"] + 1)
    per_token = 2 * (2 * h * q + 2 * h * kv + h * c["num_local_experts"])
    per_token += c["num_experts_per_tok"] * 2 * (h * 2 * inter + inter * h) + 4 * window * q
    return c["num_hidden_layers"] * per_token * tokens / 1e9


def bench_privacy_filter(models: Path, threads: int, runs: int, dtype: str) -> dict[str, Any]:
    import numpy as np

    from cellm import PrivacyFilter
    from cellm.convert import convert_hf

    d = privacy_filter_checkpoint(models)
    path = d / f"privacy-filter-{dtype}.cellm"
    if not path.exists():
        convert_hf(d, path, dtype, progress=False)
    pf = PrivacyFilter(path, threads=threads)
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, PRIVACY_FILTER["vocab_size"], SEQ).tolist() for _ in range(BATCH)]
    seconds = timed(lambda: pf._model.forward(ids), runs)
    return {
        "gflop": privacy_filter_gflop(BATCH * SEQ),
        "seconds": {"cellm": seconds},
        "file_mib": path.stat().st_size / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--models", type=Path, default=ROOT / "target" / "bench-models")
    p.add_argument("--privacy-dtype", default="f16", help="the random checkpoint's dtype")
    p.add_argument("--skip", default="", help="minilm and/or privacy-filter")
    p.add_argument("--out", type=Path, default=None, help="append the table to this file")
    args = p.parse_args()
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)  # before numpy loads its BLAS

    peak_before = fma_peak(args.threads)
    blas = blas_gemm(args.threads)
    results = {}
    if "minilm" not in args.skip:
        results["all-MiniLM-L6-v2 (f32)"] = bench_minilm(args.threads, args.runs)
    if "privacy-filter" not in args.skip:
        name = f"privacy-filter real shape ({args.privacy_dtype}, random)"
        results[name] = bench_privacy_filter(
            args.models, args.threads, args.runs, args.privacy_dtype
        )
    peak_after = fma_peak(args.threads)
    peak = max(peak_before, peak_after)

    lines = [
        f"Float FMA peak ({args.threads} threads, `cellm._core.fma_peak`): {peak_before:.1f} "
        f"GFLOP/s before, {peak_after:.1f} after; the table divides by the larger. numpy's "
        f"BLAS reaches {blas:.1f} GFLOP/s on a 4096^3 f32 GEMM on the same threads.",
        "",
        "| model | engine | batch | tokens/s | matmul GFLOP/s | % of FMA peak |",
        "|---|---|---|---:|---:|---:|",
    ]
    notes: list[str] = []
    for name, r in results.items():
        for engine, seconds in r["seconds"].items():
            tps = BATCH * SEQ / seconds
            gflops = r["gflop"] / seconds
            lines.append(
                f"| {name} | {engine} | {BATCH}x{SEQ} | {tps:,.0f} | {gflops:.1f} | "
                f"{100 * gflops / peak:.0f}% |"
            )
        if "ort_max_diff" in r:
            notes.append(
                f"ONNX Runtime {r['ort_version']} on the same MiniLM weights: hidden states within "
                f"{r['ort_max_diff']:.1e} of cellm's."
            )
    text = "\n".join(lines + [""] + notes)
    print(text)
    if args.out is not None:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
