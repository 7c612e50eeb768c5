"""Bootstrap CIs and the exact paired tests used by the learning benchmarks (sleuth.eval.stats)."""

from __future__ import annotations

import math
from math import comb

import pytest

from sleuth.eval.stats import (
    ALPHA,
    MIN_QUESTIONS,
    binomial_tail,
    bootstrap_ci,
    detectable_difference,
    exact_mcnemar,
    holm,
    mcnemar_power,
    paired_difference_ci,
    paired_test,
    questions_needed,
    shown,
    sign_flip_test,
)


def test_constant_values_have_a_point_interval() -> None:
    assert bootstrap_ci([0.5] * 7) == {"mean": 0.5, "lo": 0.5, "hi": 0.5}


def test_interval_contains_the_mean_and_narrows_with_more_questions() -> None:
    small = bootstrap_ci([1, 0] * 10)
    large = bootstrap_ci([1, 0] * 500)
    assert small["lo"] < 0.5 < small["hi"] and large["mean"] == 0.5
    assert (large["hi"] - large["lo"]) < (small["hi"] - small["lo"])
    # the standard error of a mean of 1000 fair coin flips is 0.0158: the 95% interval is about +-0.031
    assert large["hi"] - large["lo"] == pytest.approx(2 * 1.96 * 0.5 / 1000**0.5, rel=0.15)


def test_paired_difference() -> None:
    before = [0, 0, 1, 1, 0, 1, 0, 0, 1, 0]
    same = paired_difference_ci(before, before)
    assert same["mean"] == 0 and same["p_not_better"] == 1.0
    better = paired_difference_ci(before, [1] * 10)  # every wrong answer fixed, none broken
    assert better["mean"] == pytest.approx(0.6) and better["lo"] > 0 and better["p_not_better"] == 0.0
    with pytest.raises(ValueError):
        paired_difference_ci([1, 0], [1])


