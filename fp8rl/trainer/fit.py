"""The step loop around `RLTrainer.train_step`: evaluation and checkpoint cadence, non-finite steps, one log
line per step, metrics to the tracker.

A non-finite step is rolled back as a whole by the trainer (no partial mini-batch updates kept) and
counted; ``trainer.max_bad_steps`` = N stops the run at the N-th non-finite step in a row (N = 0: the
first), with the last good checkpoint intact. Each step prints one line through Python ``logging``
(stdout and ``train.log``, so it reaches a Slurm job's ``.out``); a rich progress bar is added only on an
interactive terminal.
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8rl.algos.calibration import CalibStatus
from fp8rl.tracking import Tracker
from fp8rl.trainer import checkpoint as ckpt
from fp8rl.trainer.export import export_hf_checkpoint
from fp8rl.trainer.loop import RLTrainer, StepResult
from fp8rl.trainer.shadow import close_figure, ratio_histogram_figure

log = logging.getLogger("fp8rl.train")
CALIB_FLAG_NAMES = tuple(flag.name.lower() for flag in CalibStatus if flag is not CalibStatus.OK)
LINE_KEYS = (  # (metric, label, format) of the per-step log line
    ("rollout/reward", "reward", "{:.3f}"),
    ("rollout/entropy", "entropy", "{:.3f}"),
    ("clip/low_neg", "low_neg", "{:.4f}"),
    ("clip/bound_low", "bounds", "{:.3f}"),
    ("eval/accuracy", "eval", "{:.3f}"),
)


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row; the last good checkpoint is intact."""


@dataclass
class RunSummary:
    run_id: str | None
    steps_done: int
    final_eval: dict[str, float]
    history: list[dict[str, float]] = field(default_factory=list)
    out_dir: str = ""


def fit(
    trainer: RLTrainer,
    tracker: Tracker,
    out_dir: str,
    run_name: str,
    meta: dict[str, Any] | None = None,
    stop_after: int | None = None,
    submitted_at: float | None = None,
) -> RunSummary:
    """Train from `trainer.step` to ``trainer.steps``, checkpointing into `out_dir` (with `meta`: the config
    and its hash, the MLflow run id); `stop_after` ends early after that many steps (tests).

    Adds ``time/tracking_log`` (seconds the previous step's log call blocked the loop) and, on the first step
    of a launched job, ``launch/submit_to_first_step_s`` (from `submitted_at`, the job's submission)."""
    cfg = trainer.cfg
    summary = RunSummary(run_id=tracker.run_id, steps_done=trainer.step, final_eval={}, out_dir=out_dir)
    log_seconds = None
    rank, world_size = _rank_and_world()
    if _same_on_every_rank(trainer.step == 0 and tracker.last_logged_step() < 0):
        evaluation = trainer.dims.mean_of_floats(trainer.evaluate())
        _log_samples(tracker, out_dir, trainer.evaluator.samples, 0, rank)
        log_started = time.perf_counter()
        _log(tracker, summary, evaluation, 0)
        log_seconds = time.perf_counter() - log_started
    started, steps_run = time.perf_counter(), 0
    with _progress(run_name, cfg.trainer.steps, trainer.step) as bar:
        while trainer.step < cfg.trainer.steps and (stop_after is None or steps_run < stop_after):
            step_started = time.time()
            result = trainer.train_step(trainer.step)
            if submitted_at is not None and steps_run == 0:
                result.metrics["launch/submit_to_first_step_s"] = step_started - submitted_at
            if log_seconds is not None:
                result.metrics["time/tracking_log"] = log_seconds
            trainer.step += 1
            trainer.bad_steps_in_a_row = 0 if result.good else trainer.bad_steps_in_a_row + 1
            if _eval_due(cfg, trainer.step):
                result.metrics.update(trainer.evaluate())
                _log_samples(tracker, out_dir, trainer.evaluator.samples, trainer.step, rank)
            metrics = trainer.dims.mean_of_floats(result.metrics)
            log_started = time.perf_counter()
            _log(tracker, summary, metrics, trainer.step)
            log_seconds = time.perf_counter() - log_started
            _log_histograms(tracker, result)
            steps_run += 1
            seconds_per_step = (time.perf_counter() - started) / steps_run
            log.info(step_line(trainer.step, cfg.trainer.steps, metrics, seconds_per_step))
            bar(trainer.step)
            if not result.good and trainer.bad_steps_in_a_row >= max(cfg.trainer.max_bad_steps, 1):
                raise TrainingDiverged(
                    f"{trainer.bad_steps_in_a_row} non-finite step(s) in a row (limit trainer.max_bad_steps="
                    f"{cfg.trainer.max_bad_steps}); the last good checkpoint in {out_dir} is intact"
                )
            if result.good and _checkpoint_due(cfg, trainer.step):
                state = {**trainer.state_dict(), **(meta or {})}
                ckpt.save_checkpoint(out_dir, trainer.step, state, cfg.trainer.keep_checkpoints, rank, world_size)
            if _every(cfg.trainer.export_every, trainer.step):
                folder = Path(out_dir) / "hf" / f"step_{trainer.step:06d}"
                export_hf_checkpoint(trainer.policy, trainer.task.tokenizer, folder, rank)
    summary.steps_done = trainer.step
    last = summary.history[-1] if summary.history else {}
    summary.final_eval = {k: v for k, v in last.items() if k.startswith("eval/")}
    return summary


