"""Reading the MLflow store: experiments, a sweep's parent run, training runs by config hash, histories.

The one module through which the launcher (skip finished runs), the reports and the studies read MLflow.
A training run carries the tag ``fp8rl.config_hash`` (a hash of what it computes, set by the job); a
sweep's parent run carries ``fp8rl.sweep = <name>`` and ``fp8rl.role = sweep``, its children are nested
under it (``mlflow.parentRunId``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fp8rl.tracking.client import ensure_experiment, mlflow_client, resolve_tracking_uri
from fp8rl.tracking.mlflow_tracker import CONFIG_HASH_TAG

HASH_TAG = CONFIG_HASH_TAG
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
    """An MlflowClient for `uri` (a new sqlite store's tables created by one process at a time)."""
    return mlflow_client(uri)


def experiment_id(mlflow_client: Any, name: str, create: bool) -> str | None:
    """The experiment's id (restored if it was deleted); created when `create`, else None if missing."""
    return ensure_experiment(mlflow_client, name, create)


def search(mlflow_client: Any, exp_id: str | list[str], filter_string: str = "") -> list[Any]:
    """All runs of an experiment (or of a list of experiments) matching `filter_string` (every page), newest
    first."""
    runs, token = [], None
    while True:
        page = mlflow_client.search_runs(
            [exp_id] if isinstance(exp_id, str) else exp_id,
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


def metric_histories(mlflow_client: Any, run: Any, keys: Iterable[str]) -> dict[str, list[tuple[int, float]]]:
    """key -> [(step, value)] in step order, for the keys the run has."""
    out = {}
    for key in dict.fromkeys(keys):
        if key in run.data.metrics:
            history = mlflow_client.get_metric_history(run.info.run_id, key)
            out[key] = sorted((m.step, m.value) for m in history)
    return out


def display_uri(uri: str) -> str:
    """A store URI for tables and logs: credentials redacted, a sqlite file shown relative to the working
    directory (or by name), so no machine's absolute paths end up in results."""
    from fp8rl.tracking.client import redact

    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return redact(uri)
    path = Path(uri[len(prefix) :])
    try:
        return prefix + str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return prefix + path.name
