"""`run(cfg)`: one complete RL job with tracking, checkpoints, resume, eval and a progress bar."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import torch

from fp8rl.config import RunConfig, config_hash, flatten, to_dict, validate  # noqa: F401 - config_hash re-exported
from fp8rl.tracking import MlflowTracker, NullTracker, Tracker, provenance, resolve_tracking_uri
from fp8rl.trainer import checkpoint as ckpt
from fp8rl.trainer.loop import RLTrainer, RunSummary, TrainingDiverged

log = logging.getLogger(__name__)


def default_run_name(cfg: RunConfig) -> str:
    p = cfg.precision
    precision = p.mode if p.mode == "bf16" else f"{p.mode}-{p.recipe}"
    return f"{cfg.algo.name}-{precision}-{cfg.clipping.policy}-s{cfg.trainer.seed}"


def make_tracker(cfg: RunConfig, resume_run_id: str | None) -> Tracker:
    if not cfg.tracking.enabled:
        return NullTracker()
    t = cfg.tracking
    tags = {
        "fp8rl.config_hash": config_hash(cfg),
        "algo": cfg.algo.name,
        "precision": cfg.precision.mode,
        "recipe": cfg.precision.recipe if cfg.precision.mode != "bf16" else "none",
        "clipping": cfg.clipping.policy,
        "rollout_correction": cfg.clipping.rollout_correction,
        "seed": str(cfg.trainer.seed),
        **t.tags,
    }
    tracker = MlflowTracker(
        tracking_uri=resolve_tracking_uri(t.tracking_uri),
        experiment=t.experiment,
        run_name=t.run_name or default_run_name(cfg),
        buffer_path=Path(cfg.trainer.out_dir) / "metrics_buffer.jsonl",
        resume_run_id=resume_run_id,
        parent_run_id=t.parent_run_id,
        tags=tags,
    )
    if resume_run_id is None:
        tracker.log_params(flatten(to_dict(cfg)))
        tracker.set_tags(provenance())
        config_path = Path(cfg.trainer.out_dir) / "resolved_config.json"
        config_path.parent.mkdir(parents=True, exist_ok=True)
        config_path.write_text(json.dumps(to_dict(cfg), indent=2, default=str))
        tracker.log_artifact(config_path)
    return tracker


def _progress():
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("step {task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )


def run(cfg: RunConfig, tracker: Tracker | None = None, stop_after: int | None = None) -> RunSummary:
    """Run (or resume) the job `cfg` describes. `stop_after` ends early after that many steps (tests)."""
    validate(cfg, cuda_available=torch.cuda.is_available())
    latest = ckpt.latest_checkpoint(cfg.trainer.out_dir)
    state = ckpt.load_checkpoint(latest) if latest else None
    if state is not None and state.get("config") != dataclasses.asdict(cfg):
        raise ValueError(
            f"{cfg.trainer.out_dir} holds a checkpoint of a different config; use another trainer.out_dir "
            "or delete the old one"
        )
    resume_run_id = state["run_id"] if state else None
    tracker = tracker or make_tracker(cfg, resume_run_id)
    trainer = RLTrainer(cfg, tracker)
    if state is not None:
        trainer.load_state_dict(state)
        log.info("resumed from %s at step %d", latest, trainer.step)
    summary = RunSummary(run_id=tracker.run_id, steps_done=trainer.step, final_eval={}, out_dir=cfg.trainer.out_dir)
    status = "FAILED"
    try:
        _loop(trainer, tracker, summary, stop_after)
        status = "FINISHED" if trainer.step >= cfg.trainer.steps else "RUNNING"
    except (KeyboardInterrupt, SystemExit):  # SystemExit: submitit's exit after a preemption/timeout checkpoint
        status = "KILLED"
        raise
    finally:
        trainer.close()
        if status != "RUNNING":
            tracker.finish(status)
    return summary


def _loop(trainer: RLTrainer, tracker: Tracker, summary: RunSummary, stop_after: int | None) -> None:
    cfg = trainer.cfg
    total = cfg.trainer.steps
    if trainer.step == 0 and tracker.last_logged_step() < 0:
        _log(tracker, summary, trainer.evaluate(), 0)
    started, steps_run = time.perf_counter(), 0
    with _progress() as progress:
        bar = progress.add_task(default_run_name(cfg), total=total, completed=trainer.step, info="")
        while trainer.step < total and (stop_after is None or steps_run < stop_after):
            step = trainer.step
            result = trainer.train_step(step)
            trainer.bad_steps_in_a_row = 0 if result.good else trainer.bad_steps_in_a_row + 1
            result.metrics["train/skipped"] = 0.0 if result.good else 1.0
            trainer.step = step + 1
            if _eval_due(cfg, trainer.step):
                result.metrics.update(trainer.evaluate())
            _log(tracker, summary, result.metrics, trainer.step)
            if trainer.bad_steps_in_a_row > cfg.trainer.max_bad_steps:
                raise TrainingDiverged(
                    f"{trainer.bad_steps_in_a_row} non-finite steps in a row (limit trainer.max_bad_steps="
                    f"{cfg.trainer.max_bad_steps}); the last good checkpoint in {cfg.trainer.out_dir} is intact"
                )
            if result.good and _checkpoint_due(cfg, trainer.step):
                trainer.save()
            steps_run += 1
            info = (
                f"reward {result.metrics.get('rollout/reward', 0):.3f} "
                f"entropy {result.metrics.get('rollout/entropy', 0):.3f} "
                f"{(time.perf_counter() - started) / steps_run:.1f}s/step"
            )
            progress.update(bar, completed=trainer.step, info=info)
    summary.steps_done = trainer.step
    summary.final_eval = {
        k: v for k, v in (summary.history[-1] if summary.history else {}).items() if k.startswith("eval/")
    }


def _eval_due(cfg: RunConfig, done: int) -> bool:
    every = cfg.trainer.eval_every
    return done == cfg.trainer.steps or (every > 0 and done % every == 0)


def _checkpoint_due(cfg: RunConfig, done: int) -> bool:
    every = cfg.trainer.checkpoint_every
    return done == cfg.trainer.steps or (every > 0 and done % every == 0)


def _log(tracker: Tracker, summary: RunSummary, metrics: dict[str, float], step: int) -> None:
    tracker.log_metrics(metrics, step)
    summary.history.append({"step": float(step), **metrics})
