"""A tracked run is a first-class MLflow run: its description shows the command as typed, its data sets are
inputs, and running the same finished command again leaves the run as it was."""

from __future__ import annotations

import sys
import types

from mlflow.tracking import MlflowClient

from fp8rl.config import RunConfig, with_overrides
from fp8rl.job import run_job
from fp8rl.job.run import describe, shown_command


def test_the_command_is_shown_as_typed_without_local_paths(monkeypatch) -> None:
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="fp8rl.demo")
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", ["/work/x/fp8rl/demo.py", "--steps", "3"])
    assert shown_command() == "python -m fp8rl.demo --steps 3"
    monkeypatch.setattr(main, "__spec__", None)
    monkeypatch.setattr(sys, "argv", ["/work/x/.venv/bin/fp8rl", "sweep", "grpo_granularity"])
    assert shown_command() == "fp8rl sweep grpo_granularity"
    assert describe(RunConfig(), "r").endswith("Command: `fp8rl sweep grpo_granularity`")


def test_a_finished_run_is_not_reopened_by_the_same_command(small_cfg: RunConfig, sqlite_uri: str) -> None:
    cfg = with_overrides(small_cfg, {"tracking.enabled": True, "tracking.tracking_uri": sqlite_uri,
                                     "trainer.steps": 1})  # fmt: skip
    first = run_job(cfg)
    client = MlflowClient(sqlite_uri)
    before = client.get_run(first.run_id)
    again = run_job(cfg)  # its checkpoint is there too: nothing to resume
    after = client.get_run(first.run_id)
    assert again.run_id == first.run_id and after.info.status == "FINISHED"
    assert after.info.end_time == before.info.end_time
    contexts = {i.dataset.name: {t.key: t.value for t in i.tags} for i in after.inputs.dataset_inputs}
    assert contexts["arithmetic-train"]["mlflow.data.context"] == "training"
    assert contexts["arithmetic-heldout"]["mlflow.data.context"] == "evaluation"


def test_a_submitit_job_records_fp8rls_source_and_git_commit_not_submitits(monkeypatch) -> None:
    """MLflow takes a run's source and git commit from sys.argv[0]: under submitit that is its ``_submit.py`` in
    site-packages, so all 80 runs of the GRPO table recorded submitit as their source and no commit."""
    from mlflow.tracking.context.registry import resolve_tags

    from fp8rl.job.distributed import SINGLE_PROCESS
    from fp8rl.job.run import run_tags
    from fp8rl.tracking.provenance import git_info

    monkeypatch.setattr(sys, "argv", ["/site-packages/submitit/core/_submit.py", "/tmp/jobs"])
    monkeypatch.setitem(sys.modules, "__main__", type(sys)("__main__"))  # no module spec: a script
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    tags = resolve_tags(run_tags(RunConfig(), "abc", SINGLE_PROCESS, None))
    assert tags["mlflow.source.name"].startswith("fp8rl.job.run_job")
    assert tags["mlflow.source.type"] == "JOB"
    assert tags["mlflow.source.git.commit"] == git_info()["git_sha"] != "unknown"


def test_every_run_records_where_its_policy_started_and_which_cpu_trained_the_warm_start(small_cfg) -> None:
    """Runs did not say which warm start they used, nor its accuracy, and the tiny numbers depend on the CPU."""
    import json
    from pathlib import Path

    from fp8rl.tracking import NullTracker

    class Artifacts(NullTracker):
        logged: list[str] = []

        def log_artifact(self, path, artifact_path=None) -> None:
            self.logged.append(str(path))

    tracker = Artifacts()
    summary = run_job(with_overrides(small_cfg, {"trainer.steps": 1}), tracker=tracker)
    path = Path(summary.out_dir) / "start_weights.json"
    assert str(path) in tracker.logged
    start = json.loads(path.read_text())
    assert start["source"].startswith("30-step supervised warm start") and len(start["key"]) >= 12
    assert start["steps_done"] == 30 and 0 <= start["eval/accuracy"] <= 1
    assert {"cpu_model", "cpu_flags", "kernel_settings"} <= set(start["machine"])
