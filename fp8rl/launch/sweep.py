"""The idempotent sweep runner behind ``fp8rl sweep`` / ``make sweep``.

1. Expand the experiment (or an explicit list of points) into resolved `RunConfig`s (Hydra compose).
2. Validate ALL of them against the config rules and the launcher (a GPU-only setting on a launcher
   without GPUs, two points that compute the same run, ...) before anything is submitted; every
   error is reported at once, each naming the point and what to change.
3. One MLflow experiment per sweep, a parent run (tag ``fp8rl.sweep``) reused across launches; the
   children nest under it and carry the sweep axes as ``sweep.<axis>`` tags.
4. Skip points whose config hash has a FINISHED run in the experiment, and points whose Slurm job is
   still queued or running; submit the rest as `TrainJob`s (checkpointable: the trainer resumes from
   ``<root>/<sweep>/<config hash>`` and continues its MLflow run).
5. Launched twice at once (two shells, two Makefiles), the launches share the points out: just before a point
   starts, a launch skips it if another process holds its run folder (`fp8rl.job.lock`), and a point taken
   between that look and its start comes back held, not failed. Each point runs once; the parent run is
   FINISHED by whichever launch sees the last point finished.

``dry_run`` stops after step 2 and the MLflow/queue lookups of step 4, and prints the plan.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8rl.choices import validated
from fp8rl.config import ConfigError, RunConfig, with_overrides
from fp8rl.identity import config_hash
from fp8rl.launch.experiment import (
    SweepDefinition,
    SweepPoint,
    axis_tag,
    expand_experiment,
    expand_points,
)
from fp8rl.launch.launchers import Launcher, check_fits, make_executor, resolve_launcher
from fp8rl.launch.parent import DESCRIPTION_TAG, ensure_parent, finish_parent, sweep_description
from fp8rl.tracking import store
from fp8rl.tracking.client import bound_mlflow_http, ensure_experiment_tag, probe_store, redact

DEFAULT_ROOT = Path("outputs/sweeps")
SLURM_POLL_S = 2.0  # seconds between squeue/sacct looks while waiting for a sweep's Slurm jobs
LIVE_SLURM_STATES = (
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "CONFIGURING",
    "COMPLETING",
    "SUSPENDED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
)


class SweepConfigError(ConfigError):
    """Some points of a sweep cannot run; nothing was submitted."""


@dataclass
class SweepRequest:
    """What to launch (the arguments of ``fp8rl sweep``)."""

    experiment: str | None = None  # file in sweeps/experiment/ (or give `points`)
    points: list[list[str]] | None = None  # explicit points: Hydra overrides per run
    overrides: list[str] = field(default_factory=list)  # applied to every point; sweeps (a=1,2) add axes
    scale: str | None = None  # "tiny" or "paper" (None: the experiment's default, tiny)
    launcher: str = "local"  # "local", "slurm" or "inline"
    profile: str | None = None  # Slurm cluster profile (slurm/profiles/<name>.yaml); default "local"
    launcher_overrides: dict[str, Any] = field(default_factory=dict)  # profile fields, e.g. {"timeout_min": 30}
    name: str | None = None  # sweep name = MLflow experiment (default: the experiment's tracking.experiment)
    root: Path = DEFAULT_ROOT  # run folders: <root>/<name>/<config hash>, submitit files in <root>/<name>/.submitit
    tracking_uri: str | None = None  # default: the config's, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
    dry_run: bool = False  # validate and print the plan; submit nothing, create nothing
    wait: bool | None = None  # wait for the jobs (default: yes for local/inline, no for Slurm)
    max_parallel: int | None = None  # local launcher: jobs at once (default: half the CPUs)
    timeout_s: float | None = None  # give up waiting after this long


@dataclass
class PlannedRun:
    """One point of the sweep and what happens to it."""

    point: SweepPoint
    cfg: RunConfig
    config_hash: str
    status: str = "new"  # new | resume | finished | in-flight (a Slurm job, or another launch holds its folder)
    job_id: str | None = None
    result: dict[str, Any] | None = None
    error: str | None = None

    @property
    def to_submit(self) -> bool:
        return self.status in ("new", "resume")

    def held_elsewhere(self) -> bool:
        """Another process holds this point's run folder now (a second launch of the sweep runs it): marked
        in-flight, and not started here."""
        from fp8rl.job.lock import held_by  # fp8rl.job imports megatron; the planner does not need it

        holder = held_by(self.cfg.trainer.out_dir)
        if holder is not None:
            self.mark_held(holder)
        return holder is not None

    def mark_held(self, holder: str) -> None:
        self.status, self.job_id, self.result = "in-flight", None, {"held_by": holder}

    def take(self, result: dict[str, Any]) -> None:
        """A job's summary; a job that found its folder held (the race with another launch) marks it in-flight."""
        if "held_by" in result:
            self.mark_held(result["held_by"])
        else:
            self.result = result


