"""Cost of Calibrated Clipping and of the loss diagnostics, relative to the PPO loss itself.

One run times, side by side (round-robin, so machine load hits all of them alike), on batch x length
tokens (default 1024 x 1024 = 1M, all unmasked):

- ``loss``: ``ppo_clip`` forward + backward with ``diagnostics=False`` (the reference, ratio 1.00);
- ``loss+diagnostics``: the same with the loss's built-in metrics, TIS and a BF16 reference ratio;
- ``calibration``: ``calibrate_clip_bounds`` (lower-bound quantile + exact upper-bound solve);
- ``diagnostics``: clip fractions, contributions, ratio quantiles, over-clip and rollout-mismatch metrics,
  converted to floats (one sync).

Ratios are medians over ``--repeats`` rounds divided by the median of ``loss``, for the wall-clock and for
the process CPU time (the latter is not inflated by other processes on a shared machine). In training, calibration
runs once every K = 20 steps (plus two BF16 shadow forwards that this benchmark does not time).

    .venv/bin/python benchmarks/clip_overhead.py [--out results/clip_overhead.json] [--device cuda]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fp8rl.algos import (
    Objective,
    TokenBatch,
    calibrate_clip_bounds,
    clip_fraction_metrics,
    contribution_metrics,
    get_policy_loss,
    metrics_to_floats,
    overclip_metrics,
    ratio_quantile_metrics,
    rollout_mismatch_metrics,
)

EPS_LOW, EPS_HIGH = 0.2, 0.28
STANDARD = (1 - EPS_LOW, 1 + EPS_HIGH)


def make_batch(batch: int, length: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """Synthetic FP8-like batch: BF16 log-ratio ~ N(0, 0.1), extra FP8 noise ~ N(0, 0.1), per-sequence adv."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, length)
    old_logp = -torch.rand(shape, generator=generator) * 3
    bf16_log_ratio = torch.randn(shape, generator=generator) * 0.1
    logp = old_logp + bf16_log_ratio + torch.randn(shape, generator=generator) * 0.1
    tensors = {
        "logp": logp,
        "old_logp": old_logp,
        "rollout_logp": old_logp + torch.randn(shape, generator=generator) * 0.05,
        "ratio_ref": torch.exp(bf16_log_ratio),
        "ratio_fp8": torch.exp(logp - old_logp),
        "adv": torch.randn(batch, generator=generator),
        "mask": torch.ones(shape, dtype=torch.bool),
    }
    return {name: tensor.to(device) for name, tensor in tensors.items()}


def workloads(data: dict[str, torch.Tensor]) -> dict[str, Callable[[], None]]:
    low, high = STANDARD

    def loss(diagnostics: bool) -> None:
        """The loss as the trainer runs it: with diagnostics, the mini-batch's correction and mismatch metrics
        and the BF16 shadow's over-clip metrics too."""
        objective = Objective(get_policy_loss("ppo_clip").configured(diagnostics=diagnostics), "tis_token")
        logp = data["logp"].detach().requires_grad_(True)
        correction = objective.correct(data["old_logp"], data["rollout_logp"] if diagnostics else None, data["mask"])
        tokens = TokenBatch(data["old_logp"], data["adv"], data["mask"], correction)
        value, metrics = objective.policy_loss(logp, tokens, (low, high))
        value.backward()
        if diagnostics:
            ratio = torch.exp(logp.detach() - data["old_logp"])
            metrics.update(overclip_metrics(data["ratio_ref"], ratio, data["adv"], data["mask"], low, high, low, high))
            metrics.update(correction.metrics)
        metrics_to_floats(metrics)

    def calibration() -> None:
        calibrate_clip_bounds(data["ratio_ref"], data["ratio_fp8"], data["adv"], data["mask"], EPS_LOW, EPS_HIGH)

    def diagnostics() -> None:
        ratio, adv, mask = data["ratio_fp8"], data["adv"], data["mask"]
        metrics = {
            **clip_fraction_metrics(ratio, adv, mask, low, high),
            **contribution_metrics(ratio, adv, mask, low, high),
            **ratio_quantile_metrics(ratio, mask),
            **overclip_metrics(data["ratio_ref"], ratio, adv, mask, low, high, low, high),
            **rollout_mismatch_metrics(data["old_logp"], data["rollout_logp"], mask),
        }
        metrics_to_floats(metrics)

    return {
        "loss": lambda: loss(False),
        "loss+diagnostics": lambda: loss(True),
        "calibration": calibration,
        "diagnostics": diagnostics,
    }


def measure(work: dict[str, Callable[[], None]], repeats: int, warmup: int, device: torch.device) -> dict:
    """Median wall-clock and process CPU time per workload. CPU time (all threads of this process) is what
    other processes' load does not inflate; on CUDA only the wall-clock is meaningful."""

    def timed(fn: Callable[[], None]) -> tuple[float, float]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - wall, time.process_time() - cpu

    for fn in work.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in work}
    for _ in range(repeats):  # round-robin: load drifts affect every workload alike
        for name, fn in work.items():
            samples[name].append(timed(fn))
    return {
        name: {
            "wall_median_s": statistics.median(wall for wall, _ in pairs),
            "wall_min_s": min(wall for wall, _ in pairs),
            "cpu_median_s": statistics.median(cpu for _, cpu in pairs),
        }
        for name, pairs in samples.items()
    }


def provenance(device: torch.device) -> dict:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        sha = None
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_sha": sha,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],  # a shared machine inflates every timing, not the ratios alone
        "command": " ".join(sys.argv),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    data = make_batch(args.batch, args.length, device, args.seed)
    timings = measure(workloads(data), args.repeats, args.warmup, device)
    for clock in ("wall", "cpu"):
        reference = timings["loss"][f"{clock}_median_s"]
        for entry in timings.values():
            entry[f"{clock}_ratio_to_loss"] = entry[f"{clock}_median_s"] / reference
    result = {
        "benchmark": "clip_overhead",
        "tokens": args.batch * args.length,
        "shape": [args.batch, args.length],
        "repeats": args.repeats,
        "reference": "loss = ppo_clip forward+backward, diagnostics=False",
        "timings": timings,
        "provenance": provenance(device),
    }

    prov = result["provenance"]
    print(f"clip_overhead: {result['tokens']:,} tokens {tuple(result['shape'])}, median of {args.repeats} rounds")
    print(f"  torch {prov['torch']} | {prov['device']} | {prov['platform']} | threads {prov['torch_threads']}")
    print(f"  cpus {prov['cpu_count']} | load average (1 min) {prov['load_average_1min']:.2f}")
    print(f"  {prov['date_utc']} | git {prov['git_sha'] or 'unknown'}")
    print(f"  {'workload':<18} {'wall ms':>9} {'x loss':>7} {'cpu ms':>9} {'x loss':>7}")
    for name, entry in timings.items():
        print(
            f"  {name:<18} {entry['wall_median_s'] * 1e3:>9.1f} {entry['wall_ratio_to_loss']:>7.2f}"
            f" {entry['cpu_median_s'] * 1e3:>9.1f} {entry['cpu_ratio_to_loss']:>7.2f}"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"  wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
