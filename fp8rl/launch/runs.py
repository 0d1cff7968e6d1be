"""MLflow bookkeeping of a sweep: one experiment per sweep, a parent run, children found by config hash.

A child is identified by the tag ``fp8rl.config_hash`` that `fp8rl.trainer.run.make_tracker` sets
(a hash of what the run computes). A sweep's parent run carries ``fp8rl.sweep = <name>`` and
``fp8rl.role = sweep``; its children are nested under it (``mlflow.parentRunId``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fp8rl.tracking import resolve_tracking_uri

HASH_TAG = "fp8rl.config_hash"
SWEEP_TAG = "fp8rl.sweep"
ROLE_TAG = "fp8rl.role"
PARENT_ROLE = "sweep"


def absolute_tracking_uri(uri: str | None) -> str:
    """Resolve like the trainer does, then pin a relative sqlite path to the current directory, so jobs
    started elsewhere (another working directory, a Slurm node) write to the same store."""
    uri = resolve_tracking_uri(uri)
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri[len(prefix) :]).resolve())
    return uri


def store_exists(uri: str) -> bool:
    """False only for a sqlite store whose file is not there yet (servers and others: assume it exists)."""
    prefix = "sqlite:///"
    return not uri.startswith(prefix) or Path(uri[len(prefix) :]).exists()


def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def experiment_id(mlflow_client: Any, name: str, create: bool) -> str | None:
    found = mlflow_client.get_experiment_by_name(name)
    if found is not None:
        if found.lifecycle_stage == "deleted":
            mlflow_client.restore_experiment(found.experiment_id)
        return found.experiment_id
    return mlflow_client.create_experiment(name) if create else None


def search(mlflow_client: Any, exp_id: str, filter_string: str = "") -> list[Any]:
    """All runs of an experiment matching `filter_string` (every page), newest first."""
    runs, token = [], None
    while True:
        page = mlflow_client.search_runs(
            [exp_id],
            filter_string=filter_string,
            max_results=1000,
            order_by=["attributes.start_time DESC"],
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _tag(name: str, value: str) -> str:
    escaped = value.replace("'", "\\'")
    return f"tags.`{name}` = '{escaped}'"


def find_parent(mlflow_client: Any, exp_id: str, sweep: str) -> Any | None:
    runs = search(mlflow_client, exp_id, f"{_tag(SWEEP_TAG, sweep)} and {_tag(ROLE_TAG, PARENT_ROLE)}")
    return runs[0] if runs else None


def ensure_parent(mlflow_client: Any, exp_id: str, sweep: str, tags: dict[str, str]) -> str:
    """The sweep's parent run (reused across launches, set RUNNING), created on the first launch."""
    parent = find_parent(mlflow_client, exp_id, sweep)
    all_tags = {**tags, SWEEP_TAG: sweep, ROLE_TAG: PARENT_ROLE}
    if parent is None:
        run = mlflow_client.create_run(exp_id, run_name=sweep, tags={**all_tags, "mlflow.runName": sweep})
        return run.info.run_id
    run_id = parent.info.run_id
    for key, value in all_tags.items():
        mlflow_client.set_tag(run_id, key, value)
    if parent.info.status != "RUNNING":
        mlflow_client.update_run(run_id, status="RUNNING")
    return run_id


def child_runs(mlflow_client: Any, exp_id: str, config_hash: str | None = None, parent_id: str | None = None) -> list:
    """Runs of the experiment that carry a config hash (i.e. trainer runs), optionally filtered."""
    clauses = [f"tags.`{HASH_TAG}` != ''"] if config_hash is None else [_tag(HASH_TAG, config_hash)]
    if parent_id:
        clauses.append(_tag("mlflow.parentRunId", parent_id))
    return search(mlflow_client, exp_id, " and ".join(clauses))


def hashes_by_status(runs: Iterable[Any]) -> dict[str, set[str]]:
    """status -> config hashes of the runs in that status."""
    out: dict[str, set[str]] = {}
    for run in runs:
        out.setdefault(run.info.status, set()).add(run.data.tags.get(HASH_TAG, ""))
    return out


def finish_parent(mlflow_client: Any, parent_id: str, status: str) -> None:
    if status == "RUNNING":
        mlflow_client.update_run(parent_id, status="RUNNING")
    else:
        mlflow_client.set_terminated(parent_id, status=status)


def wide_console() -> Any:
    """A rich console that does not squeeze tables to 80 columns when the output is a file or a pipe."""
    import sys

    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 200)