@dataclass
class SweepReport:
    name: str
    tracking_uri: str
    launcher: str
    runs: list[PlannedRun]
    experiment_id: str | None = None
    parent_run_id: str | None = None
    dry_run: bool = False

    @property
    def submitted(self) -> list[PlannedRun]:
        return [r for r in self.runs if r.job_id is not None]

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.runs)


def run_sweep(req: SweepRequest, console: Any | None = None) -> SweepReport:
    """Plan, validate, skip what is done, submit the rest; see the module docstring."""
    definition = define(req)
    launcher = resolve_launcher(req.launcher, req.profile, req.launcher_overrides, req.max_parallel)
    name = req.name or _default_name(definition)
    uri = store.absolute_tracking_uri(req.tracking_uri or _first_cfg(definition).tracking.tracking_uri)
    planned = prepare(definition, name, launcher, uri, req.root)
    report = SweepReport(name, uri, launcher.describe(), planned, dry_run=req.dry_run)
    mark_existing(report, create=not req.dry_run, definition=definition)
    mark_in_flight(report)
    if not req.dry_run:
        submit(report, launcher, req)
    print_report(report, console)
    return report


def define(req: SweepRequest) -> SweepDefinition:
    if (req.experiment is None) == (req.points is None):
        raise ConfigError("give exactly one of an experiment name or an explicit list of points")
    if req.experiment is not None:
        return expand_experiment(req.experiment, req.scale, req.overrides)
    base = [*req.overrides, *([f"scale={req.scale}"] if req.scale else [])]
    return expand_points(req.points or [], base)


def _first_cfg(definition: SweepDefinition) -> RunConfig:
    return next((p.cfg for p in definition.points if p.cfg is not None), RunConfig())


def _default_name(definition: SweepDefinition) -> str:
    name = _first_cfg(definition).tracking.experiment
    if definition.experiment is None and name == RunConfig().tracking.experiment:
        raise ConfigError("an explicit list of points needs a sweep name (--name / SweepRequest.name)")
    return name


# ------------------------------------------------------------------------------------------------ validation
def prepare(definition: SweepDefinition, name: str, launcher: Launcher, uri: str, root: Path) -> list[PlannedRun]:
    """Finalize and validate every point; raise SweepConfigError listing every bad one."""
    planned, errors = [], []
    for index, point in enumerate(definition.points):
        try:
            planned.append(_prepare_point(point, definition, name, launcher, uri, root))
        except ConfigError as err:
            errors.append(f"point {index} [{point.label}]: {err}\n    overrides: {' '.join(point.overrides)}")
    errors += _duplicates(planned)
    if errors:
        head = f"sweep {name!r}: {len(errors)} of {len(definition.points)} point(s) cannot run; nothing was submitted"
        raise SweepConfigError("\n".join([head, *errors]))
    return planned


