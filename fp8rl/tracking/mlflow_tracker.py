"""MLflow tracking for one run: one layer, one local write-ahead log (WAL), uploads on a background thread.

The trainer is handed a `Tracker`; the maths never imports this module.

- Start: the store is probed with a short timeout (`probe_store`). A dead store is a clear error before
  anything is built, unless ``tracking.offline`` asks to train anyway: the run then starts offline.
- Runs are created with MLflow's standard tags (`resolve_tags`: user, source, git commit), a description
  (``mlflow.note.content``), params (credentials in URIs redacted) and tags; a resumed run continues the
  same MLflow run.
- ``log_metrics`` appends the step's record to the WAL in the run folder (a local append), then hands its
  ``log_batch`` to one upload thread (a `concurrent.futures` executor: each step's own future and MLflow's own
  error, whose ``error_code`` says whether the store refused the request; MLflow's asynchronous logging joins
  its errors into one message without codes) and returns. NaN and inf are logged as such. A step counts as stored
  only when its own upload succeeded or MLflow holds it (never because a later step did: a store locked for a
  while fails some batches while later ones land). The WAL is deleted when the run ends with every step
  stored; a run killed in between replays it on resume (the steps MLflow holds are skipped, so no step is
  logged twice).
- The WAL is bound to its run: its run record carries the config hash, and a WAL written for another config,
  or naming a run of another config, is moved aside with a message instead of being replayed into it. Replay
  uploads only files inside the run folder.
- Offline (store unreachable at start, or lost mid-run): records stay in the WAL; the store is probed
  again every ``RETRY_EVERY_S`` seconds and, once it answers, the run is created (or continued) and the
  WAL is uploaded in order. A run that ends offline leaves its WAL and says how to upload it later
  (``fp8rl sync <run folder>``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fp8rl.tracking.client import (
    TrackingUnavailable,
    ensure_experiment,
    ensure_experiment_tag,
    mlflow_client,
    probe_store,
    redact,
)

log = logging.getLogger(__name__)
PARAM_VALUE_LIMIT = 6000
RETRY_EVERY_S = 30.0
FINISH_WAIT_S = 120.0
WAL_NAME = "tracking_wal.jsonl"
CONFIG_HASH_TAG = "fp8rl.config_hash"  # the tag that says which config a run computes (set by the job)
DATASET_CONTEXT_TAG = "mlflow.data.context"  # MLflow's standard input tag: training / evaluation
EXPERIMENT_KIND = "finetuning"  # the MLflow UI's model-training view (not the GenAI one)
_METRIC_NAME_INVALID = re.compile(r"[^A-Za-z0-9_\-. :/]")  # what MLflow accepts in a metric name
# MlflowException.error_code of a request the store refused (retrying cannot help); other errors: the store is away
_REQUEST_ERRORS = frozenset({"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE"})


class Tracker(Protocol):
    """What the training loop needs from experiment tracking."""

    run_id: str | None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_figure(self, figure: Any, artifact_file: str) -> None: ...
    def log_datasets(self, describe: Callable[[], list[dict[str, str]]]) -> None: ...
    def last_logged_step(self) -> int: ...
    def finish(self, status: str = "FINISHED") -> None: ...


class NullTracker:
    """Tracks nothing (tests, other ranks, tracking disabled); remembers metrics in memory for inspection."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        self.history: list[tuple[int, dict[str, float]]] = []
        self.status: str | None = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.history.append((step, dict(metrics)))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        return None

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        return None

    def log_datasets(self, describe: Callable[[], list[dict[str, str]]]) -> None:
        return None  # describing the data sets costs seconds (a digest of every problem): only when tracked

    def last_logged_step(self) -> int:
        return self.history[-1][0] if self.history else -1

    def finish(self, status: str = "FINISHED") -> None:
        self.status = status


@dataclass
class RunSpec:
    """What identifies and describes the MLflow run of a training run."""

    tracking_uri: str
    experiment: str
    run_name: str
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    parent_run_id: str | None = None
    resume_run_id: str | None = None  # continue this run instead of creating one
    artifacts: list[tuple[str, str | None]] = field(default_factory=list)  # (local path, artifact folder)
    attempt_tags: dict[str, str] = field(default_factory=dict)  # set on every start, resumed runs too
    system_metrics: bool = True


