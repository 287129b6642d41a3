"""Sampling: HF generate() semantics for repetition penalty, greedy, temperature, top-k/p, min-p."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from cellm.errors import InvalidArgument
from cellm.sampling import (
    SamplingParams,
    _min_p,
    _top_k,
    _top_p,
    apply_repeat_penalty,
    inverse_cdf,
    make_sampler,
)

# Crafted distribution, scattered over ids so that "best id" != "lowest id".
PROBS = {7: 0.5, 2: 0.2, 9: 0.15, 0: 0.1, 4: 0.05}
VOCAB = 12
N_DRAWS = 10_000
# Empirical frequencies must be within 0.02 of the renormalised probabilities: the binomial
# standard deviation at N_DRAWS is <= sqrt(0.25 / 10000) = 0.005, so this is >= 4 sigma.
TOL = 0.02


def crafted_logits() -> np.ndarray:
    x = np.full(VOCAB, -np.inf, dtype=np.float32)
    for i, p in PROBS.items():
        x[i] = math.log(p)
    return x


def frequencies(params: SamplingParams, logits: np.ndarray, n: int = N_DRAWS) -> dict[int, float]:
    sampler = make_sampler(params)
    counts = Counter(sampler(logits, []) for _ in range(n))
    return {i: c / n for i, c in counts.items()}


def assert_distribution(freq: dict[int, float], allowed: list[int]) -> None:
    assert set(freq) <= set(allowed), f"sampled ids outside {allowed}: {sorted(freq)}"
    total = sum(PROBS[i] for i in allowed)
    for i in allowed:
        assert abs(freq.get(i, 0.0) - PROBS[i] / total) < TOL, (i, freq)


def test_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    rng = np.random.default_rng(0)
    sampler = make_sampler(SamplingParams())
    for _ in range(50):
        x = rng.standard_normal(1000).astype(np.float32)
        assert sampler(x, []) == int(np.argmax(x))
    x = np.array([0.0, 3.0, 1.0, 3.0], dtype=np.float32)
    assert sampler(x, []) == 1


def hf_repetition_penalty(logits: list[float], context: list[int], penalty: float) -> list[float]:
    # Straight from RepetitionPenaltyLogitsProcessor: gather, where(score < 0, *p, /p), scatter.
    out = list(logits)
    for i in set(context):
        s = logits[i]
        out[i] = s * penalty if s < 0 else s / penalty
    return out


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_hf_formula(penalty: float) -> None:
    x = np.array([2.0, -1.0, 0.5, -3.0, 0.0, 1.5, -0.25, 4.0], dtype=np.float32)
    ctx = [0, 1, 1, 3, 4, 6, 0]  # repeats count once
    got = apply_repeat_penalty(x, ctx, penalty)
    want = hf_repetition_penalty(x.tolist(), ctx, penalty)
    np.testing.assert_allclose(got, np.array(want, dtype=np.float32), rtol=1e-6)
    assert x.tolist() == [2.0, -1.0, 0.5, -3.0, 0.0, 1.5, -0.25, 4.0]  # input untouched


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    x = np.array([2.0, 1.5, -1.0], dtype=np.float32)
    assert make_sampler(SamplingParams(repeat_penalty=2.0))(x, [0, 0]) == 1
    assert make_sampler(SamplingParams(repeat_penalty=2.0))(x, [2]) == 0
    with pytest.raises(InvalidArgument):
        make_sampler(SamplingParams(repeat_penalty=2.0))(x, [3])


@pytest.mark.parametrize("temperature", [0.1, 1.0, 5.0, 100.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature: float) -> None:
    rng = np.random.default_rng(1)
    sampler = make_sampler(SamplingParams(temperature=temperature, top_k=1, seed=3))
    for _ in range(50):
        x = rng.standard_normal(500).astype(np.float32)
        assert sampler(x, []) == int(np.argmax(x))


def test_top_k_keeps_k_best() -> None:
    freq = frequencies(SamplingParams(temperature=1.0, top_k=3, seed=1), crafted_logits())
    assert_distribution(freq, [7, 2, 9])


@pytest.mark.parametrize(
    ("top_p", "allowed"),
    [(0.01, [7]), (0.6, [7, 2]), (0.8, [7, 2, 9]), (0.9, [7, 2, 9, 0]), (0.99, [7, 2, 9, 0, 4])],
)
def test_top_p_keeps_smallest_set_reaching_top_p(top_p: float, allowed: list[int]) -> None:
    freq = frequencies(SamplingParams(temperature=1.0, top_p=top_p, seed=2), crafted_logits())
    assert_distribution(freq, allowed)


@pytest.mark.parametrize(
    ("min_p", "allowed"),
    [(0.05, [7, 2, 9, 0, 4]), (0.15, [7, 2, 9, 0]), (0.25, [7, 2, 9]), (0.35, [7, 2]), (0.9, [7])],
)
def test_min_p_drops_tokens_below_min_p_times_max(min_p: float, allowed: list[int]) -> None:
    freq = frequencies(SamplingParams(temperature=1.0, min_p=min_p, seed=3), crafted_logits())
    assert_distribution(freq, allowed)


def test_temperature_sharpens_before_filtering() -> None:
    # At T=0.5 the probabilities become p^2 renormalised: {7: .25, 2: .04, ...} / sum.
    x = crafted_logits()
    freq = frequencies(SamplingParams(temperature=0.5, seed=4), x)
    z = sum(p**2 for p in PROBS.values())
    for i, p in PROBS.items():
        assert abs(freq.get(i, 0.0) - p**2 / z) < TOL
    # top_p after temperature: 7 alone now holds .25/.335 = 0.746 of the mass.
    freq = frequencies(SamplingParams(temperature=0.5, top_p=0.7, seed=4), x, n=2000)
    assert set(freq) == {7}


def hf_top_p_kept(z: np.ndarray, top_p: float) -> set[int]:
    # TopPLogitsWarper: ascending sort, drop while cumulative prob <= 1 - top_p, keep the last.
    order = np.argsort(z)
    p = np.exp(z[order] - z.max())
    cum = np.cumsum(p / p.sum())
    remove = cum <= 1 - top_p
    remove[-1] = False
    return set(order[~remove].tolist())


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.95, 0.999])
def test_top_p_matches_hf_on_large_flat_vocab(top_p: float) -> None:
    # A flat distribution needs far more than the first argpartition guess of 64 tokens.
    z = np.random.default_rng(5).standard_normal(20_000) * 0.3
    ids, kept = _top_p(np.arange(z.size), z, top_p)
    assert set(ids.tolist()) == hf_top_p_kept(z, top_p)
    np.testing.assert_array_equal(z[ids], kept)


def peaked_vocab(heads: int, spread: float) -> np.ndarray:
    # A language model's shape: `heads` tokens well above a 49k-token noise floor.
    rng = np.random.default_rng(heads)
    z = rng.standard_normal(49_152).astype(np.float32)
    z[rng.choice(z.size, heads, replace=False)] += rng.uniform(spread, spread + 6.0, heads)
    return z


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99, 0.9999])
@pytest.mark.parametrize(("heads", "spread"), [(5, 10.0), (40, 6.0), (200, 3.0)])
def test_top_p_matches_hf_on_peaked_vocabularies(heads: int, spread: float, top_p: float) -> None:
    # The candidates within _TOP_P_SPAN of the best logit hold top_p (5 heads 10 nats up), or
    # fall short and widen (0.9999 of the mass; 200 heads only 3-9 nats up). Against HF's rule
    # in float64: a token is kept iff the mass above it is < top_p. The probabilities are
    # float32 (relative 6e-8 each, as HF's), so only tokens whose mass above lies within 1e-6
    # of top_p may land on either side. (Float32 sums of the tail, which the sampler took
    # before, kept 40,312 tokens where this rule keeps 43,217.)
    z = peaked_vocab(heads, spread)
    ids, kept = _top_p(np.arange(z.size), z, top_p)
    order = np.argsort(-z.astype(np.float64), kind="stable")
    p = np.exp(z[order].astype(np.float64) - float(z.max()))
    above = np.concatenate([[0.0], np.cumsum(p / p.sum())[:-1]])
    want = set(order[above < top_p].tolist())
    unclear = set(order[np.abs(above - top_p) < 1e-6].tolist())
    assert set(ids.tolist()) ^ want <= unclear
    np.testing.assert_array_equal(z[ids], kept)


def test_top_k_keeps_ties_like_hf_and_min_p_matches_hf() -> None:
    z = np.array([1.0, 3.0, 2.0, 2.0, 0.0])
    ids, _ = _top_k(np.arange(5), z, 2)
    assert sorted(ids.tolist()) == [1, 2, 3]  # scores < 2nd largest are removed, ties kept
    p = np.exp(z) / np.exp(z).sum()
    ids, _ = _min_p(np.arange(5), z, 0.2)
    assert set(ids.tolist()) == set(np.flatnonzero(p >= 0.2 * p.max()).tolist())


def test_same_seed_same_sequence_different_seed_different() -> None:
    x = np.random.default_rng(6).standard_normal(1000).astype(np.float32)

    def run(seed: int) -> list[int]:
        s = make_sampler(SamplingParams(temperature=1.0, top_p=0.95, top_k=500, seed=seed))
        return [s(x, []) for _ in range(40)]

    assert run(42) == run(42)
    assert run(42) != run(43)
    assert len(set(run(42))) > 1  # one generator per request: draws advance it


@pytest.mark.parametrize("size", [1, 300, 4096, 4097, 5000, 49_152, 49_153])
def test_inverse_cdf_matches_the_exact_cumulative_search(size: int) -> None:
    """Whole-number weights sum exactly in float32, so the draw must be exactly the float64
    search's: the first index whose running total exceeds r * total. Runs of zeros (whole
    blocks of them, and a zero tail) must never be drawn; r runs up to just under 1."""
    rng = np.random.default_rng(size)
    w = rng.integers(0, 4, size).astype(np.float32)
    w[size // 3 : size // 3 + 600] = 0.0  # more than a block of zeros
    w[-min(size - 1, 300) :] = 0.0  # a zero tail
    w[0] = max(w[0], 1.0)
    ends = np.cumsum(w.astype(np.float64))
    for r in [0.0, 1e-9, *rng.random(200), 0.5, 1.0 - 1e-12]:
        u = np.float64(np.float32(r * ends[-1]))
        want = min(int(np.searchsorted(ends, u, "right")), int(np.flatnonzero(w)[-1]))
        got = inverse_cdf(w, r)
        assert got == want, (r, got, want)
        assert w[got] > 0


def test_sampling_a_large_vocabulary_follows_the_distribution() -> None:
    """The blocked draw (vocabularies past 4096) through the sampler: the crafted
    probabilities placed far apart in a 49k vocabulary, at temperature 1."""
    where = {7: 7, 2: 2049, 9: 20_000, 0: 30_001, 4: 49_151}
    x = np.full(49_152, -np.inf, dtype=np.float32)
    for i, p in PROBS.items():
        x[where[i]] = math.log(p)
    freq = frequencies(SamplingParams(temperature=1.0, seed=3), x)
    back = {v: k for k, v in where.items()}
    assert_distribution({back[i]: f for i, f in freq.items()}, list(PROBS))


def test_logits_are_never_modified() -> None:
    x = np.random.default_rng(7).standard_normal(300).astype(np.float32)
    before = x.copy()
    for params in [
        SamplingParams(repeat_penalty=1.5),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repeat_penalty=1.2),
    ]:
        make_sampler(params)(x, list(range(0, 300, 3)))
    np.testing.assert_array_equal(x, before)


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_k": -1},
        {"top_k": 2.5},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_p": float("nan")},
        {"min_p": -0.01},
        {"min_p": 1.0},
        {"repeat_penalty": 0.0},
        {"repeat_penalty": -1.0},
        {"seed": -1},
        {"seed": 1.5},
    ],
)
def test_invalid_params_raise(bad: dict) -> None:
    with pytest.raises(InvalidArgument):
        SamplingParams(**bad).validate()
    with pytest.raises(InvalidArgument):
        make_sampler(SamplingParams(**bad))


def test_bad_logits_raise() -> None:
    s = make_sampler(SamplingParams(temperature=1.0))
    with pytest.raises(InvalidArgument):
        s(np.zeros((2, 3), dtype=np.float32), [])
    with pytest.raises(InvalidArgument):
        s(np.full(4, np.nan, dtype=np.float32), [])