def _prepare_point(
    point: SweepPoint, definition: SweepDefinition, name: str, launcher: Launcher, uri: str, root: Path
) -> PlannedRun:
    if point.cfg is None:
        raise ConfigError(f"does not compose: {point.error}")
    cfg = point.cfg
    tags = {
        **cfg.tracking.tags,
        store.SWEEP_TAG: name,
        "fp8rl.experiment": definition.experiment or "",
        "fp8rl.scale": definition.scale or "",
        "fp8rl.point": point.label,
        **{axis_tag(k): v for k, v in point.axes.items()},
    }
    changes = {
        "tracking.tracking_uri": uri,
        "tracking.experiment": name,
        "tracking.run_name": point.label if point.axes else None,
        "tracking.tags": tags,
        "warmstart.cache_dir": str(Path(cfg.warmstart.cache_dir).resolve()),
    }
    if launcher.cpus_per_task and not cfg.trainer.threads:
        changes["trainer.threads"] = launcher.cpus_per_task
    cfg = validated(with_overrides(cfg, changes))
    check_fits(cfg, launcher)
    digest = config_hash(cfg)
    cfg = with_overrides(cfg, {"trainer.out_dir": str((root / _safe(name) / digest).resolve())})
    return PlannedRun(point, cfg, digest)


def _duplicates(planned: list[PlannedRun]) -> list[str]:
    seen: dict[str, PlannedRun] = {}
    errors = []
    for run in planned:
        first = seen.setdefault(run.config_hash, run)
        if first is not run:
            errors.append(
                f"points [{first.point.label}] and [{run.point.label}] compute the same run (config hash "
                f"{run.config_hash}): an axis value has no effect there; drop one of them"
            )
    return errors


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


# ------------------------------------------------------------------------------------------------ what exists
def mark_existing(report: SweepReport, create: bool, definition: SweepDefinition) -> None:
    """Find the sweep's MLflow experiment and parent run; mark finished / resumable points."""
    if not create and not store.store_exists(report.tracking_uri):
        return  # a dry run creates nothing, not even an empty sqlite store
    bound_mlflow_http()  # MLflow's own retries would hang minutes on a dead server
    probe_store(report.tracking_uri, _first_cfg(definition).tracking.connect_timeout_s)
    mlflow_client = store.client(report.tracking_uri)
    report.experiment_id = store.experiment_id(mlflow_client, report.name, create=create)
    if report.experiment_id is None:
        return
    status = store.hashes_by_status(store.child_runs(mlflow_client, report.experiment_id))
    started = set().union(*status.values()) if status else set()
    for run in report.runs:
        if run.config_hash in status.get("FINISHED", set()):
            run.status = "finished"
        elif run.config_hash in started or Path(run.cfg.trainer.out_dir, "checkpoints").exists():
            run.status = "resume"
    if create:
        tags = {
            "fp8rl.experiment": definition.experiment or "",
            "fp8rl.scale": definition.scale or "",
            "fp8rl.axes": ",".join(axis_tag(a) for a in definition.axes),
        }
        if definition.experiment:
            tags[DESCRIPTION_TAG] = sweep_description(definition, len(report.runs))
            ensure_experiment_tag(mlflow_client, report.experiment_id, DESCRIPTION_TAG, tags[DESCRIPTION_TAG])
        report.parent_run_id = ensure_parent(mlflow_client, report.experiment_id, report.name, tags)
        for run in report.runs:
            run.cfg = with_overrides(run.cfg, {"tracking.parent_run_id": report.parent_run_id})
    else:
        parent = store.find_parent(mlflow_client, report.experiment_id, report.name)
        report.parent_run_id = parent.info.run_id if parent else None


def job_name(sweep: str, digest: str) -> str:
    return f"fp8rl-{_safe(sweep)}-{digest}"


