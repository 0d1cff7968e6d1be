"""RL step time on the tiny preset, split into rollout / old log-probs / shadow passes / update,
for BF16 and full-pipeline FP8 (emulated) measured side by side in one run (the configs take turns
step by step), as ratios to BF16.

Targets (issue 4): a full-pipeline FP8 step costs at most 1.5x a BF16 step; Calibrated Clipping at
K = 20 adds at most 5% to the average step (its two BF16 shadow forwards every K steps).

    .venv/bin/python benchmarks/rl_step.py [--steps 5] [--out results/bench/rl_step.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _provenance import write_json  # noqa: E402

from fp8rl.config import RunConfig, with_overrides  # noqa: E402
from fp8rl.job import build_trainer  # noqa: E402
from fp8rl.tracking.provenance import allocator_settings  # noqa: E402

PHASES = ("time/rollout", "time/old_logp", "time/shadow", "time/update", "time/step")
CONFIGS = {
    "bf16": {"precision.mode": "bf16"},
    "fp8_full-tensorwise": {"precision.mode": "fp8_full", "precision.recipe": "tensorwise"},
    "fp8_full-rowwise": {"precision.mode": "fp8_full", "precision.recipe": "rowwise"},
    "fp8_full-blockwise": {"precision.mode": "fp8_full", "precision.recipe": "blockwise"},
    "fp8_full-mxfp8": {"precision.mode": "fp8_full", "precision.recipe": "mxfp8"},
    "fp8_full-tensorwise+shadow": {
        "precision.mode": "fp8_full",
        "precision.recipe": "tensorwise",
        "trainer.shadow_every": 1,
    },
}


def bench_config(overrides: dict, args: argparse.Namespace) -> RunConfig:
    base = {
        "tracking.enabled": False,
        "warmstart.steps": args.warmstart_steps,
        "algo.prompts_per_step": args.prompts,
    }
    return with_overrides(RunConfig(), {**base, **overrides})


def time_round_robin(trainers: dict[str, Any], steps: int) -> dict[str, dict[str, float]]:
    """Median phase times per config; the configs take turns step by step, so that load from other
    processes on a shared machine falls on all of them alike."""
    for trainer in trainers.values():
        trainer.train_step(0)  # warm-up (allocator, first-call costs)
    samples: dict[str, list[dict]] = {name: [] for name in trainers}
    for step in range(1, steps + 1):
        for name, trainer in trainers.items():
            samples[name].append(trainer.train_step(step).metrics)
    return {name: {p: statistics.median(m[p] for m in ms) for p in PHASES} for name, ms in samples.items()}


def _op_entry(event: Any, total_us: float) -> dict[str, Any]:
    self_us = event.self_cpu_time_total
    return {"op": event.key, "self_ms": self_us / 1e3, "calls": event.count, "share": self_us / total_us}


def profile_one_step(trainers: dict[str, Any], step: int, top: int) -> dict[str, dict[str, Any]]:
    """Where one step's time goes, per config: torch.profiler's operators by self CPU time (the top `top`,
    each with its share of all operators' self time), after the timed steps."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, trainer in trainers.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.train_step(step)
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events)
        out[name] = {
            "self_ms_total": total / 1e3,
            "top": [_op_entry(e, total) for e in events[:top]],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per config (after one warm-up)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step (x group size 8)")
    parser.add_argument("--warmstart-steps", type=int, default=400)
    parser.add_argument("--interval", type=int, default=20, help="calibration interval K for the overhead estimate")
    parser.add_argument("--out", type=str, default=None)
    parser.add_argument("--profile", type=int, default=0, help="also profile one step per config: its top N operators")
    args = parser.parse_args()

    started = time.time()
    cfgs = {name: bench_config(overrides, args) for name, overrides in CONFIGS.items()}
    trainers = {name: build_trainer(cfg) for name, cfg in cfgs.items()}
    results = time_round_robin(trainers, args.steps)
    profiles = profile_one_step(trainers, args.steps + 1, args.profile) if args.profile else {}
    base = results["bf16"]["time/step"]
    print(f"{'config':30s} " + " ".join(f"{p.split('/')[1]:>9s}" for p in PHASES) + "   x BF16 step")
    for name, phases in results.items():
        print(f"{name:30s} " + " ".join(f"{phases[p]:9.3f}" for p in PHASES) + f"   {phases['time/step'] / base:6.2f}")
    fp8 = results["fp8_full-tensorwise"]["time/step"]
    shadow = results["fp8_full-tensorwise+shadow"]["time/shadow"]
    calib_overhead = shadow / args.interval / fp8
    summary = {
        "fp8_tensorwise_step_over_bf16": fp8 / base,
        **{f"{n}_step_over_bf16": r["time/step"] / base for n, r in results.items()},
        "calibrated_K_overhead_fraction": calib_overhead,
        "interval_K": args.interval,
        "targets": {"fp8_step_over_bf16_max": 1.5, "calibration_overhead_max": 0.05},
        "target_met": {
            "fp8_tensorwise_step": fp8 / base <= 1.5,
            **{f"{n}_step": r["time/step"] / base <= 1.5 for n, r in results.items() if n.startswith("fp8_full-")},
            "calibration_overhead": calib_overhead <= 0.05,
        },
    }
    print(f"full-pipeline FP8 (tensorwise) step / BF16 step = {fp8 / base:.2f} (target <= 1.5)")
    print(f"Calibrated Clipping at K={args.interval}: +{100 * calib_overhead:.2f}% of the FP8 step (target <= 5%)")
    print(f"({time.time() - started:.0f} s, {args.steps} timed steps per config, round-robin, median)")
    print(f"allocator: {allocator_settings()}")
    record = {"benchmark": "rl_step", "args": vars(args), "malloc": allocator_settings(), "seconds": results}
    if profiles:
        record["profile"] = profiles
    write_json(args.out, {**record, "summary": summary})


if __name__ == "__main__":
    main()
