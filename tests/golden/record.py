"""The golden per-step record: every metric of a few short runs, step by step, and their config hashes.

`tests/test_golden.py` (and, for the DP = 2 run, `tests/distributed/test_golden_dp.py`) re-run these runs and
compare them with the committed `steps.json`: a change that alters what a run computes, a metric's name or a
run's identity fails them. Re-record (`make golden`) only for a deliberate change of behaviour, and say why in the
commit.

The runs are the demo's three arms (BF16, vanilla tensorwise FP8, FP8 + Calibrated Clipping; Calibrated Clipping
recalibrates every 2 steps), 5 steps, seed 0, from a 200-step warm start, on a task small and a learning rate
large enough that rewards vary and PPO's clip fires in 5 steps; and the Calibrated Clipping arm on two gloo ranks
(DP = 2, `torchrun`, one thread each: `DP_ARM`), which equals the one-process run only up to round-off and so has
its own record. Everything is computed in FP32
(`precision.compute` and the warm start), with 2 intra-op threads and the CPU kernels pinned (`KERNELS`): the
AVX2 code paths of ATen's vectorised kernels, torch.compile's C++ kernels and oneDNN, and MKL's vendor-neutral
COMPATIBLE branch, which Intel and AMD machines run alike. So the comparison is exact. (Until 2026-12-03 MKL was
pinned to its AVX2 branch: that held across two Intel types, with and without AMX, but MKL ignores it on AMD
EPYC, where the record then differed from the first warm-start evaluation on.) Without the pins the same seed
drifts on another machine (measured on an Intel one: with MKL capped to AVX2 and nothing else pinned, the 200-step
warm start answers 34% of held-out sums instead of 22%, and sampled tokens differ from the first RL step).
`--check-machine` records a second time on one core (the same 2 threads) and requires the same record bit for bit.

    python -m tests.golden.record [--out tests/golden/steps.json] [--check-machine]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

GOLDEN = Path(__file__).with_name("steps.json")
REPO = Path(__file__).resolve().parents[2]
# Set before torch starts (so in a fresh process): the kernels every machine with AVX2 can run identically.
KERNELS = {
    "ATEN_CPU_CAPABILITY": "avx2",  # ATen's vectorised kernels and torch.compile's C++ kernels
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL's GEMMs never above AVX2
    # MKL's vendor-neutral branch: on AMD CPUs MKL ignores its AVX2 / AVX / SSE4_2 branches (each gives the same bits
    # as no setting there), so only COMPATIBLE (SSE2) can compute the same GEMMs on Intel and AMD machines.
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
# Another machine's core count (used by --check-machine): one core, the same 2 threads.
ONE_CORE = ("taskset", "-c", "0")
ARMS = ("bf16", "fp8_tensorwise", "cc_tensorwise")
DP_ARM, DP_RANKS = "cc_tensorwise", 2
DP_KEY = f"{DP_ARM}_dp{DP_RANKS}"  # its key in the record
STEPS = 5
GOLDEN_OVERRIDES = (
    "precision.compute=fp32",
    "warmstart.precision=fp32",
    "warmstart.steps=200",
    "warmstart.batch_size=128",
    "warmstart.lr=2e-3",
    "task.num_digits=2",  # 2-digit sums: a 200-step warm start answers ~20% of them (varied rewards)
    "task.num_train=4000",
    "task.num_eval=32",
    "eval.size=32",
    "eval.bf16=false",
    "algo.lr=5e-4",  # large enough that ratios leave [0.8, 1.2] within 5 steps (the clip fires)
    "algo.num_minibatches=4",
    "trainer.checkpoint_every=0",
    "trainer.threads=2",
)
UNTIMED = ("time/", "system/")  # wall-clock metrics: not part of what a run computes


def arm_overrides(arm: str, work: Path, ranks: int = 1) -> list[str]:
    from fp8rl.demo import demo_overrides

    places = [f"warmstart.cache_dir={work / 'warmstart'}", f"trainer.out_dir={work / f'{arm}-{ranks}'}"]
    threads = [] if ranks == 1 else ["trainer.threads=1"]  # the machine's 2 cores, one per rank
    return [*demo_overrides(arm, STEPS), *GOLDEN_OVERRIDES, *places, *threads]


def run_arm(arm: str, work: Path, ranks: int = 1) -> dict:
    """One arm: its config hash and {step: {metric: value}} (wall-clock metrics left out)."""
    from fp8rl.choices import validated
    from fp8rl.compose import compose_config
    from fp8rl.identity import config_hash
    from fp8rl.job import run_job
    from fp8rl.tracking import NullTracker

    (work / "warmstart").mkdir(parents=True, exist_ok=True)
    cfg = validated(compose_config(arm_overrides(arm, work, ranks)))
    tracker = NullTracker()
    run_job(cfg, tracker=tracker)
    steps: dict[str, dict[str, float]] = {}
    for step, metrics in tracker.history:
        steps.setdefault(str(step), {}).update({k: v for k, v in metrics.items() if not k.startswith(UNTIMED)})
    return {"config_hash": config_hash(cfg), "steps": steps}


def _require_kernels() -> None:
    missing = {k: v for k, v in KERNELS.items() if os.environ.get(k) != v}
    if missing:
        raise SystemExit(f"the golden record needs these kernel settings before torch starts: {missing}")
    from fp8rl._warnings import silence_expected_warnings

    silence_expected_warnings()


def record(work: Path) -> dict:
    """Every one-process arm, in this process (its environment must hold `KERNELS`)."""
    _require_kernels()
    return {arm: run_arm(arm, work) for arm in ARMS}


def record_in_subprocess(out: Path, work: Path, prefix: tuple[str, ...] = ()) -> dict:
    """`record` in a fresh interpreter with `KERNELS` set (under `prefix`, e.g. taskset); returns what it wrote."""
    env = {**os.environ, **KERNELS}
    cmd = [*prefix, sys.executable, "-m", "tests.golden.record", "--in-process", "--out", str(out), "--work", str(work)]
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    return json.loads(out.read_text())


def prepare_warmstart(work: Path) -> None:
    """The arms' warm start, trained in one process on 2 threads (as the one-process arms train it) unless cached:
    a job of several ranks would train it in a process of its own on 1 thread, another warm start."""
    from fp8rl.compose import compose_config
    from fp8rl.config import to_dict

    (work / "warmstart").mkdir(parents=True, exist_ok=True)
    config = work / "warmstart-config.json"
    config.write_text(json.dumps(to_dict(compose_config(arm_overrides(DP_ARM, work)))))
    env = {**os.environ, **KERNELS}
    subprocess.run([sys.executable, "-m", "fp8rl.trainer.warmstart", str(config)], cwd=REPO, env=env, check=True)


def record_data_parallel(out: Path, work: Path) -> dict:
    """`DP_ARM` on `DP_RANKS` gloo ranks (torchrun, `KERNELS` set) from `prepare_warmstart`'s warm start; returns
    {DP_KEY: its record}."""
    prepare_warmstart(work)
    script = ["-m", "tests.golden.record", "--in-process", "--data-parallel", "--out", str(out), "--work", str(work)]
    subprocess.run([*torchrun_command(DP_RANKS), *script], cwd=REPO, env=torchrun_env(), check=True)
    return json.loads(out.read_text())


def torchrun_command(ranks: int) -> list[str]:
    """``torchrun --standalone`` with `ranks` processes on this machine (append the script and its arguments)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]


