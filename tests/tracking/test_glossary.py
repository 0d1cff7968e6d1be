"""Every metric a run logs has a line in the glossary (a new metric without one fails here)."""

from __future__ import annotations

import re
import time

import pytest

from fp8rl.config import RunConfig, with_overrides
from fp8rl.job import run_job
from fp8rl.tracking import NullTracker
from fp8rl.tracking.glossary import METRICS, entry, glossary_markdown, meaning, unexplained

RUN_KINDS = {  # between them, every kind of metric the trainer logs
    "fp8 + calibrated, shadow, TIS, KL, BF16 eval": {
        "precision.mode": "fp8_full",
        "clipping.policy": "calibrated",
        "clipping.interval": 1,
        "clipping.rollout_correction": "tis_token",
        "trainer.shadow_every": 1,
        "algo.kl_coef": 0.1,
        "eval.every": 1,
        "eval.bf16": True,
    },
    "fp8 rollout, DAPO resampling, dual clip, sequence MIS": {
        "precision.mode": "fp8_rollout",
        "algo.dynamic_sampling": True,
        "algo.resample_rounds": 1,
        "algo.overlong_buffer": 2,
        "algo.policy_loss": "dual_clip",
        "clipping.rollout_correction": "mis_seq",
    },
}


@pytest.mark.parametrize("overrides", RUN_KINDS.values(), ids=RUN_KINDS.keys())
def test_every_logged_metric_has_a_glossary_line(small_cfg: RunConfig, overrides: dict) -> None:
    tracker = NullTracker()
    run_job(with_overrides(small_cfg, overrides), tracker=tracker, submitted_at=time.time())
    logged = {key for _, metrics in tracker.history for key in metrics}
    assert {"clip/bound_low", "rollout/entropy", "launch/submit_to_first_step_s"} <= logged
    assert unexplained(logged) == [], "add these metrics to fp8rl/tracking/glossary.py"


def test_patterns_match_whole_name_parts_and_exact_keys_win() -> None:
    assert entry("eval/heldout/avg_at_1") == "eval/<set>/avg_at_<k>"
    assert entry("eval/bf16/accuracy") == "eval/bf16/accuracy"  # not eval/<set>/... with set = bf16
    assert entry("actor/ratio_q05") == "actor/ratio_q<nn>"
    assert entry("eval/heldout/sub/avg_at_1") is None  # a placeholder never spans a slash
    assert unexplained(["rollout/reward", "rollout/made_up"]) == ["rollout/made_up"]
    assert meaning("rollout/entropy").startswith("rollout entropy")


def test_the_rendered_glossary_has_one_two_cell_row_per_entry() -> None:
    rows = [line for line in glossary_markdown().splitlines() if line.startswith("| `")]
    assert len(rows) == len(METRICS)
    assert all(len(re.split(r"(?<!\\)\|", row)) == 4 for row in rows)  # |A| in a meaning is escaped
    assert all(text.strip() for text in METRICS.values())


def test_the_chain_tasks_own_metrics_have_glossary_lines() -> None:
    from fp8rl.config import TaskConfig
    from fp8rl.tasks import build_task, garble_metrics, response_metrics

    task = build_task(TaskConfig(name="chain", num_digits=1, num_train=8, num_eval=8))
    responses = [task.target_ids(p) for p in task.train_problems[:4]]
    logged = {*response_metrics(task, responses), *garble_metrics([task.garble_reason(r) for r in responses])}
    assert "rollout/junk_token_rate" in logged
    assert unexplained(logged) == [], "add these metrics to fp8rl/tracking/glossary.py"
