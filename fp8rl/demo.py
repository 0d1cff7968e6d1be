"""`make demo`: BF16 vs vanilla full-pipeline FP8 vs FP8 + Calibrated Clipping on the tiny task.

A few-minute run on a laptop CPU with the embedded defaults (sqlite MLflow in the working directory,
local execution). Ends with a table printed and written to outputs/demo/summary.{md,csv}.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

from fp8rl._warnings import silence_expected_warnings
from fp8rl.config import RunConfig
from fp8rl.tracking import resolve_tracking_uri

DEMO_RUNS = {
    "bf16": {"precision.mode": "bf16"},
    "fp8-tensorwise": {"precision.mode": "fp8_full", "precision.recipe": "tensorwise"},
    "fp8-tensorwise+calibrated": {
        "precision.mode": "fp8_full",
        "precision.recipe": "tensorwise",
        "clipping.policy": "calibrated",
        "clipping.rollout_correction": "tis_token",
    },
}
SUMMARY_COLUMNS = (
    ("final eval accuracy", "eval/accuracy", "last"),
    ("mean reward", "rollout/reward", "mean"),
    ("peak entropy", "rollout/entropy", "max"),
    ("garbled rate", "rollout/garbled_rate", "mean"),
    ("clip/low_neg", "clip/low_neg", "mean"),
    ("clip/high_pos", "clip/high_pos", "mean"),
    ("s/step", "time/step", "mean"),
)


silence_expected_warnings()


def demo_config(name: str, steps: int, out_root: Path) -> RunConfig:
    cfg = RunConfig()
    cfg.trainer.steps = steps
    cfg.trainer.eval_every = 5
    cfg.trainer.eval_size = 128
    cfg.trainer.checkpoint_every = 5
    cfg.trainer.shadow_every = 5
    cfg.trainer.out_dir = str(out_root / name)
    cfg.algo.prompts_per_step = 16
    cfg.algo.lr = 2e-5
    cfg.clipping.interval = 5
    cfg.tracking.experiment = "fp8rl-demo"
    cfg.tracking.run_name = name
    for dotted, value in DEMO_RUNS[name].items():
        section, field = dotted.split(".")
        setattr(getattr(cfg, section), field, value)
    return cfg


def summarize(history: list[dict[str, float]]) -> dict[str, float]:
    row = {}
    for label, key, how in SUMMARY_COLUMNS:
        values = [h[key] for h in history if key in h]
        if not values:
            row[label] = float("nan")
        elif how == "last":
            row[label] = values[-1]
        elif how == "max":
            row[label] = max(values)
        else:
            row[label] = statistics.fmean(values)
    return row


def stored_history(run_id: str | None) -> list[dict[str, float]]:
    """Metrics of a run already finished (a re-run of the demo), read back from MLflow."""
    if run_id is None:
        return []
    from mlflow.tracking import MlflowClient

    client = MlflowClient(resolve_tracking_uri(None))
    by_step: dict[int, dict[str, float]] = {}
    for _, key, _ in SUMMARY_COLUMNS:
        for m in client.get_metric_history(run_id, key):
            by_step.setdefault(m.step, {})[key] = m.value
    return [by_step[s] for s in sorted(by_step)]


def write_summary(rows: dict[str, dict[str, float]], out_root: Path) -> tuple[Path, Path]:
    out_root.mkdir(parents=True, exist_ok=True)
    labels = [label for label, _, _ in SUMMARY_COLUMNS]
    md = ["| run | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name, row in rows.items():
        md.append(f"| {name} | " + " | ".join(f"{row[label]:.4f}" for label in labels) + " |")
    md_path, csv_path = out_root / "summary.md", out_root / "summary.csv"
    md_path.write_text("\n".join(md) + "\n")
    with open(csv_path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["run", *labels])
        for name, row in rows.items():
            writer.writerow([name, *(row[label] for label in labels)])
    return md_path, csv_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=15, help="RL steps per run")
    parser.add_argument("--out", type=Path, default=Path("outputs/demo"), help="run folders and the summary")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from fp8rl.trainer.run import run

    rows = {}
    for index, name in enumerate(DEMO_RUNS, start=1):
        print(f"[demo {index}/{len(DEMO_RUNS)}] {name}", flush=True)
        summary = run(demo_config(name, args.steps, args.out))
        history = summary.history if len(summary.history) > 1 else stored_history(summary.run_id)
        rows[name] = summarize(history)
    md_path, csv_path = write_summary(rows, args.out)
    table = Table(title="fp8rl demo (tiny task, CPU)")
    table.add_column("run")
    for label, _, _ in SUMMARY_COLUMNS:
        table.add_column(label, justify="right")
    for name, row in rows.items():
        table.add_row(name, *(f"{row[label]:.4f}" for label, _, _ in SUMMARY_COLUMNS))
    console = Console()
    console.print(table)
    console.print(f"summary: {md_path} and {csv_path}")
    console.print(f"MLflow store: {resolve_tracking_uri(None)} (open with `make mlflow-ui`), experiment 'fp8rl-demo'")


if __name__ == "__main__":
    main()
