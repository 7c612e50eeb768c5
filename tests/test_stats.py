"""Bootstrap CIs used by the learning benchmarks (sleuth.eval.stats)."""

from __future__ import annotations

import pytest

from sleuth.eval.stats import bootstrap_ci, paired_difference_ci


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
