"""Launch overhead on the local Slurm cluster, in one run:

* submit -> first training step: from `executor.submit` in the sweep runner to the start of the job's
  first RL step (Slurm queueing + interpreter + imports + model build + cached warm start + initial
  eval), as the job itself logs it (``launch/submit_to_first_step_s``);
* MLflow logging cost as a fraction of step time: the seconds the training loop is blocked by a
  step's log call (``time/tracking_log``, measured in the job: a local write-ahead-log append and the
  hand-off to MLflow's asynchronous ``log_batch``) over the step time
  (``time/step``), target < 1%; beside it, the same step's metrics logged synchronously from here to
  the same server and to a sqlite store (what a synchronous tracker would cost).

Needs root (starts the cluster with slurm/local/up.sh) or a running cluster; starts its own MLflow server.

    .venv/bin/python benchmarks/launch_overhead.py [--steps 5] [--out results/bench/launch_overhead.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _provenance import write_json  # noqa: E402

from fp8rl.launch import SweepRequest, run_sweep  # noqa: E402
from fp8rl.launch.sweep import define  # noqa: E402
from fp8rl.tracking import store as mlflow_runs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.services import MlflowServer, ensure_local_slurm  # noqa: E402

TARGET_FRACTION = 0.01


def bench_request(args: argparse.Namespace, root: Path, uri: str) -> SweepRequest:
    overrides = [
        "warmstart.steps=30",  # the warm start is cached before submitting: its size does not matter here
        "warmstart.batch_size=64",
        f"warmstart.cache_dir={args.warmstart_dir}",
        f"trainer.steps={args.steps}",
        "eval.every=0",
        "eval.size=16",
        "task.num_eval=32",
    ]
    return SweepRequest(
        points=[["precision=fp8_full", "recipe=blockwise", "clipping=tis"]],
        overrides=overrides,
        scale="tiny",  # the experiments' CPU scale: 8 prompts x 8 samples per step
        launcher="slurm",
        profile=args.profile,
        launcher_overrides={"timeout_min": 60},
        name=f"bench-launch-{int(time.time())}",
        root=root / "runs",
        tracking_uri=uri,
        wait=True,
        timeout_s=3600,
    )


def prewarm(req: SweepRequest) -> None:
    """Train the warm start once before submitting (its cost is not launch overhead)."""
    from fp8rl.config import with_overrides
    from fp8rl.job import build_trainer

    cfg = define(req).points[0].cfg
    build_trainer(with_overrides(cfg, {"tracking.enabled": False}))


def job_numbers(uri: str, report) -> dict[str, float]:  # noqa: ANN001 - SweepReport
    client = mlflow_runs.client(uri)
    (child,) = mlflow_runs.child_runs(client, report.experiment_id)
    run_id = child.info.run_id

    def history(key: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]

    step_s, log_s = history("time/step"), history("time/tracking_log")
    return {
        "run_id": run_id,
        "metric_keys_per_step": len(child.data.metrics),
        "submit_to_first_step_s": child.data.metrics["launch/submit_to_first_step_s"],
        "step_s_mean": statistics.fmean(step_s),
        "tracking_log_s_mean": statistics.fmean(log_s),  # the WAL append + MLflow's async hand-off
        "tracking_log_s_max": max(log_s),
        "tracking_fraction": statistics.fmean(log_s) / statistics.fmean(step_s),
        "steps": len(step_s),
    }


def time_log_batch(uri: str, n_keys: int, repeats: int) -> float:
    """Median seconds of one step's log_batch (n_keys metrics) to `uri`."""
    from mlflow.entities import Metric

    client = mlflow_runs.client(uri)
    exp = mlflow_runs.experiment_id(client, f"log-batch-{time.time()}", create=True)
    run_id = client.create_run(exp).info.run_id
    samples = []
    for step in range(repeats + 1):
        metrics = [Metric(f"group/metric_{i}", float(i), int(time.time() * 1000), step) for i in range(n_keys)]
        t0 = time.perf_counter()
        client.log_batch(run_id, metrics=metrics)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[1:])  # the first call opens connections / tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="RL steps of the benchmarked job")
    parser.add_argument("--profile", default="local", help="Slurm profile (slurm/profiles/)")
    parser.add_argument("--warmstart-dir", default=".cache/warmstart", help="shared warm-start cache")
    parser.add_argument("--repeats", type=int, default=20, help="log_batch micro-benchmark calls per store")
    parser.add_argument("--out", default=None, help="JSON result (with provenance)")
    args = parser.parse_args()
    args.warmstart_dir = str(Path(args.warmstart_dir).resolve())
    if os.geteuid() == 0:
        ensure_local_slurm()
    root = Path(tempfile.mkdtemp(prefix="fp8rl-bench-launch-"))
    with MlflowServer(root / "mlflow") as server:
        req = bench_request(args, root, server.uri)
        prewarm(req)
        report = run_sweep(req)
        if report.runs[0].error:
            raise SystemExit(f"benchmark job failed: {report.runs[0].error}")
        job = job_numbers(server.uri, report)
        server_s = time_log_batch(server.uri, job["metric_keys_per_step"], args.repeats)
    sqlite_s = time_log_batch(f"sqlite:///{root / 'micro.db'}", job["metric_keys_per_step"], args.repeats)
    result = {
        "job": job,
        "log_batch_median_s": {"server": server_s, "sqlite": sqlite_s},
        "fraction_if": {k: v / job["step_s_mean"] for k, v in {"server": server_s, "sqlite": sqlite_s}.items()},
        "target_fraction": TARGET_FRACTION,
        "meets_target": job["tracking_fraction"] < TARGET_FRACTION,
        "setup": {"steps": args.steps, "profile": args.profile, "point": req.points[0], "scale": req.scale},
    }
    print_table(result)
    write_json(args.out, result)


def print_table(result: dict) -> None:
    job = result["job"]
    rows = [
        ("submit -> first training step", f"{job['submit_to_first_step_s']:.1f} s"),
        ("mean step time", f"{job['step_s_mean']:.2f} s"),
        ("MLflow log per step (in the job)", f"{job['tracking_log_s_mean'] * 1000:.0f} ms"),
        ("MLflow logging / step time", f"{job['tracking_fraction']:.2%} (target < {result['target_fraction']:.0%})"),
        ("log_batch from here: server / sqlite", "{server:.0f} ms / {sqlite:.0f} ms".format(
            **{k: v * 1000 for k, v in result["log_batch_median_s"].items()})),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")


if __name__ == "__main__":
    main()