def torchrun_env() -> dict[str, str]:
    """The environment of a multi-rank check: the pinned kernels, one thread per rank, this checkout importable."""
    return {**os.environ, **KERNELS, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def differences(expected: dict, actual: dict, limit: int = 20) -> list[str]:
    """Where two records differ (arms, hashes, steps, metric names, values; NaN equals NaN), at most `limit`."""
    found: list[str] = []
    for arm in sorted(set(expected) | set(actual)):
        if arm not in expected or arm not in actual:
            found.append(f"{arm}: only in the {'record' if arm in expected else 'new run'}")
            continue
        want, got = expected[arm], actual[arm]
        if want["config_hash"] != got["config_hash"]:
            found.append(f"{arm}: config hash {got['config_hash']} != recorded {want['config_hash']}")
        for step in sorted(set(want["steps"]) | set(got["steps"]), key=int):
            a, b = want["steps"].get(step, {}), got["steps"].get(step, {})
            for name in sorted(set(a) ^ set(b)):
                found.append(f"{arm} step {step}: metric {name} only in the {'record' if name in a else 'new run'}")
            for name in sorted(set(a) & set(b)):
                x, y = a[name], b[name]
                if x != y and not (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)):
                    found.append(f"{arm} step {step}: {name} = {y!r}, recorded {x!r}")
    return found[:limit]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=GOLDEN)
    parser.add_argument("--work", type=Path, default=None, help="run folders and the warm start (default: a temp dir)")
    parser.add_argument("--check-machine", action="store_true", help="also record on one core; must be equal")
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data-parallel", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.in_process and args.data_parallel:  # one rank of torchrun: rank 0 writes
        _require_kernels()
        result = {DP_KEY: run_arm(DP_ARM, args.work, DP_RANKS)}
        if os.environ.get("RANK", "0") == "0":
            args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        return
    if args.in_process:
        args.out.write_text(json.dumps(record(args.work), indent=1, sort_keys=True) + "\n")
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        result = record_in_subprocess(Path(tmp) / "steps.json", work / "here")
        result.update(record_data_parallel(Path(tmp) / "dp.json", work / "here"))
        if args.check_machine:
            other = record_in_subprocess(Path(tmp) / "one-core.json", work / "one-core", ONE_CORE)
            diff = differences({arm: result[arm] for arm in ARMS}, other)
            if diff:
                raise SystemExit("one core records another golden record:\n" + "\n".join(diff))
            print("one core (taskset -c 0, 2 threads) gives the same record bit for bit")
        args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
