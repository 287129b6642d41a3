"""Speech to text speed: cellm against faster-whisper on whisper-base (the registry's
CTranslate2 files; cellm converts them: f16 kept, f32, int8 rows or q8_0), on a 29-second espeak-ng
clip (it fits one 30-second window; tests/speech_clips.py), same threads.

    python benches/whisper_bench.py [--threads 2] [--runs 3] [--out docs/benchmarks.md]

Pairs: cellm f32 and f16 against CTranslate2 `float32`, cellm int8 (rows) and q8_0 (blocks of
32) against CTranslate2 `int8`. Each measurement is a fresh process (`--worker`): load the
model, transcribe the clip's first 5 s untimed (warm-up), then transcribe the whole clip
(timestamps on, greedy, beam 1, language detected, VAD off) timed. The two engines of a pair
run back to back, in alternating order from run to run; a cell is the median over runs, and a
ratio the median of the runs' own ratios. Real-time factor = seconds / audio seconds; peak
memory = the worker's peak RSS (VmHWM), the model included; CPU time (process_time) is
reported beside wall time, since on a shared machine it is the steadier of the two."""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from speech_clips import BENCH_CLIP, make_clip  # noqa: E402

# cellm's int8 rows run batches (the encoder, prompts) as a blocked int8 GEMM (i8_gemm.rs,
# where the CPU has AVX-512 VNNI) and decode steps with integer row kernels; q8_0 (8-bit
# blocks of 32, 8 rows interleaved) with its group kernels: both are int8 weights times int8
# activations, as CTranslate2's int8 is.
PAIRS = [("f32", "float32"), ("f16", "float32"), ("int8", "int8"), ("q8_0", "int8")]


def worker(engine: str, model: str, precision: str, clip: str, threads: int) -> dict:
    import numpy as np
    import soundfile as sf

    audio, rate = sf.read(clip, dtype="float32")
    if rate != 16000:
        import soxr

        audio = soxr.resample(audio, rate, 16000).astype(np.float32)
    warm = audio[: 5 * 16000]
    t0 = time.perf_counter()
    if engine == "cellm":
        import cellm

        w = cellm.Whisper(model, threads=threads)
        load = time.perf_counter() - t0
        w.transcribe(warm, timestamps=True)
        t1, c1 = time.perf_counter(), time.process_time()
        text = w.transcribe(audio, timestamps=True).text
    else:
        from faster_whisper import WhisperModel

        m = WhisperModel(model, device="cpu", compute_type=precision, cpu_threads=threads)
        load = time.perf_counter() - t0

        def run(x: np.ndarray) -> str:
            segments, _ = m.transcribe(
                x, beam_size=1, temperature=0.0, vad_filter=False, condition_on_previous_text=True
            )
            return "".join(s.text for s in segments).strip()

        run(warm)
        t1, c1 = time.perf_counter(), time.process_time()
        text = run(audio)
    seconds = time.perf_counter() - t1
    cpu = time.process_time() - c1
    return {
        "seconds": seconds,
        "cpu_s": cpu,
        "rtf": seconds / (len(audio) / 16000),
        "peak_mib": peak_mib(),
        "load_s": load,
        "text": text,
    }


def peak_mib() -> float:
    """This process's peak RSS in MiB. /proc's VmHWM is the current image's own (ru_maxrss
    would also count the parent's peak before exec, the converter's included)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(engine: str, model: str, precision: str, clip: Path, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", engine, model, precision, str(clip)]
    r = subprocess.run(
        [*cmd, "--threads", str(threads)], capture_output=True, text=True, timeout=1200
    )
    if r.returncode != 0:
        raise SystemExit(f"{engine} {precision} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def models() -> tuple[dict[str, str], str]:
    """cellm's .cellm per precision, and the CTranslate2 directory."""
    from cellm.convert import convert_ct2_whisper
    from cellm.fetch import fetch, fetch_gguf

    ct2 = fetch_gguf("whisper-base").parent
    f16 = fetch("whisper-base")
    out = {"f16": str(f16)}
    variants = {"f32": {"dtype": "f32"}, "int8": {"quantize": "int8"}, "q8_0": {"quantize": "q8_0"}}
    for precision, kw in variants.items():
        # Beside the repository's other bench models, not in the registry's cache folder.
        path = ROOT / "target" / "bench-models" / f"whisper-base-{precision}.cellm"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            convert_ct2_whisper(ct2, path, progress=False, **kw)
        out[precision] = str(path)
    return out, str(ct2)


