"""`run_job(cfg)`: the one place where a training run is set up, on every rank of a job.

In order: torch.distributed from the launcher's environment (torchrun, Slurm) -> preflight (layout for the
world size, the machine) -> the task with its data read and checked (a bad file, an empty set, prompts too long
for the sequence: refused before the run folder and the MLflow run exist) -> process settings -> logging ->
megatron's process state with the run's layout -> the run folder (resume or start fresh) -> provenance and the
tracker (rank 0; a run already finished is not run again) -> the parts (policy, optimizer, engines) -> the
trainer's loop. However
it ends, the MLflow run is marked: FINISHED, FAILED (an exception), KILLED (SIGINT/SIGTERM), or SCHEDULED
(a Slurm preemption or time limit that submitit requeues: the next attempt resumes it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fp8rl import algos
from fp8rl.choices import validated
from fp8rl.config import ConfigError, RunConfig, flatten, to_dict
from fp8rl.identity import config_hash, default_run_name, run_dir
from fp8rl.job import signals
from fp8rl.job.distributed import DistEnv, dist_env_from_environ, init_distributed, shutdown_distributed
from fp8rl.job.lock import LOCK_FILES, RunFolderInUse, run_folder_lock
from fp8rl.job.parts import PreparedTask, build_parts, prepare_task
from fp8rl.job.process import apply_process_settings, close_log_file, setup_logging
from fp8rl.models.dims import ParallelDims
from fp8rl.preflight import check_environment, run_layout
from fp8rl.tracking import (
    MlflowTracker,
    NullTracker,
    RunSpec,
    Tracker,
    provenance,
    redact,
    resolve_tracking_uri,
    store,
)
from fp8rl.tracking.datasets import task_datasets
from fp8rl.trainer import checkpoint as ckpt
from fp8rl.trainer.fit import RunSummary, fit
from fp8rl.trainer.loop import RLTrainer, StepSettings

log = logging.getLogger("fp8rl.job")


def run_job(
    cfg: RunConfig,
    *,
    tracker: Tracker | None = None,
    stop_after: int | None = None,
    hydra_dir: str | Path | None = None,
    submitted_at: float | None = None,
) -> RunSummary:
    """Run (or resume) the job `cfg` describes (module docstring). `tracker` replaces MLflow (tests);
    `stop_after` ends after that many steps, leaving the run resumable; `hydra_dir` holds Hydra's
    ``.hydra/*.yaml`` (logged as artifacts)."""
    env = dist_env_from_environ()
    started_distributed = init_distributed(env)
    try:
        return _run(cfg, env, tracker, stop_after, hydra_dir, submitted_at)
    finally:
        if started_distributed:
            shutdown_distributed()


def _run(cfg, env: DistEnv, tracker, stop_after, hydra_dir, submitted_at) -> RunSummary:
    out_dir = run_dir(cfg)
    layout = run_layout(cfg, env.world_size)
    validated(cfg)  # refusals first (the registries' rules, then the machine's): no run folder behind
    check_environment(cfg)
    prepared = prepare_task(cfg, layout)  # and bad data: files read and checked, prompts fitted, sets not empty
    with contextlib.ExitStack() as held:
        refusal = None
        if env.rank == 0:  # before anything is written to the folder: one writer per run folder
            try:
                held.enter_context(run_folder_lock(out_dir))
            except RunFolderInUse as err:
                refusal = str(err)
        refusal = _broadcast(refusal)
        if refusal is not None:
            raise RunFolderInUse(refusal)
        return _run_in_folder(cfg, env, out_dir, layout, prepared, tracker, stop_after, hydra_dir, submitted_at)


def _run_in_folder(
    cfg, env: DistEnv, out_dir: str, layout, prepared: PreparedTask, tracker, stop_after, hydra_dir, submitted_at
) -> RunSummary:
    apply_process_settings(cfg.trainer)
    setup_logging(out_dir, env.rank)
    prepared.log_dropped()
    from fp8rl.models.runtime import init_megatron

    init_megatron(layout.tensor_parallel, layout.pipeline_parallel, seed=cfg.warmstart.seed)
    dims = ParallelDims.current(layout)
    state = run_dir_state(cfg, out_dir, env.rank, env.world_size)
    name = cfg.tracking.run_name or default_run_name(cfg)
    if tracker is None:
        tracker, finished = (NullTracker(), None)
        if env.rank == 0:
            tracker, finished = make_tracker(cfg, out_dir, name, state, env, hydra_dir)
        finished = _broadcast(finished)
        if finished is not None:
            log.info("run %s already finished (MLflow run %s): nothing to do", name, finished)
            close_log_file(out_dir)
            return RunSummary(finished, cfg.trainer.steps, {}, out_dir=out_dir)
    status = "FAILED"
    with signals.terminate_as_exception(on_stuck=lambda: tracker.finish("KILLED")) as stopping:
        try:
            device = _device(cfg)
            parts, weights = build_parts(cfg, dims, device, prepared)
            where = layout.describe(cfg.model.device, cfg.rollout.engine)
            log.info("%s: %s; policy from %s; layout %s", name, out_dir, weights.source, where)
            log_start_weights(tracker, out_dir, weights, env.rank)
            if state is None:  # once per run, at its start
                tracker.log_datasets(lambda: task_datasets(cfg.task, parts.task.train_problems, parts.task.eval_sets))
            trainer = RLTrainer(parts, StepSettings.of(cfg))
            if state is not None:
                trainer.load_state_dict(state)
                log.info("resumed at step %d", trainer.step)
            meta = {"config_hash": config_hash(cfg), "config": to_dict(cfg), "run_id": tracker.run_id}
            try:
                summary = fit(trainer, tracker, out_dir, name, meta, stop_after, submitted_at)
            finally:
                getattr(parts.engine, "close", lambda: None)()
            status = "FINISHED" if summary.steps_done >= cfg.trainer.steps else "SCHEDULED"
            summary.run_id = tracker.run_id
            return summary
        except (KeyboardInterrupt, SystemExit):
            status = "SCHEDULED" if signals.requeue_requested() else "KILLED"
            raise
        finally:
            stopping.defer()  # the run is ended whatever signal comes now (torchrun's, when another rank died)
            tracker.finish(status)
            if status != "FINISHED":
                log.info("run %s ended %s; re-running the same command resumes it from %s", name, status, out_dir)
            close_log_file(out_dir)


def log_start_weights(tracker, out_dir: str, weights, rank: int) -> None:
    """Where the policy started, on every run: ``start_weights.json`` (the source, and for a warm start its cache
    key, steps, held-out accuracy and the CPU and kernels that trained it), an artifact of the MLflow run."""
    if rank != 0:
        return
    path = Path(out_dir) / "start_weights.json"
    path.write_text(json.dumps({"source": weights.source, **weights.details}, indent=2, default=str) + "\n")
    tracker.log_artifact(path)


def build_trainer(cfg: RunConfig) -> RLTrainer:
    """The trainer of `cfg` in this process (every rank, under torchrun), without a tracker or a run folder:
    for studies, benchmarks and tests that drive steps themselves."""
    import torch.distributed as dist

    from fp8rl.models.runtime import init_megatron

    apply_process_settings(cfg.trainer)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    layout = run_layout(cfg, world_size)
    validated(cfg)
    check_environment(cfg)
    init_megatron(layout.tensor_parallel, layout.pipeline_parallel, seed=cfg.warmstart.seed)
    parts, _ = build_parts(cfg, ParallelDims.current(layout), _device(cfg))
    return RLTrainer(parts, StepSettings.of(cfg))


def _device(cfg: RunConfig) -> torch.device:
    if cfg.model.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------- run folder
def prepare_run_dir(cfg: RunConfig, out_dir: str, world_size: int = 1) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from, (path, rank 0's state), or None for a fresh start.
    ``trainer.resume=false`` moves an earlier run's folder aside (kept, never deleted); a checkpoint of
    another config, or of another number of ranks, is refused."""
    folder = Path(out_dir)
    earlier = [p for p in folder.iterdir() if p.name not in LOCK_FILES] if folder.exists() else []
    if not cfg.trainer.resume and earlier:
        aside = folder.with_name(f"{folder.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
        aside.mkdir()
        for path in earlier:  # the folder's lock stays: this run holds it
            shutil.move(str(path), aside / path.name)
        log.info("trainer.resume=false: moved the earlier run in %s to %s", folder, aside)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        found = ckpt.latest_good_checkpoint(out_dir, world_size)
    except ckpt.CheckpointLayoutMismatch as err:
        raise ConfigError(str(err)) from err
    if found is None:
        return None
    path, state = found
    if state.get("config_hash") != config_hash(cfg):
        raise ConfigError(
            f"{out_dir} holds a checkpoint of a different config ({path.name}); use another trainer.out_dir, "
            "or trainer.resume=false to move it aside and start fresh"
        )
    return path, state


def run_dir_state(cfg: RunConfig, out_dir: str, rank: int, world_size: int = 1) -> dict[str, Any] | None:
    """Rank 0 prepares the folder (`prepare_run_dir`) and picks the checkpoint; every rank then reads its own
    file of it. A refusal on rank 0 (bad folder, other config) is raised on every rank."""
    outcome: Any = None
    if rank == 0:
        try:
            outcome = prepare_run_dir(cfg, out_dir, world_size)
        except (ConfigError, ckpt.CorruptCheckpoint) as err:
            outcome = err
    outcome = _broadcast(outcome) if world_size > 1 else outcome
    if isinstance(outcome, Exception):
        raise outcome
    if outcome is None:
        return None
    path, state = outcome
    return state if rank == 0 else ckpt.load_checkpoint(ckpt.shard_path(Path(path), rank))


def _broadcast(value: Any) -> Any:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------------------------------------- tracking
def make_tracker(
    cfg: RunConfig, out_dir: str, name: str, state: dict | None, env: DistEnv, hydra_dir: str | Path | None
) -> tuple[Tracker, str | None]:
    """(tracker, None), or (NullTracker, run id) when MLflow already has this config finished."""
    if not cfg.tracking.enabled:
        return NullTracker(), None
    uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    digest = config_hash(cfg)
    finished, unfinished = existing_runs(cfg, uri, digest)
    if finished and (state is None or state.get("step", 0) >= cfg.trainer.steps):
        return NullTracker(), finished  # re-opening it would only move its end time (a re-run of `make demo`)
    resume_run_id = (state or {}).get("run_id") or unfinished
    spec = RunSpec(
        tracking_uri=uri,
        experiment=cfg.tracking.experiment,
        run_name=name,
        tags=run_tags(cfg, digest, env, state),
        params=flatten(to_dict(cfg)),
        description=describe(cfg, name),
        parent_run_id=cfg.tracking.parent_run_id,
        resume_run_id=resume_run_id,
        artifacts=run_artifacts(cfg, out_dir, hydra_dir),
        attempt_tags=attempt_tags(env, state),
    )
    tracker = MlflowTracker(spec, out_dir, cfg.tracking.connect_timeout_s, cfg.tracking.offline)
    return tracker, None


def existing_runs(cfg: RunConfig, uri: str, digest: str) -> tuple[str | None, str | None]:
    """(a FINISHED run of this config, else None; the newest unfinished one, else None), under the same
    parent run. Looked up in MLflow as well as in the checkpoint, so a job killed before its first checkpoint
    continues its run instead of opening a second one."""
    if not store.store_exists(uri):
        return None, None
    try:
        client = store.client(uri)
        exp_id = store.experiment_id(client, cfg.tracking.experiment, create=False)
        if exp_id is None:
            return None, None
        found = store.child_runs(client, exp_id, config_hash=digest, parent_id=cfg.tracking.parent_run_id)
    except Exception as err:  # noqa: BLE001 - the tracker's own probe reports an unreachable store clearly
        log.warning("could not look up earlier runs in %s: %s", redact(uri), redact(str(err)))
        return None, None
    finished = next((r.info.run_id for r in found if r.info.status == "FINISHED"), None)
    unfinished = next((r.info.run_id for r in found if r.info.status != "FINISHED"), None)
    return finished, unfinished


def run_tags(cfg: RunConfig, digest: str, env: DistEnv, state: dict | None) -> dict[str, str]:
    """Identity, the arm's axes, the attempt, and provenance (recorded after the process settings)."""
    origin = provenance()
    return {
        store.HASH_TAG: digest,
        "algo": cfg.algo.name,
        "precision": cfg.precision.mode,
        "recipe": cfg.precision.recipe if cfg.precision.mode != "bf16" else "none",
        "clipping": cfg.clipping.policy,
        "rollout_correction": cfg.clipping.rollout_correction,
        "seed": str(cfg.trainer.seed),
        **cfg.tracking.tags,
        **origin,
        **source_tags(origin["git_sha"]),
    }


def source_tags(git_sha: str) -> dict[str, str]:
    """MLflow's own source tags, set by the job: MLflow reads them from ``sys.argv[0]`` and its checkout, which
    under submitit are ``_submit.py`` in site-packages (no git commit); every sweep run showed that."""
    command = shown_command()
    if not command.startswith(("python -m fp8rl", "fp8rl")):
        command = "fp8rl.job.run_job (a submitit job of an fp8rl sweep)"
    return {
        "mlflow.source.name": command,
        "mlflow.source.type": "JOB" if "SLURM_JOB_ID" in os.environ else "LOCAL",
        "mlflow.source.git.commit": git_sha,
    }


def attempt_tags(env: DistEnv, state: dict | None) -> dict[str, str]:
    """Where this attempt starts (set again on every resume): the checkpoint step, Slurm's restart count."""
    return {
        "fp8rl.world_size": str(env.world_size),
        "fp8rl.resumed_from_step": str((state or {}).get("step", 0)),
        "fp8rl.slurm_restarts": os.environ.get("SLURM_RESTART_COUNT", "0"),
    }


def describe(cfg: RunConfig, name: str) -> str:
    """The run's description (MLflow's note): the arm, what differs from BF16, the command."""
    p, c = cfg.precision, cfg.clipping
    if p.mode == "bf16":
        arm = "BF16 rollout and training (the baseline)"
    elif p.mode == "fp8_rollout":
        arm = f"FP8 {p.recipe} rollout, BF16 training"
    else:
        arm = f"full-pipeline FP8 {p.recipe} (rollout and both trainer forwards)"
    clip = "Calibrated Clipping" if algos.get_clip_bound_policy(c.policy).calibrates else "standard clip bounds"
    correction = "" if c.rollout_correction == "none" else f" + {c.rollout_correction}"
    command = shown_command()
    return (
        f"**{name}**: {cfg.algo.name.upper()} on {cfg.task.name} with {arm}, {clip}{correction}; "
        f"{cfg.trainer.steps} steps, seed {cfg.trainer.seed}.\n\nCommand: `{command}`"
    )


def shown_command() -> str:
    """The command line as typed: ``python -m fp8rl.demo``, ``fp8rl sweep ...``, ``python -m fp8rl.train ...``
    (no interpreter or script paths of this machine)."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    program = f"python -m {main_spec.name.removesuffix('.__main__')}" if main_spec else Path(sys.argv[0]).name
    return redact(" ".join([program, *sys.argv[1:]])).replace(f"{Path.cwd()}/", "")  # paths relative to cwd


def run_artifacts(cfg: RunConfig, out_dir: str, hydra_dir: str | Path | None) -> list[tuple[str, str | None]]:
    """resolved_config.json, the command line, and Hydra's config files when the run came through Hydra."""
    folder = Path(out_dir)
    resolved = folder / "resolved_config.json"
    resolved.write_text(redact(json.dumps(to_dict(cfg), indent=2, default=str)))
    command = folder / "command.txt"
    command.write_text(redact(" ".join([sys.executable, *sys.argv])) + "\n")
    artifacts: list[tuple[str, str | None]] = [(str(resolved), None), (str(command), None)]
    for source in sorted(Path(hydra_dir, ".hydra").glob("*.yaml")) if hydra_dir else []:
        copy = folder / "hydra" / source.name  # credentials in an override (a tracking URI) never leave the host
        copy.parent.mkdir(exist_ok=True)
        copy.write_text(redact(source.read_text()))
        artifacts.append((str(copy), "hydra"))
    return artifacts
