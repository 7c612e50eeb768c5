"""Uncertainty of benchmark numbers: percentile bootstrap confidence intervals over questions, and paired
bootstrap CIs of a difference between two systems answering the same questions (the pairing removes the
question-difficulty variance, so a small improvement can be told apart from noise).

A percentile bootstrap over a handful of changed questions is anti-conservative (4 better, 0 worse gives a CI
strictly above 0, while the exact one-sided p is 1/16 = 0.0625), so a claim rests on an exact paired test:
:func:`exact_mcnemar` for 0-1 metrics, :func:`sign_flip_test` for continuous ones, and the standard of
:func:`shown` (``ALPHA``, ``MIN_QUESTIONS``); :func:`holm` corrects across a benchmark's claims.

Power, for a claim that is not shown (is the effect absent, or too small for the questions there are?):
:func:`mcnemar_power` is the exact power of the one-sided exact McNemar test, :func:`detectable_difference` the
smallest difference it detects with a given power at a given rate of changed questions, :func:`questions_needed` the
test questions an observed effect would need."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "ALPHA",
    "MIN_QUESTIONS",
    "binomial_tail",
    "bootstrap_ci",
    "exact_mcnemar",
    "detectable_difference",
    "holm",
    "mcnemar_power",
    "paired_difference_ci",
    "questions_needed",
    "paired_test",
    "shown",
    "sign_flip_test",
]


def bootstrap_ci(values: list[float], n: int = 1000, seed: int = 0, level: float = 0.95) -> dict[str, float]:
    """Mean of ``values`` and the percentile bootstrap CI (``n`` resamples of the questions, with replacement)."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan")}
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(n, data.size))].mean(axis=1)
    tail = (1 - level) / 2
    return {
        "mean": float(data.mean()),
        "lo": float(np.quantile(means, tail)),
        "hi": float(np.quantile(means, 1 - tail)),
    }


def paired_difference_ci(
    before: list[float], after: list[float], n: int = 1000, seed: int = 0, level: float = 0.95
) -> dict[str, float]:
    """Mean of ``after - before`` over the same questions and its paired bootstrap CI (questions resampled
    together), plus the share of resamples where the difference is <= 0 (a one-sided bootstrap p-value)."""
    a, b = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    if a.shape != b.shape:
        raise ValueError("paired_difference_ci needs per-question values of the same questions")
    out = bootstrap_ci(list(b - a), n=n, seed=seed, level=level)
    rng = np.random.default_rng(seed)
    diffs = (b - a)[rng.integers(0, a.size, size=(n, a.size))].mean(axis=1) if a.size else np.array([0.0])
    out["p_not_better"] = float((diffs <= 0).mean())
    return out


# -- exact paired tests and the claim standard ----------------------------------------------------------------------

ALPHA = 0.05
"""A claim "after > before" is *shown* when its one-sided exact p-value is below ``ALPHA`` on at least
``MIN_QUESTIONS`` test questions (:func:`shown`)."""

MIN_QUESTIONS = 100
"""The fewest test questions a shown claim rests on (fewer: the test is reported, the claim never shown)."""

EXACT_LIMIT = 20
"""``sign_flip_test`` enumerates all ``2**m`` sign flips of the ``m`` non-zero differences up to this ``m``."""


def _pair(before: Sequence[float], after: Sequence[float], what: str) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"{what} needs per-question values of the same questions")
    return a, b