def table(rows: list[dict], threads: int, runs: int, clip_s: float, load: str) -> str:
    lines = [
        f"Clip: {clip_s:.1f} s of espeak-ng speech (fits one window), {threads} thread(s), {runs} "
        f"alternating runs, medians; load average during the runs {load}.",
        "",
        "| cellm | faster-whisper | cellm RTF | fw RTF | speedup (fw s / cellm s) | "
        "CPU-time speedup | cellm peak MiB | fw peak MiB | same text |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['ours']} | {r['theirs']} | {r['rtf_c']:.3f} | {r['rtf_f']:.3f} | "
            f"{r['speedup']:.2f}x | {r['cpu_speedup']:.2f}x | "
            f"{r['mem_c']:.0f} | {r['mem_f']:.0f} | {r['same']} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", nargs=4, metavar=("ENGINE", "MODEL", "PRECISION", "CLIP"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--only", help="cellm precisions to run (comma-separated; default all)")
    p.add_argument("--clips", default=str(ROOT / "target" / "speech-clips"))
    p.add_argument("--out", help="rewrite this thread count's table between its markers")
    args = p.parse_args()
    if args.worker:
        engine, model, precision, clip = args.worker
        print(json.dumps(worker(engine, model, precision, clip, args.threads)))
        return
    name, text, wpm = BENCH_CLIP
    clip = make_clip(Path(args.clips), name, text, wpm)
    import soundfile as sf

    clip_s = sf.info(str(clip)).duration
    ours, ct2 = models()
    pairs = [p for p in PAIRS if not args.only or p[0] in args.only.split(",")]
    results: dict[tuple[str, str], list[tuple[dict, dict]]] = {pair: [] for pair in pairs}
    loads = []
    for run in range(args.runs):
        for i, pair in enumerate(pairs):
            mine, theirs = pair
            order = [("cellm", ours[mine], mine), ("fw", ct2, theirs)]
            if (run + i) % 2:
                order.reverse()
            got = {e: measure(e, m, prec, clip, args.threads) for e, m, prec in order}
            results[pair].append((got["cellm"], got["fw"]))
            c, f = got["cellm"], got["fw"]
            load = os.getloadavg()[0]
            loads.append(load)
            print(
                f"run {run + 1} {mine} vs {theirs}: cellm {c['seconds']:.2f} s "
                f"(cpu {c['cpu_s']:.2f} s, {c['peak_mib']:.0f} MiB), fw {f['seconds']:.2f} s "
                f"(cpu {f['cpu_s']:.2f} s, {f['peak_mib']:.0f} MiB), "
                f"load {load:.1f}",
                flush=True,
            )
    rows = []
    for (mine, theirs), pairs in results.items():
        rows.append(
            {
                "ours": mine,
                "theirs": theirs,
                "rtf_c": statistics.median(c["rtf"] for c, _ in pairs),
                "rtf_f": statistics.median(f["rtf"] for _, f in pairs),
                "speedup": statistics.median(f["seconds"] / c["seconds"] for c, f in pairs),
                "cpu_speedup": statistics.median(f["cpu_s"] / c["cpu_s"] for c, f in pairs),
                "mem_c": statistics.median(c["peak_mib"] for c, _ in pairs),
                "mem_f": statistics.median(f["peak_mib"] for _, f in pairs),
                "same": "yes" if all(c["text"] == f["text"] for c, f in pairs) else "no",
            }
        )
    load = f"{min(loads):.1f}-{max(loads):.1f}"
    out = table(rows, args.threads, args.runs, clip_s, load)
    print(out)
    if args.out:
        doc = Path(args.out).read_text()
        # One table per thread count, between its own markers.
        begin = f"<!-- whisper-bench:{args.threads}:begin -->"
        end = f"<!-- whisper-bench:{args.threads}:end -->"
        block = f"{begin}\n{out}\n{end}"
        pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
        doc = pattern.sub(lambda _: block, doc) if pattern.search(doc) else doc + "\n" + block
        Path(args.out).write_text(doc)


if __name__ == "__main__":
    main()