def mark_in_flight(report: SweepReport) -> None:
    """Points whose Slurm job (named after sweep and config hash) is still queued or running."""
    if shutil.which("squeue") is None:
        return
    proc = subprocess.run(["squeue", "-h", "-o", "%j|%i|%T"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return
    live = {}
    for line in proc.stdout.splitlines():
        job, job_id, state = (line.split("|") + ["", "", ""])[:3]
        if state in LIVE_SLURM_STATES:
            live[job] = job_id
    for run in report.runs:
        job_id = live.get(job_name(report.name, run.config_hash))
        if job_id and run.status != "finished":
            run.status, run.job_id = "in-flight", None
            run.result = {"slurm_job": job_id}


# ------------------------------------------------------------------------------------------------ submission
class Progress:
    """One line per finished run: ``[k/n] <label> finished in 41s (elapsed 5m, ETA 12m)``.

    Kept instead of a rich progress bar: a sweep's output usually goes to a log file or a Slurm ``.out``, where
    a live bar collapses into one truncated line; a line per run reads the same everywhere. The ETA is the
    mean time per finished run times the runs left (runs of one sweep take about the same time)."""

    def __init__(self, total: int, name: str, echo=print) -> None:
        self.total, self.name, self.echo = total, name, echo
        self.done, self.started = 0, time.monotonic()
        self.job_started: dict[int, float] = {}

    def start(self, run: PlannedRun) -> None:
        self.job_started[id(run)] = time.monotonic()

    def finish(self, run: PlannedRun) -> None:
        self.done += 1
        now = time.monotonic()
        took = now - self.job_started.get(id(run), self.started)
        elapsed = now - self.started
        eta = elapsed / self.done * (self.total - self.done)
        if run.error:
            outcome = f"FAILED ({run.error[-200:]})"
        elif run.result and "held_by" in run.result:
            outcome = "skipped: another launch runs it"
        else:
            outcome = "finished"
        self.echo(
            f"[{self.name} {self.done}/{self.total}] {run.point.label} {outcome} in {_duration(took)} "
            f"(elapsed {_duration(elapsed)}, ETA {_duration(eta)})",
            flush=True,
        )


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds}s" if seconds < 120 else f"{seconds // 60}m{seconds % 60:02d}s"


def submit(report: SweepReport, launcher: Launcher, req: SweepRequest) -> None:
    todo = [r for r in report.runs if r.to_submit]
    if todo:
        # A fresh submitit folder per launch: Slurm job ids restart at 1 when its state is wiped.
        launch_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        folder = req.root.resolve() / _safe(report.name) / ".submitit" / launch_id
        _write_plan(report, folder)
        wait = req.wait if req.wait is not None else launcher.kind != "slurm"
        progress = Progress(len(todo), report.name)
        if launcher.kind == "inline":
            _run_inline(todo, progress)
        elif launcher.kind == "local":
            executor = make_executor(launcher, folder, f"fp8rl-{report.name}")
            _run_pool(todo, executor, launcher.max_parallel, req, progress)
        else:
            _submit_slurm(todo, report.name, launcher, folder, wait, req.timeout_s, progress)
    _finish_parent(report)


def _write_plan(report: SweepReport, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    plan = [
        {
            "label": r.point.label,
            "config_hash": r.config_hash,
            "status": r.status,
            "overrides": r.point.overrides,
            "out_dir": r.cfg.trainer.out_dir,
        }
        for r in report.runs
    ]
    (folder / "plan.json").write_text(json.dumps({"sweep": report.name, "runs": plan}, indent=2))


def _run_inline(todo: list[PlannedRun], progress: Progress | None = None) -> None:
    from fp8rl.launch.train_job import TrainJob, job_config

    for run in todo:
        if run.held_elsewhere():
            if progress:
                progress.finish(run)
            continue
        run.job_id = "inline"
        if progress:
            progress.start(run)
        try:
            run.take(TrainJob(job_config(run.cfg))())
        except Exception as err:  # noqa: BLE001 - one failed point must not stop the others
            run.error = redact(f"{type(err).__name__}: {err}")
        if progress:
            progress.finish(run)


def _run_pool(
    todo: list[PlannedRun], executor: Any, max_parallel: int, req: SweepRequest, progress: Progress | None = None
) -> None:
    """Local executor: at most `max_parallel` jobs at once, waiting for all. submitit's LocalExecutor has no
    ``array_parallelism`` (``map_array`` starts every job at once), so the pool keeps the limit itself and
    submits the next point as soon as one finishes."""
    from fp8rl.launch.train_job import TrainJob, job_config

    queue, running = list(todo), []
    deadline = time.monotonic() + req.timeout_s if req.timeout_s else None
    while queue or running:
        while queue and len(running) < max_parallel:
            run = queue.pop(0)
            if run.held_elsewhere():
                if progress:
                    progress.finish(run)
                continue
            job = executor.submit(TrainJob(job_config(run.cfg)))
            run.job_id = str(job.job_id)
            running.append((run, job))
            if progress:
                progress.start(run)
        running = _collect_done(running, progress)
        _check_deadline(deadline, running)
        time.sleep(0.5 if running else 0)


def _submit_slurm(
    todo: list[PlannedRun],
    sweep: str,
    launcher: Launcher,
    folder: Path,
    wait: bool,
    timeout_s: float | None,
    progress: Progress | None = None,
) -> None:
    """One Slurm job per point, named after the sweep and config hash (re-launches find it in squeue), waited
    for with submitit's ``as_completed``. Not a job array: an array's tasks share one job name, and a re-launch
    recognises a queued or running point in squeue by its name (`mark_in_flight`)."""
    from fp8rl.launch.train_job import TrainJob, job_config

    jobs = []
    for run in todo:
        executor = make_executor(launcher, folder, job_name(sweep, run.config_hash))
        job = executor.submit(TrainJob(job_config(run.cfg)))
        run.job_id = str(job.job_id)
        jobs.append((run, job))
    if not wait:
        return
    from submitit.helpers import as_completed

    by_job = {id(job): run for run, job in jobs}
    try:
        for job in as_completed([job for _, job in jobs], timeout=timeout_s or None, poll_frequency=SLURM_POLL_S):
            _collect_done([(by_job[id(job)], job)], progress)
    except TimeoutError as err:
        ids = ", ".join(str(job.job_id) for _, job in jobs if not job.done())
        raise TimeoutError(f"jobs {ids} still running after the sweep's timeout; they keep running") from err


def _collect_done(jobs: list[tuple[PlannedRun, Any]], progress: Progress | None = None) -> list[tuple[PlannedRun, Any]]:
    pending = []
    for run, job in jobs:
        if not job.done():
            pending.append((run, job))
            continue
        try:
            run.take(job.results()[0])  # a job of several tasks (CPU ranks, GPUs): rank 0's
        except Exception as err:  # noqa: BLE001 - submitit re-raises the job's exception with its traceback
            run.error = redact(f"{type(err).__name__}: {str(err)[-3000:]}")
        if progress:
            progress.finish(run)
    return pending


def _check_deadline(deadline: float | None, pending: list[tuple[PlannedRun, Any]]) -> None:
    if deadline is not None and pending and time.monotonic() > deadline:
        ids = ", ".join(str(job.job_id) for _, job in pending)
        raise TimeoutError(f"jobs {ids} still running after the sweep's timeout; they keep running")


def _finish_parent(report: SweepReport) -> None:
    if report.parent_run_id is None:
        return
    _mark_finished_elsewhere(report)
    if any(r.error for r in report.runs):
        status = "FAILED"
    elif all(r.status == "finished" or (r.result is not None and r.status != "in-flight") for r in report.runs):
        status = "FINISHED"
    else:
        status = "RUNNING"
    finish_parent(store.client(report.tracking_uri), report.parent_run_id, status)


def _mark_finished_elsewhere(report: SweepReport) -> None:
    """Points another launch ran (held while this one looked) that have FINISHED since: finished here too, so the
    launch that ends last closes the parent run."""
    held = [r for r in report.runs if r.status == "in-flight" and r.result and "held_by" in r.result]
    if not held or report.experiment_id is None:
        return
    mlflow_client = store.client(report.tracking_uri)
    finished = store.hashes_by_status(store.child_runs(mlflow_client, report.experiment_id)).get("FINISHED", set())
    for run in held:
        if run.config_hash in finished:
            run.status = "finished"


def wide_console() -> Any:
    """A rich console that does not squeeze tables to 80 columns when the output is a file or a pipe."""
    import sys

    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 200)


# ------------------------------------------------------------------------------------------------ output
def print_report(report: SweepReport, console: Any | None = None) -> None:
    from rich.table import Table

    console = console or wide_console()
    verb = "would submit" if report.dry_run else "submitted"
    table = Table(title=f"sweep {report.name} ({report.launcher}; MLflow {redact(report.tracking_uri)})")
    for column in ("#", "point", "config hash", "status", "job", "result"):
        table.add_column(column)
    for index, run in enumerate(report.runs):
        table.add_row(
            str(index), run.point.label, run.config_hash, _status(run, report.dry_run), run.job_id or "-", _outcome(run)
        )
    console.print(table)
    todo = sum(r.to_submit for r in report.runs)
    console.print(
        f"{report.count('finished')} finished (skipped), {report.count('in-flight')} in flight (skipped), "
        f"{todo} {verb}" + (f"; parent run {report.parent_run_id}" if report.parent_run_id else "")
    )
    if report.dry_run:
        console.print(workload_table(report.runs))
        for run in report.runs:
            if run.to_submit:
                console.print(f"  python -m fp8rl.train {' '.join(run.point.overrides)}", soft_wrap=True)


def workload_table(runs: list[PlannedRun]) -> Any:
    """What each run trains on: model, training data, evaluation sets, trainer layout (the dry run's check that
    a sweep is the experiment meant)."""
    from rich.table import Table

    table = Table(title="workload")
    for column in ("#", "model", "train data", "evaluation", "layout"):
        table.add_column(column)
    for index, run in enumerate(runs):
        table.add_row(str(index), *workload(run.cfg))
    return table


def workload(cfg: RunConfig) -> tuple[str, str, str, str]:
    """(model, train data, evaluation, layout) of one run, in words."""
    from fp8rl.preflight import layout_for

    t, e = cfg.task, cfg.eval
    model = cfg.model.hf_path or f"{cfg.model.preset} (preset)"
    if t.name == "math":
        data = f"{t.dataset}" + (f" from {t.path}" if t.path else " (hub)")
        sets = ", ".join(t.eval_sets) or "none"
    else:
        data = f"{t.name} ({t.num_train} problems)"
        sets = f"{t.name} held-out"
    evaluation = f"{sets}; {e.size} problems x {e.samples} samples every {e.every} steps"
    layout = layout_for(cfg, world_size=1) if cfg.model.device == "cuda" else None
    where = "CPU, one process" if layout is None else layout.describe().split(";")[0]
    return model, data, evaluation, where


def _status(run: PlannedRun, dry_run: bool) -> str:
    if not run.to_submit:
        return run.status
    resume = run.status == "resume"
    if dry_run:
        return "would resume" if resume else "would start"
    return "resumed" if resume else "started"


def _outcome(run: PlannedRun) -> str:
    if run.error:
        return "[red]" + run.error.strip().splitlines()[-1][:100]
    if not run.result:
        return ""
    if "slurm_job" in run.result:
        return f"slurm job {run.result['slurm_job']}"
    if "held_by" in run.result:
        return "another launch runs it: " + run.result["held_by"].split(": the same run")[0][:100]
    final = run.result.get("final_eval") or {}
    acc = final.get("eval/accuracy")
    return f"run {run.result.get('run_id')}" + (f", eval/accuracy {acc:.3f}" if acc is not None else "")
