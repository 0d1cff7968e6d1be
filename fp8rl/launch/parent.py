"""A sweep's MLflow parent run: created on the first launch and reused, described (the experiment file's
header), set RUNNING while points run and ended by the launch that ends last."""

from __future__ import annotations

from typing import Any

from fp8rl.launch.experiment import SweepDefinition, experiment_description
from fp8rl.tracking import store

DESCRIPTION_TAG = "mlflow.note.content"  # what the MLflow UI shows as an experiment's or a run's description


def sweep_description(definition: SweepDefinition, points: int) -> str:
    """The experiment file's header comment and what this sweep runs of it (the MLflow UI's description)."""
    axes = ", ".join(definition.axes) or "none"
    scale = definition.scale or "the file's default"
    where = f"`fp8rl sweep {definition.experiment}` (sweeps/experiment/{definition.experiment}.yaml)"
    header = experiment_description(definition.experiment)
    return f"{header}\n\n{points} points at scale {scale}; axes: {axes}. {where}."


def ensure_parent(mlflow_client: Any, exp_id: str, sweep: str, tags: dict[str, str]) -> str:
    """The sweep's parent run (reused across launches, set RUNNING), created on the first launch."""
    parent = store.find_parent(mlflow_client, exp_id, sweep)
    all_tags = {**tags, store.SWEEP_TAG: sweep, store.ROLE_TAG: store.PARENT_ROLE}
    if parent is None:
        run = mlflow_client.create_run(exp_id, run_name=sweep, tags={**all_tags, "mlflow.runName": sweep})
        return run.info.run_id
    run_id = parent.info.run_id
    for key, value in all_tags.items():
        mlflow_client.set_tag(run_id, key, value)
    if parent.info.status != "RUNNING":
        mlflow_client.update_run(run_id, status="RUNNING")
    return run_id


def finish_parent(mlflow_client: Any, parent_id: str, status: str) -> None:
    if status == "RUNNING":
        mlflow_client.update_run(parent_id, status="RUNNING")
    else:
        mlflow_client.set_terminated(parent_id, status=status)
