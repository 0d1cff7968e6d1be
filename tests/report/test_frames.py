"""fp8rl.report.frames: paired differences with their p-values, Holm's adjustment over a table section's arms."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from fp8rl.report.frames import holm, paired_differences


def test_holm_step_down_on_a_textbook_family() -> None:
    """Holm (1979): sorted p-values times m, m - 1, ..., 1, made monotone, capped at 1; NaN stays out of the family."""
    adjusted = holm(pd.Series([0.01, 0.04, math.nan, 0.03, 0.5]))
    # family of 4: 0.01 * 4, 0.03 * 3, 0.04 * 2 -> max(0.09, 0.08), 0.5 * 1 -> max(0.09, 0.5)
    assert adjusted.tolist()[:2] == pytest.approx([0.04, 0.09])
    assert math.isnan(adjusted[2]) and adjusted[3] == pytest.approx(0.09) and adjusted[4] == pytest.approx(0.5)
    assert holm(pd.Series([0.6, 0.7])).tolist() == [1.0, 1.0]


def test_paired_differences_carry_the_t_tests_p_value() -> None:
    from scipy import stats

    values = [1, 2, 3, 4, 1.5, 2.1, 3.4, 4.2]
    frame = pd.DataFrame({"arm": ["a"] * 4 + ["b"] * 4, "seed": [0, 1, 2, 3] * 2, "x": values})
    (row,) = paired_differences(frame, "arm", "a", ["x"]).itertuples()
    assert row.p == pytest.approx(stats.ttest_1samp([0.5, 0.1, 0.4, 0.2], 0).pvalue)
    assert row.ci_low > 0 and row.p < 0.05
