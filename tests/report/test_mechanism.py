"""fp8rl.report.mechanism: the mechanism tables' Wilson intervals and exact McNemar test."""

from __future__ import annotations

import pytest

from fp8rl.report import mechanism


def test_wilson_interval_of_a_clip_fraction() -> None:
    low, high = mechanism.wilson_interval(0.0, 100)
    assert low == 0.0 and high == pytest.approx(0.0370, abs=1e-4)  # no token clipped: still up to 3.7%
    low, high = mechanism.wilson_interval(0.5, 100)
    assert (low, high) == (pytest.approx(0.4038, abs=1e-4), pytest.approx(0.5962, abs=1e-4))
    assert all(v != v for v in mechanism.wilson_interval(0.1, 0))  # no trials: NaN


def test_mcnemar_p_pairs_the_tokens_only_fp8_clips_with_those_only_bf16_clips() -> None:
    """9 tokens of 624 clipped by FP8 alone, none by BF16 alone: p = 2 * 0.5**9 (exact, two-sided)."""
    cell = {"clip/overclip_neg": 9 / 624, "clip/underclip_neg": 0.0, "mech/neg_tokens": 624.0}
    assert mechanism.mcnemar_p(cell) == pytest.approx(2 * 0.5**9)
    assert mechanism.mcnemar_p({**cell, "clip/underclip_neg": 9 / 624}) == pytest.approx(1.0)  # as many each way
    assert mechanism.mcnemar_p({**cell, "clip/overclip_neg": 0.0}) == 1.0  # no discordant token
    assert mechanism.mcnemar_p({"clip/overclip_neg": 0.1}) != mechanism.mcnemar_p({"clip/overclip_neg": 0.1})  # NaN
