"""The per-step log line: the numbers a researcher watches, and a calibration's rule in words."""

from __future__ import annotations

from fp8rl.trainer.fit import step_line

STEP = {"rollout/reward": 0.8125, "rollout/entropy": 0.2131, "clip/low_neg": 0.0123, "clip/bound_low": 0.8,
        "clip/bound_high": 1.2}  # fmt: skip


def test_a_step_line_shows_reward_entropy_low_neg_bounds_and_speed() -> None:
    line = step_line(3, 40, STEP, 1.234)
    assert line == "step 3/40 | reward 0.812 | entropy 0.213 | low_neg 0.0123 | bounds 0.800/1.200 | 1.23 s/step"


def test_a_calibration_step_says_which_rule_fired() -> None:
    ok = {**STEP, "clip/calib_ok": 1.0, "clip/calib_alpha_zero": 0.0}
    assert "| calibration ok |" in step_line(4, 40, ok, 1.0)
    flagged = {**STEP, "clip/calib_ok": 0.0, "clip/calib_alpha_zero": 1.0, "clip/calib_p_unreachable": 1.0}
    assert "| calibration alpha_zero+p_unreachable |" in step_line(4, 40, flagged, 1.0)
    assert "calibration" not in step_line(5, 40, STEP, 1.0)  # not a calibration step


def test_a_rolled_back_step_says_so() -> None:
    assert "NON-FINITE: rolled back" in step_line(2, 40, {**STEP, "train/skipped": 1.0}, 1.0)


def test_every_evaluation_logs_its_sample_generations_as_a_table(small_cfg, caplog) -> None:
    """No run showed a single generation, though garbled output is one of the paper's symptoms."""
    import logging
    from pathlib import Path

    import pandas as pd

    from fp8rl.config import with_overrides
    from fp8rl.job import run_job
    from fp8rl.tracking import NullTracker

    class Artifacts(NullTracker):
        def __init__(self) -> None:
            super().__init__()
            self.artifacts: list[tuple[str, str | None]] = []

        def log_artifact(self, path, artifact_path=None) -> None:
            self.artifacts.append((str(path), artifact_path))

    tracker = Artifacts()
    cfg = with_overrides(small_cfg, {"eval.every": 2, "eval.bf16": True})
    with caplog.at_level(logging.INFO, logger="fp8rl.train"):
        run_job(cfg, tracker=tracker)
    tables = [Path(path) for path, folder in tracker.artifacts if folder == "samples"]
    assert [t.name for t in tables] == ["step_000000.json", "step_000002.json"]
    samples = pd.read_json(tables[-1], orient="split")
    assert list(samples.columns) == ["precision", "set", "prompt", "answer", "response", "reward", "garbled"]
    assert sorted(set(samples["precision"])) == ["bf16", "rollout"] and len(samples) == 2 * 8
    assert samples["prompt"].str.endswith("=").all() and samples["reward"].between(0, 1).all()
    assert any("step 2 samples" in record.getMessage() and "->" in record.getMessage() for record in caplog.records)
