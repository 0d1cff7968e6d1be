"""The golden per-step record (`tests/golden/record.py`): the demo's three arms, 5 steps, re-run and compared with
the committed record, metric by metric and step by step, with their config hashes. Exact: under the pinned
kernels the record is machine-independent (the module docstring says why and how that was checked)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.golden.record import ARMS, GOLDEN, differences, record_in_subprocess


def test_the_demo_arms_reproduce_the_golden_per_step_record(tmp_path: Path) -> None:
    """The one-process arms (the DP = 2 one: tests/distributed/test_golden_data_parallel.py)."""
    expected = {arm: record for arm, record in json.loads(GOLDEN.read_text()).items() if arm in ARMS}
    actual = record_in_subprocess(tmp_path / "steps.json", tmp_path / "work")
    diff = differences(expected, actual)
    assert not diff, (
        "the runs no longer compute the golden record (a deliberate change of behaviour: `make golden`, and say why "
        "in the commit):\n" + "\n".join(diff)
    )


def test_the_comparison_sees_a_changed_value_a_renamed_metric_and_a_new_hash() -> None:
    record = {"a": {"config_hash": "h", "steps": {"1": {"x": 1.0, "y": float("nan")}}}}
    assert differences(record, json.loads(json.dumps(record))) == []
    changed = {"a": {"config_hash": "h2", "steps": {"1": {"x": 1.0 + 2**-40, "z": float("nan")}}}}
    found = "\n".join(differences(record, changed))
    assert "config hash h2" in found and "x = " in found and "y only in the record" in found
    assert "z only in the new run" in found