class MlflowTracker:
    """One MLflow run (module docstring). ``out_dir`` holds the WAL."""

    def __init__(self, spec: RunSpec, out_dir: str | Path, connect_timeout_s: float, offline_ok: bool) -> None:
        self.spec = spec
        self.wal_path = Path(out_dir) / WAL_NAME
        self.run_id: str | None = None
        self._client: Any = None
        self._pending: list[tuple[int, Future]] = []  # (step, its upload) not yet confirmed
        self._uploads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp8rl-mlflow-upload")
        self._confirmed: set[int] = set()  # steps MLflow holds (their upload succeeded, or it had them)
        self._refused: set[int] = set()  # steps MLflow refused (a request error: retrying cannot help)
        self._last_probe = 0.0
        self._system_monitor: Any = None
        self.wal_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            probe_store(spec.tracking_uri, connect_timeout_s)
        except TrackingUnavailable:
            if not offline_ok:
                raise
            log.warning("tracking store unreachable: training offline, records kept in %s", self.wal_path)
            self._set_aside_foreign_wal(self._read_wal())
            self._write_wal({"kind": "start", "spec": _spec_record(spec), "config_hash": self._config_hash})
            return
        self._go_online_within(connect_timeout_s)

    def _go_online_within(self, timeout_s: float) -> None:
        """`_go_online`, retried while the store answers with errors (a sqlite file locked by another writer, a
        backup) for up to `timeout_s`; then a clear error naming the store."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._go_online()
                return
            except Exception as err:  # noqa: BLE001 - MLflow wraps the store's errors in many types
                self._client = self.run_id = None
                if time.monotonic() >= deadline:
                    raise TrackingUnavailable(
                        f"the MLflow store {redact(self.spec.tracking_uri)} answered but refused to open the run for "
                        f"{timeout_s:.0f} s ({redact(str(err)).splitlines()[0][:200]}): if another process holds it "
                        "(a sqlite file locked by a backup or another writer), wait and re-run the same command; "
                        "or raise tracking.connect_timeout_s, or set tracking.offline=true to train now"
                    ) from None
                time.sleep(1.0)

    # ------------------------------------------------------------------------------------------ Tracker
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Append the step to the WAL, then upload it asynchronously (steps MLflow already has are skipped)."""
        record = {"kind": "metrics", "step": step, "timestamp": _now_ms(), "metrics": _plain(metrics)}
        self._write_wal(record)
        self._collect_finished()
        if self.online:
            self._send(record)
        else:
            self._maybe_reconnect()

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if not self.online:
            self._write_wal({"kind": "artifact", "path": str(Path(path).resolve()), "artifact_path": artifact_path})
            return
        try:
            self._client.log_artifact(self.run_id, str(path), artifact_path)
        except Exception as err:  # noqa: BLE001 - an artifact that fails to upload must not stop training
            log.warning("could not log artifact %s: %s", path, err)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        """A matplotlib figure as an image artifact (saved next to the WAL too, so nothing is lost offline)."""
        local = self.wal_path.parent / "figures" / artifact_file
        local.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(local, dpi=110, bbox_inches="tight")
        self.log_artifact(local, str(Path("figures", artifact_file).parent))

    def log_datasets(self, describe: Callable[[], list[dict[str, str]]]) -> None:
        """The run's data sets as MLflow dataset inputs; `describe()` gives one record per data set (MLflow's
        dataset fields as text, plus ``context``: `fp8rl.tracking.datasets`). Kept in the WAL while offline."""
        self._log_dataset_records(describe())

    def _log_dataset_records(self, datasets: list[dict[str, str]]) -> None:
        if not self.online:
            self._write_wal({"kind": "datasets", "datasets": datasets})
            return
        from mlflow.entities import Dataset, DatasetInput, InputTag

        inputs = []
        for record in datasets:
            fields = {k: v for k, v in record.items() if k != "context"}
            tags = [InputTag(DATASET_CONTEXT_TAG, record["context"])] if "context" in record else []
            inputs.append(DatasetInput(Dataset(**fields), tags=tags))
        try:
            self._client.log_inputs(self.run_id, datasets=inputs)
        except Exception as err:  # noqa: BLE001 - a data set description that fails must not stop training
            log.warning("could not log the run's data sets: %s", err)

    def last_logged_step(self) -> int:
        return max(self._confirmed, default=-1)

    @property
    def online(self) -> bool:
        return self.run_id is not None and self._client is not None

    def finish(self, status: str = "FINISHED") -> None:
        """Wait (bounded) until every step is stored (reconnecting and replaying while the store is away or
        locked), mark the run, and delete the WAL only if every step is stored."""
        if self._system_monitor is not None:
            self._system_monitor.finish()
            self._system_monitor = None
        intended = status
        uploaded = self._complete_record(FINISH_WAIT_S)
        if not self.online:
            self._write_wal({"kind": "end", "status": status})
            log.error(
                "MLflow was unreachable at the end of the run: its records are in %s; upload them with "
                "`fp8rl sync %s` once the store is back",
                self.wal_path,
                self.wal_path.parent,
            )
            return
        if not uploaded and status == "FINISHED":
            status = "FAILED"  # FINISHED means a complete record; the WAL keeps the rest for the sync
        try:
            self._client.set_terminated(self.run_id, status=status)
        except Exception as err:  # noqa: BLE001
            log.error("could not mark MLflow run %s %s: %s", self.run_id, status, err)
            uploaded = False
        if uploaded:
            self.wal_path.unlink(missing_ok=True)
        else:
            missing = sorted(self._wal_steps() - self._confirmed)
            self._write_wal({"kind": "end", "status": intended})
            log.error(
                "steps %s did not reach MLflow (run marked %s); they stay in %s: `fp8rl sync %s` "
                "uploads them and marks the run",
                _ranges(missing),
                status,
                self.wal_path,
                self.wal_path.parent,
            )

    def _complete_record(self, timeout_s: float) -> bool:
        """Drain, reconnect and replay until every WAL step is stored or `timeout_s` has passed. A store that
        does not answer its probe is not waited for (the WAL keeps the record for `fp8rl.tracking.sync`); one that
        answers but fails (a locked sqlite file) is retried until the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.online and not self._maybe_reconnect(force=True):
                return False
            if self.online:
                self._drain(max(0.0, deadline - time.monotonic()))
                if self.online and not self._pending:
                    missing = self._wal_steps() - self._confirmed - self._refused
                    if not missing:
                        return not (self._wal_steps() & self._refused)
                    if time.monotonic() >= deadline:
                        return False
                    self._replay(self._read_wal())  # sent again: their uploads failed while later ones landed
                    continue
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _wal_steps(self) -> set[int]:
        return {r["step"] for r in self._read_wal() if r["kind"] == "metrics"}

    # ------------------------------------------------------------------------------------------ internals
    def _go_online(self) -> None:
        self._client = mlflow_client(self.spec.tracking_uri)
        records = self._set_aside_foreign_wal(self._read_wal())
        start = next((r for r in records if r["kind"] == "start"), None)
        resume = self.spec.resume_run_id or next((r["run_id"] for r in records if r["kind"] == "run"), None)
        if resume is not None and not self.spec.resume_run_id and not self._same_config(resume):
            records, resume, start = self._move_wal_aside(f"it names MLflow run {resume} of another config"), None, None
        if resume is not None:
            self.run_id = resume
            self._client.update_run(resume, status="RUNNING")
            self._confirmed = _stored_steps(self._client, resume)
            if not any(r["kind"] == "run" for r in records):
                self._write_wal({"kind": "run", "run_id": self.run_id, "config_hash": self._config_hash})
        else:
            self.run_id = self._create_run()
            self._confirmed = set()
            self._write_wal({"kind": "run", "run_id": self.run_id, "config_hash": self._config_hash})
        if start is not None or resume is None:
            self._log_description()
        for key, value in self.spec.attempt_tags.items():
            self._client.set_tag(self.run_id, key, redact(str(value)))
        self._replay(records)
        self._start_system_metrics()

    @property
    def _config_hash(self) -> str | None:
        return self.spec.tags.get(CONFIG_HASH_TAG)

    def _same_config(self, run_id: str) -> bool:
        """Whether MLflow run `run_id` computes this spec's config. A spec without a hash cannot check; a run
        without one (a sweep's parent, a run fp8rl did not make) is not this config's: a WAL naming it is not
        replayed into it."""
        if self._config_hash is None:
            return True
        try:
            theirs = self._client.get_run(run_id).data.tags.get(CONFIG_HASH_TAG)
        except Exception:  # noqa: BLE001 - a run the store does not know is not this config's
            return False
        return theirs == self._config_hash

    def _set_aside_foreign_wal(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The WAL's records, or none when they were written for another config (the WAL is then moved aside)."""
        hashes = {r["config_hash"] for r in records if r.get("config_hash")}
        if self._config_hash is None or not hashes or hashes == {self._config_hash}:
            return records
        return self._move_wal_aside(f"it was written for config {', '.join(sorted(hashes))}")

    def _move_wal_aside(self, why: str) -> list[dict[str, Any]]:
        kept = self.wal_path.with_name(f"{self.wal_path.stem}.{time.strftime('%Y%m%d-%H%M%S')}.foreign.jsonl")
        self.wal_path.replace(kept)
        log.warning(
            "the tracking log %s is not this run's (%s, this run's config is %s): moved to %s, not replayed",
            self.wal_path,
            why,
            self._config_hash,
            kept.name,
        )
        return []

    def _create_run(self) -> str:
        from mlflow.tracking.context.registry import resolve_tags

        spec, client = self.spec, self._client
        experiment_id = ensure_experiment(client, spec.experiment)
        ensure_experiment_tag(client, experiment_id, "mlflow.experimentKind", EXPERIMENT_KIND)
        tags = {**spec.tags, "mlflow.runName": spec.run_name, "mlflow.note.content": spec.description}
        if spec.parent_run_id:
            tags["mlflow.parentRunId"] = spec.parent_run_id
        tags = {k: redact(str(v)) for k, v in resolve_tags(tags).items()}
        return client.create_run(experiment_id, tags=tags, run_name=spec.run_name).info.run_id

    def _log_description(self) -> None:
        """Params, artifacts named in the spec (configs, command line), once per run."""
        from mlflow.entities import Param

        items = [Param(k, redact(str(v))[:PARAM_VALUE_LIMIT]) for k, v in self.spec.params.items()]
        existing = set(self._client.get_run(self.run_id).data.params)
        items = [p for p in items if p.key not in existing]
        for start in range(0, len(items), 100):
            self._client.log_batch(self.run_id, params=items[start : start + 100])
        for path, folder in self.spec.artifacts:
            if self._inside_run_folder(path):  # a start record read back from a WAL names them too
                self.log_artifact(path, folder)

    def _send(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        if record["step"] in self._confirmed or record["step"] in self._refused:
            return
        metrics = [Metric(metric_name(k), v, record["timestamp"], record["step"]) for k, v in record["metrics"].items()]
        if self.online:  # (a replay's artifact upload may have lost the store meanwhile)
            upload = self._uploads.submit(self._client.log_batch, self.run_id, metrics=metrics, synchronous=True)
            self._pending.append((record["step"], upload))

    def _collect_finished(self) -> None:
        """Confirm each upload that succeeded; a failed one sends the tracker offline (the WAL keeps the data,
        and its step is sent again), a refused one is kept apart (it stays in the WAL)."""
        for entry in [e for e in self._pending if e[1].done()]:
            if entry not in self._pending:  # cleared: the store was lost while collecting
                return
            self._pending.remove(entry)
            step, upload = entry
            try:
                upload.result()
            except Exception as err:  # noqa: BLE001
                if self._on_error(err):
                    return
                self._refused.add(step)
                continue
            self._confirmed.add(step)

    def _drain(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            self._collect_finished()
            if self._pending:
                time.sleep(0.05)
        if not self.online:
            return False
        return not self._pending

    def _on_error(self, err: BaseException) -> bool:
        """A refused request is logged and dropped (retrying cannot help); anything else means the store
        went away. Returns whether the tracker went offline."""
        if getattr(err, "error_code", None) in _REQUEST_ERRORS:
            log.error("MLflow refused a tracking request (dropped; the record stays in %s): %s", self.wal_path, err)
            return False
        self._lose_store(err)
        return True

    def _lose_store(self, err: BaseException) -> None:
        log.warning("MLflow store lost (%s); records stay in %s and are uploaded when it returns", err, self.wal_path)
        self._client, self._pending = None, []
        self._last_probe = time.monotonic()

    def _maybe_reconnect(self, force: bool = False) -> bool:
        """Probe the store (every RETRY_EVERY_S, or now if `force`) and go online; returns whether it answered."""
        if not force and time.monotonic() - self._last_probe < RETRY_EVERY_S:
            return False
        self._last_probe = time.monotonic()
        try:
            probe_store(self.spec.tracking_uri, timeout_s=5.0)
        except TrackingUnavailable:
            return False
        log.info("MLflow store reachable again: uploading %s", self.wal_path)
        try:
            self._go_online()
        except Exception as err:  # noqa: BLE001 - reachable but not answering (a locked sqlite file): later
            self._lose_store(err)
        return True

    def _replay(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            if record["kind"] == "metrics":
                self._send(record)
            elif record["kind"] == "artifact" and self._inside_run_folder(record["path"]):
                self.log_artifact(record["path"], record.get("artifact_path"))
            elif record["kind"] == "datasets":
                self._log_dataset_records(record["datasets"])

    def _inside_run_folder(self, path: str) -> bool:
        """Only the run folder's own files are uploaded (a planted record must not upload /etc/passwd)."""
        resolved, folder = Path(path).resolve(), self.wal_path.parent.resolve()
        if resolved.is_relative_to(folder) and resolved.is_file():
            return True
        log.warning("not uploading %s: the tracking log may only name files inside %s", path, folder)
        return False

    def _start_system_metrics(self) -> None:
        if not self.spec.system_metrics or self._system_monitor is not None:
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._system_monitor = SystemMetricsMonitor(
                self.run_id, sampling_interval=10, resume_logging=True, tracking_uri=self.spec.tracking_uri
            )
            self._system_monitor.start()
        except Exception as err:  # noqa: BLE001 - system metrics are a nicety (psutil missing, no GPU tools)
            log.info("system metrics not logged: %s", err)
            self._system_monitor = None

    def _write_wal(self, record: dict[str, Any]) -> None:
        with open(self.wal_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def _read_wal(self) -> list[dict[str, Any]]:
        return read_wal(self.wal_path)


def read_wal(path: Path) -> list[dict[str, Any]]:
    """The WAL's records; a line torn by a kill mid-write is skipped (its step is re-run on resume)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("skipping a torn line in %s", path)
    return records


def _stored_steps(client: Any, run_id: str) -> set[int]:
    """The steps MLflow holds for the run's own metrics (MLflow's system metrics count their own samples, and
    evaluation metrics skip steps, so every key is read). One step is one ``log_batch``, which the SQL store
    writes in one transaction: any of its metrics stored means all of them are."""
    run = client.get_run(run_id)
    steps: set[int] = set()
    for key in run.data.metrics:
        if not key.startswith("system/"):
            steps.update(m.step for m in client.get_metric_history(run_id, key))
    return steps


def _ranges(steps: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5, 9"``."""
    spans: list[list[int]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans) or "none"


def metric_name(key: str) -> str:
    """`key` with the characters MLflow refuses in a metric name replaced by "_"."""
    return _METRIC_NAME_INVALID.sub("_", key)


def _spec_record(spec: RunSpec) -> dict[str, Any]:
    """The run's description as the WAL keeps it, so `fp8rl.tracking.sync` can create the run later (credentials
    in the store's URI redacted; parameter values as text)."""
    record = dataclasses.asdict(spec)
    record["tracking_uri"] = redact(spec.tracking_uri)
    record["params"] = {k: redact(str(v)) for k, v in spec.params.items()}  # tracking.tracking_uri among them
    record["tags"] = {k: redact(str(v)) for k, v in spec.tags.items()}
    record["description"] = redact(spec.description)
    record["artifacts"] = [[str(Path(path).resolve()), folder] for path, folder in spec.artifacts]
    return record


def spec_from_record(record: dict[str, Any], tracking_uri: str) -> RunSpec:
    """The RunSpec a WAL's start record describes, for the store at `tracking_uri`."""
    fields = {f.name for f in dataclasses.fields(RunSpec)}
    values = {k: v for k, v in record.items() if k in fields}
    values["artifacts"] = [tuple(item) for item in values.get("artifacts", [])]
    return RunSpec(**{**values, "tracking_uri": tracking_uri, "system_metrics": False})


def _plain(metrics: Mapping[str, float]) -> dict[str, float]:
    """Floats, NaN and inf included (JSON writes them as NaN/Infinity; MLflow stores them as such)."""
    return {k: float(v) for k, v in metrics.items() if v is not None and not isinstance(v, str)}


def _now_ms() -> int:
    return int(time.time() * 1000)