def _pairs(better: int, worse: int, same: int) -> tuple[list[int], list[int]]:
    """Per-question 0-1 scores: ``better`` questions 0 -> 1, ``worse`` 1 -> 0, ``same`` unchanged (half 0, half 1)."""
    before = [0] * better + [1] * worse + [0] * (same // 2) + [1] * (same - same // 2)
    after = [1] * better + [0] * worse + [0] * (same // 2) + [1] * (same - same // 2)
    return before, after


def test_exact_mcnemar_counts_discordant_questions_and_gives_the_binomial_tail() -> None:
    # ARENA GRPO > warm start: 4 better, 0 worse of 102: the bootstrap CI cleared 0, the exact p is (1/2)^4
    r = exact_mcnemar(*_pairs(4, 0, 98))
    assert (r["better"], r["worse"], r["n"], r["discordant"]) == (4, 0, 102, 4)
    assert r["p"] == 0.0625 and not shown(r["p"], r["n"])
    # AceSearcher SFT > base: 47 better, 0 worse of 150: p = 2^-47
    r = exact_mcnemar(*_pairs(47, 0, 103))
    assert r["p"] == 2.0**-47 and shown(r["p"], r["n"])
    # mDPO-2 > SFT: 11 better, 31 worse: P(X >= 11 | 42) = 1 - P(X <= 10); the other way P(X >= 31) is small
    r = exact_mcnemar(*_pairs(11, 31, 108))
    assert r["p"] == pytest.approx(sum(comb(42, i) for i in range(11, 43)) / 2**42)
    assert r["p"] > 0.99
    reverse = exact_mcnemar(*reversed(_pairs(11, 31, 108)))
    assert reverse["p"] == pytest.approx(sum(comb(42, i) for i in range(31, 43)) / 2**42)
    assert reverse["p"] == pytest.approx(0.0014, abs=1e-4)
    assert exact_mcnemar([0, 1], [0, 1])["p"] == 1.0  # nothing changed
    with pytest.raises(ValueError, match="0-1"):
        exact_mcnemar([0.5, 1], [1, 1])
    with pytest.raises(ValueError):
        exact_mcnemar([0, 1], [1])


def test_sign_flip_test_is_exact_when_small_and_matches_mcnemar_on_0_1_scores() -> None:
    before, after = _pairs(6, 2, 92)  # s3 after PPO > naive RAG: 6 / 2
    flip, mcnemar = sign_flip_test(before, after), exact_mcnemar(before, after)
    assert flip["exact"] and flip["p"] == pytest.approx(mcnemar["p"]) == pytest.approx(37 / 256)
    # continuous: differences +0.5, +0.25, -0.25: of the 8 sign flips, sums >= +0.5 are (+,+,-), (+,+,+), (+,-,+)
    r = sign_flip_test([0.0, 0.0, 0.5, 0.3], [0.5, 0.25, 0.25, 0.3])
    assert (r["better"], r["worse"], r["n"], r["discordant"]) == (2, 1, 4, 3) and r["p"] == pytest.approx(3 / 8)
    # many non-zero differences: random flips, p never 0, reproducible by seed
    big_before, big_after = [0.0] * 40, [0.3] * 30 + [-0.1] * 10
    r = sign_flip_test(big_before, big_after, n_resamples=2000, seed=1)
    assert not r["exact"] and 0 < r["p"] < 0.01 and r == sign_flip_test(big_before, big_after, 2000, 1)
    assert paired_test(before, after)["test"] == "exact McNemar"
    assert paired_test([0.0, 0.5], [0.5, 0.5])["test"] == "sign-flip"


def test_holm_and_the_claim_standard() -> None:
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    assert holm([]) == []
    assert ALPHA == 0.05 and MIN_QUESTIONS == 100
    assert shown(0.049, 100) and not shown(0.05, 100) and not shown(0.001, 99)


def _power_by_enumeration(n: int, p_better: float, p_worse: float) -> float:
    """Every (better, worse) outcome of n questions with its multinomial probability; reject when the exact
    one-sided McNemar p of that outcome is below 0.05."""
    total = 0.0
    for b in range(n + 1):
        for w in range(n + 1 - b):
            prob = math.factorial(n) / (math.factorial(b) * math.factorial(w) * math.factorial(n - b - w))
            prob *= p_better**b * p_worse**w * (1 - p_better - p_worse) ** (n - b - w)
            if binomial_tail(b, b + w) < 0.05:
                total += prob
    return total


@pytest.mark.parametrize(("n", "p_better", "p_worse"), [(6, 0.3, 0.1), (12, 0.2, 0.05), (20, 0.1, 0.1), (9, 0.5, 0.0)])
def test_mcnemar_power_equals_the_enumeration_of_every_outcome(n: int, p_better: float, p_worse: float) -> None:
    assert mcnemar_power(n, p_better, p_worse) == pytest.approx(_power_by_enumeration(n, p_better, p_worse), abs=1e-9)


def test_power_edges_detectable_difference_and_questions_needed() -> None:
    assert mcnemar_power(5, 1.0, 0.0) == pytest.approx(1.0)  # 5 of 5 better: p = 1/32 < 0.05
    assert mcnemar_power(4, 1.0, 0.0) == 0.0  # 4 of 4: p = 1/16, never shown
    assert mcnemar_power(100, 0.0, 0.0) == 0.0
    # ARENA's GRPO > warm start on EM: 4 of 102 questions changed, all better; at that rate of change not even a
    # run where every changed question improves reaches 80% power
    assert detectable_difference(102, 4 / 102) is None
    assert mcnemar_power(102, 4 / 102, 0.0) < 0.8
    needed = questions_needed(4 / 102, 0.0)
    assert needed is not None and 102 < needed < 400
    assert all(mcnemar_power(m, 4 / 102, 0.0) >= 0.8 for m in range(needed, needed + needed // 20 + 1))
    found = detectable_difference(100, 0.08)
    assert found is not None
    assert mcnemar_power(100, (0.08 + found) / 2, (0.08 - found) / 2) >= 0.8
    assert mcnemar_power(100, (0.08 + found - 0.002) / 2, (0.08 - found + 0.002) / 2) < 0.8
    assert questions_needed(0.05, 0.05) is None and questions_needed(0.03, 0.07) is None
    with pytest.raises(ValueError):
        mcnemar_power(10, 0.7, 0.5)
