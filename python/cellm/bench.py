"""`python -m cellm.bench`: cellm and llama.cpp side by side on the same GGUF files, the same
thread count, alternating runs, each in a fresh process (so peak RSS is per engine).

Per run and engine, after an untimed warm-up: prefill tok/s for 128 and 512 tokens, decode
tok/s for 64 tokens after a 128-token prompt and 128 tokens after 512; medians over the runs,
and ratios as the median of the runs' ratios. The roofline is this machine's read bandwidth,
probed in every run next to its two workers, divided by the bytes a decode step must read
(weights plus the KV cache at that context).
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from cellm.cli import Parser, bounded, run
from cellm.errors import CellmError, InvalidArgument
from cellm.llm import BACKENDS

ENGINES = ("cellm", "llama.cpp")
SCENARIOS = ((128, 64), (512, 128))  # (prompt tokens, decoded tokens)
WARMUP_TOKENS = 32
KEYS = ("prefill_128", "prefill_512", "decode_64@128", "decode_128@512")
# The bandwidth probe of each run: larger than any cache, a second or two.
PROBE_MIB, PROBE_PASSES = 1024, 3


def _text_ids(n: int) -> list[int]:
    """Deterministic in-vocabulary ids: the benchmark times arithmetic, not language."""
    return [(i * 7919 + 13) % 20000 + 100 for i in range(n)]


def _worker(engine: str, model: str, threads: int, backend: str = "cpu") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if engine == "cellm":
        from cellm import LLM

        eng = LLM(model, threads=threads, context_length=1024, backend=backend)._engine

        def prefill(ids: list[int]) -> Any:
            s = eng.create_session()
            eng.step([(s, ids)])
            return s

        def decode(s: Any, ids: list[int]) -> None:
            for t in ids:
                eng.step([(s, [t])])

        def done(s: Any) -> None:
            eng.free_session(s)
    else:
        from llama_cpp import Llama

        m = Llama(model_path=model, n_ctx=1024, n_batch=512, n_threads=threads, verbose=False)

        def prefill(ids: list[int]) -> Any:
            m.reset()
            m.eval(ids)

        def decode(s: Any, ids: list[int]) -> None:
            for t in ids:
                m.eval([t])

        def done(s: Any) -> None:
            pass

    # Untimed warm-up, as llama-bench runs one: the first pass faults the weights in (cellm
    # maps them lazily, llama.cpp populates its map at load) and sizes the work buffers, which
    # would otherwise land on whichever scenario runs first.
    warm = _text_ids(WARMUP_TOKENS + 2)
    s = prefill(warm[:WARMUP_TOKENS])
    decode(s, warm[WARMUP_TOKENS:])
    done(s)
    for prompt, gen in SCENARIOS:
        ids = _text_ids(prompt + gen)
        t0 = time.perf_counter()
        s = prefill(ids[:prompt])
        t1 = time.perf_counter()
        decode(s, ids[prompt:])
        t2 = time.perf_counter()
        done(s)
        out[f"prefill_{prompt}"] = prompt / (t1 - t0)
        out[f"decode_{gen}@{prompt}"] = gen / (t2 - t1)
    out["peak_rss_mib"] = _peak_rss_mib()
    return out


def _peak_rss_mib() -> float:
    """This process's peak RSS. VmHWM starts afresh at exec, unlike ru_maxrss, which Linux
    carries over from the parent."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _run_worker(engine: str, model: Path, threads: int, backend: str = "cpu") -> dict[str, Any]:
    cmd = [sys.executable, "-m", "cellm.bench", "--worker", engine, str(model), str(threads)]
    cmd.append(backend)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        # The worker's last line names what failed (an exception, or llama_cpp missing).
        last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise WorkerFailed(f"{engine} on {model.name} failed: {last}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


class WorkerFailed(CellmError):
    """A benchmark worker process exited with an error."""


def decode_bytes(cellm_path: Path, context: int) -> int:
    """Bytes one decode step reads at `context` cached tokens: every weight matrix (the
    embedding only as the tied lm_head) plus the f16 KV cache."""
    from cellm.convert import read_header

    h = read_header(cellm_path)
    m = h["model"]
    weights: int = sum(
        t["nbytes"]
        for t in h["tensors"]
        if len(t["shape"]) == 2
        and (t["name"] != "model.embed_tokens.weight" or m["tie_word_embeddings"])
    )
    kv: int = context * m["num_layers"] * 2 * m["num_kv_heads"] * m["head_dim"] * 2
    return weights + kv


def resolve(name: str) -> tuple[str, Path, Path]:
    """(label, GGUF file, .cellm file) of a registry model, or of a GGUF file by path
    (converted once, as `cellm.LLM` would)."""
    from cellm.fetch import fetch, fetch_gguf
    from cellm.resolve import resolve_model

    if name.endswith(".gguf"):
        return Path(name).stem, Path(name), resolve_model(name)
    return name, fetch_gguf(name), fetch(name)


def bench_model(
    model: tuple[str, Path, Path],
    threads: int,
    runs: int,
    probe: Callable[[], float],
    backend: str = "cpu",
) -> dict[str, Any]:
    """`runs` alternating runs of both engines on one model; `probe()` measures the read
    bandwidth (GB/s) before each run's workers."""
    name, gguf, cellm_file = model
    samples: dict[str, list[dict[str, Any]]] = {e: [] for e in ENGINES}
    bandwidths = []
    for _ in range(runs):  # alternate, so machine noise hits both engines alike
        bandwidths.append(probe())
        samples["cellm"].append(_run_worker("cellm", cellm_file, threads, backend))
        samples["llama.cpp"].append(_run_worker("llama.cpp", gguf, threads))
    return {"name": name, **summarize(samples, bandwidths, decode_bytes(cellm_file, 128))}


def summarize(
    samples: dict[str, list[dict[str, Any]]], bandwidths: list[float], step_bytes: int
) -> dict[str, Any]:
    """Per engine the median of each measure; per measure the median of the runs' ratios
    cellm / llama.cpp. Each run's two workers ran back to back, so a ratio within a run sees
    one state of the machine; drift between runs, which moves both engines, cancels in it
    where a ratio of the two medians would keep it. The roof share is per run too, against
    the bandwidth probed in that run (`bandwidths`, GB/s; `step_bytes` read per decode step
    at 128 tokens)."""
    med = {e: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for e, rs in samples.items()}
    pairs = list(zip(samples["cellm"], samples["llama.cpp"]))
    ratio = {k: statistics.median(c[k] / p[k] for c, p in pairs) for k in KEYS}
    roofs = [bw * 1e9 / step_bytes for bw in bandwidths]
    return {
        "median": med,
        "ratio": ratio,
        "bandwidth": statistics.median(bandwidths),
        "roof": statistics.median(roofs),
        "share": {
            e: statistics.median(r["decode_64@128"] / roof for r, roof in zip(rs, roofs))
            for e, rs in samples.items()
        },
    }


def _table(results: list[dict[str, Any]], threads: int, runs: int) -> str:
    lines = [
        f"{runs} alternating runs, {threads} threads, each after an untimed warm-up; tok/s as "
        "cellm / llama.cpp, medians (median of the runs' ratios). Read bandwidth probed in "
        f"each run ({threads} threads, best of {PROBE_PASSES} passes over {PROBE_MIB} MiB); "
        "the roof share is the median of the runs' own shares.",
        "",
        "| model | "
        + " | ".join(KEYS)
        + " | read GB/s | decode roof @128 (share: cellm / llama.cpp) | peak RSS MiB |",
        "|---|" + "---:|" * (len(KEYS) + 3),
    ]
    for r in results:
        c, p = r["median"]["cellm"], r["median"]["llama.cpp"]
        cells = [f"{c[k]:.1f} / {p[k]:.1f} ({r['ratio'][k]:.2f}x)" for k in KEYS]
        share = f"{r['share']['cellm']:.0%} / {r['share']['llama.cpp']:.0%}"
        rss = f"{c['peak_rss_mib']:.0f} / {p['peak_rss_mib']:.0f}"
        lines.append(
            f"| {r['name']} | "
            + " | ".join(cells)
            + f" | {r['bandwidth']:.1f} | {r['roof']:.0f} ({share}) | {rss} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        print(json.dumps(_worker(argv[1], argv[2], int(argv[3]), *argv[4:5])))
        return 0
    p = Parser(prog="python -m cellm.bench", description=__doc__.splitlines()[0])
    p.add_argument(
        "--models",
        default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct,gemma-3-270m",
        help="registry names or GGUF paths (benches/random_gguf.py writes random-weight ones)",
    )
    p.add_argument("--threads", type=bounded(int, 1), default=2)
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="cpu",
        help="cellm's backend (llama.cpp runs on the CPU; benches/gpu_device.sh times GPU peers)",
    )
    p.add_argument("--runs", type=bounded(int, 1), default=5)
    p.add_argument("--out", help="also write the table to this markdown file")
    args = p.parse_args(argv)

    def body() -> int:
        from cellm import _core

        # Bad names and paths fail here, before any timing (a backend without an adapter
        # fails in the first worker, with its one line).
        if args.out and not Path(args.out).parent.is_dir():
            raise InvalidArgument(f"--out {args.out}: no such directory")
        models = [resolve(n) for n in args.models.split(",")]

        def probe() -> float:
            return _core.read_bandwidth(PROBE_MIB, args.threads, PROBE_PASSES)

        results = [bench_model(m, args.threads, args.runs, probe, args.backend) for m in models]
        table = _table(results, args.threads, args.runs)
        print(table)
        if args.out:
            write_between_markers(Path(args.out), table)
        return 0

    return run(body)


BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def write_between_markers(path: Path, table: str) -> None:
    """Put `table` between the BEGIN/END markers of `path`, keeping the prose around them (a
    file without markers is replaced whole)."""
    block = f"{BEGIN}\n{table}\n{END}"
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
