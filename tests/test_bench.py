"""The benchmark's summary arithmetic (the runs themselves need llama.cpp and real files)."""

from cellm.bench import KEYS, summarize


def _run(scale: float) -> dict[str, float]:
    return {k: scale * (i + 1) for i, k in enumerate(KEYS)} | {"peak_rss_mib": 100.0}


def test_ratios_are_per_run_so_drift_cancels():
    # The machine slows 2x and then 3x between runs; within each run cellm is 1.5x as fast.
    slow = [1.0, 0.5, 0.33]
    samples = {
        "cellm": [_run(1.5 * s) for s in slow],
        "llama.cpp": [_run(s) for s in slow],
    }
    out = summarize(samples, [10.0] * 3, 1)
    for k in KEYS:
        assert abs(out["ratio"][k] - 1.5) < 1e-9
    assert out["median"]["cellm"]["prefill_128"] == 1.5 * 0.5
    assert out["median"]["llama.cpp"]["peak_rss_mib"] == 100.0


def test_ratio_is_the_median_not_the_mean():
    # One run where the peer was disturbed (ratio 10x) does not move the median ratio.
    cellm = [_run(1.0), _run(1.0), _run(1.0)]
    peer = [_run(1.0), _run(0.1), _run(0.8)]
    out = summarize({"cellm": cellm, "llama.cpp": peer}, [10.0] * 3, 1)
    assert abs(out["ratio"]["decode_64@128"] - 1.25) < 1e-9


def test_roof_shares_use_each_runs_own_bandwidth():
    # The machine's bandwidth halves between runs and both engines slow with it; each run's
    # share of its own roof stays the same, where the first probe's roof would halve it.
    step_bytes = 10**8  # 100 MB a decode step: 20 GB/s is a roof of 200 tok/s
    bandwidths = [20.0, 10.0, 10.0]
    samples = {
        "cellm": [_run(160.0 * bw / 20 / 3) for bw in bandwidths],  # decode_64@128 is 3x
        "llama.cpp": [_run(100.0 * bw / 20 / 3) for bw in bandwidths],
    }
    out = summarize(samples, bandwidths, step_bytes)
    assert abs(out["share"]["cellm"] - 0.8) < 1e-9
    assert abs(out["share"]["llama.cpp"] - 0.5) < 1e-9
    assert out["bandwidth"] == 10.0 and abs(out["roof"] - 100.0) < 1e-9