def binomial_tail(k: int, n: int) -> float:
    """``P(X >= k)`` for ``X ~ Binomial(n, 1/2)``, exactly (integer arithmetic)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n


def exact_mcnemar(before: Sequence[float], after: Sequence[float]) -> dict[str, float | int]:
    """One-sided exact McNemar test of "after > before" for a 0-1 metric on the same questions: only the
    discordant questions count (``better``: 0 -> 1, ``worse``: 1 -> 0), and under no difference each is better with
    probability 1/2, so ``p = P(X >= better)``, ``X ~ Binomial(better + worse, 1/2)``. Returns ``better``,
    ``worse``, ``n`` (questions), ``discordant`` and ``p`` (1.0 when no question changed)."""
    a, b = _pair(before, after, "exact_mcnemar")
    if not np.isin(a, (0.0, 1.0)).all() or not np.isin(b, (0.0, 1.0)).all():
        raise ValueError("exact_mcnemar is for 0-1 metrics; use sign_flip_test for continuous ones")
    better, worse = int(((b == 1) & (a == 0)).sum()), int(((b == 0) & (a == 1)).sum())
    return {
        "better": better,
        "worse": worse,
        "n": int(a.size),
        "discordant": better + worse,
        "p": binomial_tail(better, better + worse),
    }


def sign_flip_test(
    before: Sequence[float], after: Sequence[float], n_resamples: int = 100_000, seed: int = 0
) -> dict[str, float | int]:
    """One-sided paired sign-flip permutation test of "after > before" for a continuous metric: under no
    difference each question's ``after - before`` is as likely negated, so ``p`` is the share of sign assignments
    whose sum is at least the observed one. Exact (all ``2**m`` flips of the ``m`` non-zero differences) when
    ``m <= EXACT_LIMIT``, else ``n_resamples`` random flips with ``p = (1 + hits) / (1 + n_resamples)``. On a 0-1
    metric the exact version equals :func:`exact_mcnemar`. Returns ``better``, ``worse``, ``n``, ``discordant``,
    ``p`` and ``exact``."""
    a, b = _pair(before, after, "sign_flip_test")
    diff = b - a
    nonzero = diff[diff != 0]
    m = int(nonzero.size)
    observed = float(nonzero.sum())
    tolerance = 1e-12 * max(1.0, float(np.abs(nonzero).sum()))
    if m == 0:
        p, exact = 1.0, True
    elif m <= EXACT_LIMIT:
        signs = ((np.arange(2**m)[:, None] >> np.arange(m)) & 1) * 2 - 1
        sums = signs @ np.abs(nonzero)
        p, exact = float((sums >= observed - tolerance).mean()), True
    else:
        rng = np.random.default_rng(seed)
        signs = rng.integers(0, 2, size=(n_resamples, m)) * 2 - 1
        sums = signs @ np.abs(nonzero)
        p, exact = float((1 + (sums >= observed - tolerance).sum()) / (1 + n_resamples)), False
    return {
        "better": int((diff > 0).sum()),
        "worse": int((diff < 0).sum()),
        "n": int(a.size),
        "discordant": m,
        "p": p,
        "exact": exact,
    }


def paired_test(before: Sequence[float], after: Sequence[float], seed: int = 0) -> dict[str, float | int]:
    """:func:`exact_mcnemar` when both sides are 0-1 values, else :func:`sign_flip_test`; ``test`` names it."""
    a, b = _pair(before, after, "paired_test")
    if np.isin(a, (0.0, 1.0)).all() and np.isin(b, (0.0, 1.0)).all():
        return {**exact_mcnemar(a, b), "test": "exact McNemar"}
    return {**sign_flip_test(a, b, seed=seed), "test": "sign-flip"}


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error control across a benchmark's claims), in the input's
    order: the i-th smallest of ``m`` p-values is multiplied by ``m - i`` (0-based), made non-decreasing, capped
    at 1."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted = [1.0] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def shown(p: float, n: int) -> bool:
    """The claim standard: one-sided exact ``p < ALPHA`` on ``n >= MIN_QUESTIONS`` test questions."""
    return p < ALPHA and n >= MIN_QUESTIONS


_LOG_FACTORIALS = np.zeros(1)


def _log_factorials(n: int) -> np.ndarray:
    """``log(k!)`` for ``k = 0..n`` (grown and kept between calls)."""
    global _LOG_FACTORIALS
    if _LOG_FACTORIALS.size <= n:
        size = max(n + 1, 2 * _LOG_FACTORIALS.size)
        _LOG_FACTORIALS = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, size)))])
    return _LOG_FACTORIALS[: n + 1]


def _binomial_pmf(n: int, p: float) -> np.ndarray:
    """``P(X = k)`` for ``k = 0..n``, ``X ~ Binomial(n, p)``, computed in log space (no overflow for large ``n``)."""
    if p <= 0.0 or p >= 1.0:
        pmf = np.zeros(n + 1)
        pmf[0 if p <= 0.0 else n] = 1.0
        return pmf
    k = np.arange(n + 1)
    logs = _log_factorials(n)
    return np.exp(logs[n] - logs - logs[::-1] + k * math.log(p) + (n - k) * math.log1p(-p))


def _upper_tails(pmf: np.ndarray) -> np.ndarray:
    """``P(X >= k)`` for ``k = 0..n`` from a pmf."""
    return np.cumsum(pmf[::-1])[::-1]


@functools.lru_cache(maxsize=100_000)
def _critical_better(discordant: int, alpha: float) -> int:
    """The fewest ``better`` of ``discordant`` changed questions that the one-sided exact McNemar test rejects at
    ``alpha`` (``discordant + 1`` when none does)."""
    rejecting = np.nonzero(_upper_tails(_binomial_pmf(discordant, 0.5)) < alpha)[0]
    return int(rejecting[0]) if rejecting.size else discordant + 1


def mcnemar_power(n: int, p_better: float, p_worse: float, alpha: float = ALPHA) -> float:
    """Exact power of the one-sided exact McNemar test (:func:`exact_mcnemar`, ``p < alpha``) on ``n`` questions
    when each question independently turns better with probability ``p_better`` and worse with ``p_worse``: the
    number of changed questions ``D ~ Binomial(n, p_better + p_worse)`` and, given ``D = d``, the better ones
    ``~ Binomial(d, p_better / (p_better + p_worse))``; summed over every ``d`` of non-negligible probability."""
    if n < 0 or p_better < 0 or p_worse < 0 or p_better + p_worse > 1:
        raise ValueError("need n >= 0, p_better >= 0, p_worse >= 0 and p_better + p_worse <= 1")
    changed = p_better + p_worse
    if n == 0 or changed == 0:
        return 0.0
    share = p_better / changed
    power = 0.0
    for d, weight in enumerate(_binomial_pmf(n, changed)):
        if weight < 1e-13 or d == 0:
            continue
        k = _critical_better(d, alpha)
        if k <= d:
            power += weight * float(_binomial_pmf(d, share)[k:].sum())
    return min(power, 1.0)


def detectable_difference(n: int, changed: float, power: float = 0.8, alpha: float = ALPHA) -> float | None:
    """The smallest difference ``p_better - p_worse`` (a share of the questions) that :func:`mcnemar_power` detects
    with probability ``power`` on ``n`` questions of which a share ``changed`` (= ``p_better + p_worse``) change;
    None when even all changed questions turning better is not enough. Resolution 1e-4."""
    if not 0 < changed <= 1:
        raise ValueError("changed must be in (0, 1]")
    if mcnemar_power(n, changed, 0.0, alpha) < power:
        return None
    low, high = 0.0, changed
    while high - low > 1e-4:
        mid = (low + high) / 2
        if mcnemar_power(n, (changed + mid) / 2, (changed - mid) / 2, alpha) >= power:
            high = mid
        else:
            low = mid
    return high


def questions_needed(
    p_better: float, p_worse: float, power: float = 0.8, alpha: float = ALPHA, limit: int = 100_000
) -> int | None:
    """The fewest test questions on which :func:`mcnemar_power` reaches ``power`` for these rates (the rates a run
    observed, ``better / n`` and ``worse / n``); None when ``p_better <= p_worse`` or beyond ``limit``. The power
    is not monotone in ``n`` (the exact test's discreteness), so the answer is the first ``n`` from which it stays
    at or above ``power`` over the next 5% of sizes."""
    if p_better <= p_worse:
        return None
    low, high = 1, 1
    while mcnemar_power(high, p_better, p_worse, alpha) < power:
        if high >= limit:
            return None
        low, high = high, min(2 * high, limit)
    while low < high:  # the first n with power >= target (bisection on a nearly monotone curve)
        mid = (low + high) // 2
        if mcnemar_power(mid, p_better, p_worse, alpha) >= power:
            high = mid
        else:
            low = mid + 1
    n = low
    while any(mcnemar_power(m, p_better, p_worse, alpha) < power for m in range(n + 1, n + 1 + max(1, n // 20))):
        n += 1
    return n
