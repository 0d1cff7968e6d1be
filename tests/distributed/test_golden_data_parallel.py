"""The golden record's DP = 2 run (tests/golden/record.py): Calibrated Clipping on two gloo ranks, 5 steps, compared
exactly with the committed record, metric by metric and step by step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.golden.record import DP_KEY, GOLDEN, differences, record_data_parallel

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_two_data_parallel_ranks_reproduce_the_golden_per_step_record(tmp_path: Path) -> None:
    expected = {DP_KEY: json.loads(GOLDEN.read_text())[DP_KEY]}
    diff = differences(expected, record_data_parallel(tmp_path / "dp.json", tmp_path / "work"))
    assert not diff, "the DP = 2 run no longer computes the golden record (`make golden`):\n" + "\n".join(diff)
