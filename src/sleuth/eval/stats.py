"""Uncertainty of benchmark numbers: percentile bootstrap confidence intervals over questions, and paired
bootstrap CIs of a difference between two systems answering the same questions (the pairing removes the
question-difficulty variance, so a small improvement can be told apart from noise)."""

from __future__ import annotations

import numpy as np

__all__ = ["bootstrap_ci", "paired_difference_ci"]


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
