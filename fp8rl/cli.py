"""The ``fp8rl`` command: launch sweeps, compare their runs.

    fp8rl sweep grpo_granularity                                # tiny scale, local executor, waits
    fp8rl sweep grpo_granularity --scale paper --launcher slurm --profile example_h100 --dry-run
    fp8rl sweep dapo_table --launcher slurm trainer.seed=0,1,2  # a command-line sweep adds an axis
    fp8rl compare --experiment grpo_granularity-tiny --metrics eval/accuracy,clip/low_neg:mean \\
        --group-by recipe,clipping --out results/grpo_granularity
    fp8rl experiments                                           # what sweeps/experiment/ holds
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from fp8rl.config import ConfigError
from fp8rl.tracking.mlflow_tracker import TrackingUnavailable


def _launcher_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, yaml.safe_load(value)


def _add_sweep(sub: Any) -> None:
    p = sub.add_parser("sweep", help="launch an experiment's sweep (skips finished runs, resumes unfinished ones)")
    p.add_argument("experiment", help="a file of sweeps/experiment/ (see `fp8rl experiments`)")
    p.add_argument(
        "overrides", nargs="*", help="Hydra overrides for every point (anywhere on the line); a=1,2 adds an axis"
    )
    p.add_argument("--scale", choices=("tiny", "paper"), default=None, help="default: the experiment's (tiny)")
    p.add_argument("--launcher", choices=("local", "slurm", "inline"), default="local")
    p.add_argument("--profile", default=None, help="Slurm cluster profile: slurm/profiles/<name>.yaml or a path")
    p.add_argument(
        "--set",
        dest="launcher_set",
        action="append",
        type=_launcher_option,
        default=[],
        metavar="KEY=VALUE",
        help="override a launcher/profile field, e.g. --set timeout_min=30",
    )
    p.add_argument("--name", default=None, help="sweep name = MLflow experiment (default: <experiment>-<scale>)")
    p.add_argument("--root", type=Path, default=Path("outputs/sweeps"), help="run folders go to ROOT/<name>/")
    p.add_argument("--tracking-uri", default=None, help="MLflow store (default: $MLFLOW_TRACKING_URI or ./mlflow.db)")
    p.add_argument("--dry-run", action="store_true", help="validate and print what would run; submit nothing")
    p.add_argument(
        "--wait",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wait for the jobs (default: local yes, slurm no)",
    )
    p.add_argument("--max-parallel", type=int, default=None, help="local launcher: jobs at once")


def _add_compare(sub: Any) -> None:
    p = sub.add_parser("compare", help="table of metrics across a sweep's runs (MLflow) -> .md and .csv")
    p.add_argument("--experiment", required=True, help="the sweep's MLflow experiment, e.g. grpo_granularity-tiny")
    p.add_argument(
        "--metrics", default=None, help="comma list of KEY[:last|mean|max|min], e.g. eval/accuracy,rollout/entropy:max"
    )
    p.add_argument("--group-by", default=None, help="comma list of tags/params (default: the sweep's axes)")
    p.add_argument("--out", type=Path, default=None, help="write <experiment>.md/.csv/.runs.csv here")
    p.add_argument("--tracking-uri", default=None)
    p.add_argument("--all", action="store_true", help="include unfinished runs")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8rl", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_sweep(sub)
    _add_compare(sub)
    sub.add_parser("experiments", help="list the experiments in sweeps/experiment/")
    return parser


def _sweep(args: argparse.Namespace) -> int:
    from fp8rl.launch.sweep import SweepRequest, run_sweep

    req = SweepRequest(
        experiment=args.experiment,
        overrides=list(args.overrides),
        scale=args.scale,
        launcher=args.launcher,
        profile=args.profile,
        launcher_overrides=dict(args.launcher_set),
        name=args.name,
        root=args.root,
        tracking_uri=args.tracking_uri,
        dry_run=args.dry_run,
        wait=args.wait,
        max_parallel=args.max_parallel,
    )
    report = run_sweep(req)
    return 1 if any(r.error for r in report.runs) else 0


def _compare(args: argparse.Namespace) -> int:
    from fp8rl.report.compare import compare

    group_by = args.group_by.split(",") if args.group_by else None
    _, paths = compare(args.experiment, args.metrics, group_by, args.out, args.tracking_uri, args.all)
    for path in paths:
        print(f"wrote {path}")
    return 0


def _experiments() -> int:
    from fp8rl.launch.experiment import SWEEPS_DIR, list_experiments

    for name in list_experiments():
        first = (SWEEPS_DIR / "experiment" / f"{name}.yaml").read_text().splitlines()[1:2]
        print(f"{name:28s} {first[0].lstrip('# ') if first else ''}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and (args.command != "sweep" or any(e.startswith("-") or "=" not in e for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]  # overrides after options (argparse stops at the first option)
    try:
        if args.command == "sweep":
            return _sweep(args)
        if args.command == "compare":
            return _compare(args)
        return _experiments()
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except TrackingUnavailable as err:
        print(f"tracking store unavailable: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "interrupted (Ctrl-C): points that had started are marked KILLED; the same command resumes them",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
