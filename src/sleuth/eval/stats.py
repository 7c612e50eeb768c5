"""Uncertainty of benchmark numbers: percentile bootstrap confidence intervals over questions, and paired
bootstrap CIs of a difference between two systems answering the same questions (the pairing removes the
question-difficulty variance, so a small improvement can be told apart from noise).

A percentile bootstrap over a handful of changed questions is anti-conservative (4 better, 0 worse gives a CI
strictly above 0, while the exact one-sided p is 1/16 = 0.0625), so a claim rests on an exact paired test:
:func:`exact_mcnemar` for 0-1 metrics, :func:`sign_flip_test` for continuous ones, and the standard of
:func:`shown` (``ALPHA``, ``MIN_QUESTIONS``); :func:`holm` corrects across a benchmark's claims."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "ALPHA",
    "MIN_QUESTIONS",
    "binomial_tail",
    "bootstrap_ci",
    "exact_mcnemar",
    "holm",
    "paired_difference_ci",
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