def step_line(step: int, total: int, metrics: dict[str, float], seconds_per_step: float) -> str:
    """``step 3/40 | reward 0.812 | entropy 0.213 | low_neg 0.0123 | bounds 0.800/1.200 | 1.2 s/step``, with
    ``calibration ok`` (or the flags that fired) on a calibration step."""
    parts = [f"step {step}/{total}"]
    for key, label, fmt in LINE_KEYS:
        if key not in metrics:
            continue
        value = fmt.format(metrics[key])
        if key == "clip/bound_low" and "clip/bound_high" in metrics:
            value += "/" + fmt.format(metrics["clip/bound_high"])
        parts.append(f"{label} {value}")
    if "clip/calib_ok" in metrics:  # a calibration step: the rule(s) that fired, in words
        parts.append(f"calibration {calibration_words(metrics)}")
    if metrics.get("train/skipped"):
        parts.append("NON-FINITE: rolled back")
    parts.append(f"{seconds_per_step:.2f} s/step")
    return " | ".join(parts)


def calibration_words(metrics: dict[str, float]) -> str:
    """``"ok"``, or the CalibStatus flags that fired (``"alpha_zero+p_unreachable"``), from ``clip/calib_<flag>``."""
    if metrics.get("clip/calib_ok") == 1.0:
        return "ok"
    fired = [name for name in CALIB_FLAG_NAMES if metrics.get(f"clip/calib_{name}") == 1.0]
    return "+".join(fired) or "?"


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _same_on_every_rank(decision: bool) -> bool:
    """Rank 0's `decision` (only rank 0 has the tracker), so every rank takes the same collective path."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return decision
    box = [decision]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


SAMPLES_SHOWN = 3  # generations per evaluation in the log (all of them are in the artifact)


def _log_samples(tracker: Tracker, out_dir: str, samples: list[dict[str, Any]], step: int, rank: int) -> None:
    """An evaluation's sample generations (`Evaluator.samples`): a table artifact ``samples/step_NNNNNN.json``
    (pandas' "split" layout, as ``mlflow.log_table`` writes) and a few in the log, garbled ones flagged."""
    if rank != 0 or not samples:
        return
    import pandas as pd

    path = Path(out_dir) / "samples" / f"step_{step:06d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(samples).to_json(path, orient="split", index=False)
    tracker.log_artifact(path, "samples")
    shown = [_sample_text(sample) for sample in samples[:SAMPLES_SHOWN]]
    log.info("step %d samples (all in %s): %s", step, path.relative_to(Path(out_dir)), " | ".join(shown))


def _sample_text(sample: dict[str, Any]) -> str:
    verdict = f"garbled: {sample['garbled']}" if sample["garbled"] else ("right" if sample["reward"] > 0 else "wrong")
    return f"{sample['prompt']!r} -> {sample['response']!r} ({verdict}, answer {sample['answer']!r})"


def _log_histograms(tracker: Tracker, result: StepResult) -> None:
    for hist in result.histograms:
        figure = ratio_histogram_figure(hist)
        tracker.log_figure(figure, f"ratio_histograms/step_{hist['step']:06d}.png")
        close_figure(figure)


def _progress(description: str, total: int, completed: int) -> Any:
    """A rich bar on an interactive terminal (the log lines carry the numbers everywhere else)."""
    if not sys.stderr.isatty():
        return nullcontext(lambda step: None)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("step {task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        transient=True,
    )
    task = progress.add_task(description, total=total, completed=completed)

    class _Bar:
        def __enter__(self):
            progress.__enter__()
            return lambda step: progress.update(task, completed=step)

        def __exit__(self, *exc: object) -> None:
            progress.__exit__(*exc)

    return _Bar()


def _eval_due(cfg, done: int) -> bool:
    every = cfg.eval.every
    return done == cfg.trainer.steps or (every > 0 and done % every == 0)


def _every(every: int, done: int) -> bool:
    return every > 0 and done % every == 0


def _checkpoint_due(cfg, done: int) -> bool:
    every = cfg.trainer.checkpoint_every
    return done == cfg.trainer.steps or (every > 0 and done % every == 0)


def _log(tracker: Tracker, summary: RunSummary, metrics: dict[str, float], step: int) -> None:
    tracker.log_metrics(metrics, step)
    summary.history.append({"step": float(step), **metrics})
