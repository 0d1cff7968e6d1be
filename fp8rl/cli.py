"""The ``fp8rl`` command: everything a user runs, one subcommand each.

    fp8rl train scale=tiny precision=fp8_full                   # one run (Hydra overrides)
    fp8rl demo                                                  # BF16 vs FP8 vs FP8 + Calibrated Clipping
    fp8rl sweep grpo_granularity                                # tiny scale, local executor, waits
    fp8rl sweep grpo_granularity --scale paper --launcher slurm --profile example_h100 --dry-run
    fp8rl sweep dapo_table --launcher slurm trainer.seed=0,1,2  # a command-line sweep adds an axis
    fp8rl compare --experiment grpo_granularity-tiny --metrics eval/accuracy,clip/low_neg:mean \\
        --group-by recipe,clipping --out results/grpo_granularity
    fp8rl experiments                                           # what sweeps/experiment/ holds
    fp8rl report table grpo_granularity                         # a table / figures of results/<scale>/
    fp8rl study mechanism                                       # a study: mechanism, collapse, kernel-spread, ...
    fp8rl docs                                                  # regenerate the generated docs tables
    fp8rl sync outputs/<run folder>                             # upload a run's WAL once MLflow is back
    fp8rl ui-snapshot | fp8rl mini-assets --out DIR             # maintainers' tools (make ui-snapshot, mini-assets)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from fp8rl.config import ConfigError
from fp8rl.tracking.client import TrackingUnavailable, redact_stderr


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


# Subcommands that hand the rest of the line to a module's own command line (its --help is that module's).
PASSTHROUGH = {
    "train": ("fp8rl.train", "one run: Hydra overrides, e.g. scale=tiny precision=fp8_full (python -m fp8rl.train)"),
    "demo": ("fp8rl.demo", "BF16 vs vanilla FP8 vs FP8 + Calibrated Clipping on the tiny task (make demo)"),
    "report": ("fp8rl.report.__main__", "tables and figures of results/<scale>/ from MLflow (python -m fp8rl.report)"),
    "sync": ("fp8rl.tracking.sync", "upload a run's write-ahead log to MLflow once the store is back"),
    "ui-snapshot": (
        "fp8rl.tracking.ui_snapshot",
        "PNG snapshots of the MLflow UI for an experiment (make ui-snapshot)",
    ),
    "mini-assets": (
        "fp8rl.tasks.math.mini",
        "write the offline mini math assets: model, tokenizer, data (make mini-assets)",
    ),
}
STUDIES = {
    "mechanism": "fp8rl.studies.mechanism",
    "collapse": "fp8rl.studies.collapse",
    "kernel-spread": "fp8rl.studies.kernel_spread",
    "junk-organism": "fp8rl.studies.junk_organism",
}
GENERATED_DOCS = ("docs/configuration.md", "docs/metrics.md")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8rl", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, text) in PASSTHROUGH.items():
        sub.add_parser(name, help=text, add_help=False)
    _add_sweep(sub)
    _add_compare(sub)
    sub.add_parser("experiments", help="list the experiments in sweeps/experiment/")
    study = sub.add_parser("study", help=f"run a study: {', '.join(STUDIES)} (its own options follow)", add_help=False)
    study.add_argument("study", choices=list(STUDIES))
    docs = sub.add_parser("docs", help=f"regenerate {' and '.join(GENERATED_DOCS)} (--check: only compare)")
    docs.add_argument("--check", action="store_true", help="exit 1 if a generated table is out of date")
    return parser


def _passthrough(module_name: str, prog: str, argv: list[str]) -> int:
    """Run ``module_name``'s command line on `argv`; `fp8rl.train` runs as ``python -m fp8rl.train`` would (Hydra
    reads sys.argv and finds sweeps/ from ``__main__``'s file)."""
    import importlib
    import runpy

    try:
        if module_name == "fp8rl.train":
            sys.argv = [prog, *argv]
            runpy.run_module(module_name, run_name="__main__", alter_sys=True)
            return 0
        result = importlib.import_module(module_name).main(argv)
    except KeyboardInterrupt:  # one line, not a traceback
        print(
            "interrupted (Ctrl-C): the run that was training is marked KILLED; the same command resumes it",
            file=sys.stderr,
        )
        return 130
    return result if isinstance(result, int) else 0


def _docs(check: bool) -> int:
    """The generated docs tables of this checkout (found from the package, whatever the working directory)."""
    from fp8rl.docs import main as docs_main

    root = Path(__file__).resolve().parents[1]
    missing = [name for name in GENERATED_DOCS if not (root / name).exists()]
    if missing:
        raise ConfigError(f"{', '.join(missing)} not found under {root}: `fp8rl docs` runs in a source checkout")
    docs_main([*(str(root / name) for name in GENERATED_DOCS), "--check" if check else "--write"])
    return 0


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
    argv = sys.argv[1:] if argv is None else list(argv)
    redact_stderr()  # an uncaught error's traceback may quote a tracking URI with its token
    if argv and argv[0] in PASSTHROUGH:
        return _passthrough(PASSTHROUGH[argv[0]][0], f"fp8rl {argv[0]}", argv[1:])
    if len(argv) >= 2 and argv[0] == "study" and argv[1] in STUDIES:
        return _passthrough(STUDIES[argv[1]], f"fp8rl study {argv[1]}", argv[2:])
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
        if args.command == "docs":
            return _docs(args.check)
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
