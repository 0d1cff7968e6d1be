"""``python -m fp8rl.report --scale tiny --out results/tiny <what>``: build results from MLflow, or re-render them.

table EXP [EXP ...]   the paper table of each sweep experiment (MLflow experiment ``EXP-<scale>``)
rebuild [EXP ...]     re-render tables from their own ``*.runs.csv`` / ``*.runs.json`` in the output folder (no
                      MLflow store; default: every table there)
mechanism             the one-step mechanism study's tables (experiment ``mechanism-<scale>``)
reruns EXP [EXP ...]  whether each run of EXP that repeats a config hash of another experiment reproduced it
reproduction EXP --again DIR
                      each run of a table against the same table's runs in DIR (its files from another run)
figures               training curves of every table present in MLflow, and the mechanism plots
index                 INDEX.md and PROVENANCE.json for everything in the output folder
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from fp8rl.report import figures, mechanism, reruns, tables
from fp8rl.tracking import store as runs
from fp8rl.tracking.provenance import provenance

TABLE_EXPERIMENTS = (
    "grpo_granularity",
    "dapo_table",
    "ablation_recal_interval",
    "ablation_init_bounds",
    "ablation_lower_only",
    "ablation_first_calibration",
    "stress_outliers",
    "collapse",
    "junk_gate",
    "junk_dose",
    "junk_fp8_pilot",
    "junk_arms",
)


def _existing(experiments: list[str], uri: str) -> list[str]:
    if not runs.store_exists(uri):
        return []
    client = runs.client(uri)
    return [e for e in experiments if runs.experiment_id(client, e, create=False) is not None]


def cmd_table(args: argparse.Namespace) -> list[Path]:
    written = []
    for experiment in args.experiments:
        columns = tables.columns_of(experiment)
        written += tables.write_table(f"{experiment}-{args.scale}", args.out, columns, tracking_uri=args.tracking_uri)
    return written


def cmd_rebuild(args: argparse.Namespace) -> list[Path]:
    unknown = sorted(set(args.experiments) - set(TABLE_EXPERIMENTS))
    if unknown:
        raise SystemExit(f"unknown table(s) {unknown}; valid: {list(TABLE_EXPERIMENTS)}")
    experiments = args.experiments or [
        e for e in TABLE_EXPERIMENTS if (args.out / f"{e}-{args.scale}.runs.csv").exists()
    ]
    if not experiments:
        raise SystemExit(f"no table's *.runs.csv in {args.out}: nothing to re-render")
    written = []
    for experiment in experiments:
        written += tables.rebuild_table(f"{experiment}-{args.scale}", args.out, tables.columns_of(experiment))
    return written


def cmd_reruns(args: argparse.Namespace) -> list[Path]:
    written = []
    for experiment in args.experiments:
        written += reruns.write_reruns(f"{experiment}-{args.scale}", args.out, tracking_uri=args.tracking_uri)
    return written


def cmd_reproduction(args: argparse.Namespace) -> list[Path]:
    stem = f"{args.experiment}-{args.scale}"
    return reruns.write_reproduction(stem, list(tables.columns_of(args.experiment)), args.out, args.again, args.out)


def cmd_mechanism(args: argparse.Namespace) -> list[Path]:
    return mechanism.write_mechanism(f"mechanism-{args.scale}", args.out, args.tracking_uri)


def cmd_figures(args: argparse.Namespace) -> list[Path]:
    uri = runs.absolute_tracking_uri(args.tracking_uri)
    written = []
    out = args.out / "figures"
    for experiment in _existing([f"{e}-{args.scale}" for e in TABLE_EXPERIMENTS], uri):
        written += figures.training_curves(experiment, out, args.tracking_uri)
    if _existing([f"mechanism-{args.scale}"], uri):
        written += figures.mechanism_figures(f"mechanism-{args.scale}", out, args.tracking_uri)
    if not written:
        raise SystemExit(f"nothing to plot: no table or mechanism runs in {runs.display_uri(uri)}")
    return written


def cmd_index(args: argparse.Namespace) -> list[Path]:
    """PROVENANCE.json (who built the folder, from which runs) and INDEX.md (what each file is)."""
    uri = runs.display_uri(runs.absolute_tracking_uri(args.tracking_uri))  # no machine's path in results/
    sources = {}
    for path in sorted(args.out.glob("*.runs.json")):
        data = json.loads(path.read_text())
        sources[path.name] = {"experiment": data["experiment"], "run_ids": [r["run_id"] for r in data["runs"]]}
    mech = args.out / "mechanism.runs.csv"
    if mech.exists():
        lines = mech.read_text().splitlines()[1:]
        sources["mechanism.runs.csv"] = {
            "experiment": f"mechanism-{args.scale}",
            "run_ids": [ln.split(",")[0] for ln in lines],
        }
    record = {
        "generated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "mlflow": uri,
        "builder": provenance(),
        "sources": sources,
    }
    prov = args.out / "PROVENANCE.json"
    prov.write_text(json.dumps(record, indent=1, sort_keys=True))
    files = sorted(p for p in args.out.rglob("*") if p.is_file() and p.name != "INDEX.md")
    lines = [
        f"# results/{args.out.name}: built by `make reproduce SCALE={args.scale}`",
        "",
        "Each table's first line says whether it was built from MLflow or re-rendered from its own `*.runs.csv` "
        "(`make tables`).",
        "",
        f"Index generated {record['generated']} (MLflow store: `{uri}`) at git "
        f"{record['builder'].get('git_sha', '?')[:10]}"
        f"{' (dirty)' if record['builder'].get('git_dirty') == 'true' else ''} on "
        f"{record['builder'].get('machine.hostname', '?')} ({record['builder'].get('machine.cpu_count', '?')} CPUs, "
        f"torch {record['builder'].get('version.torch', '?')}). Every run id is in PROVENANCE.json and the "
        "`*.runs.csv` / `*.runs.json` files (resolved configs and provenance tags of each run).",
        "",
        "| file | runs |",
        "|---|---|",
    ]
    for f in files:
        rel = f.relative_to(args.out)
        n = sources.get(f.name.replace(".md", ".runs.json"), {}).get("run_ids")
        lines.append(f"| [{rel}]({rel}) | {len(n) if n else ''} |")
    lines += [
        "",
        "## Columns",
        "",
        "The tables' columns: `metric` in each `<table>.csv` and `<table>.paired.csv` and the column names of each "
        "`<table>.runs.csv`, the column headers of the Markdown tables, and what each holds per run (a table's cell "
        "is the mean ± std of that over the arm's runs; a `<table>.csv` leaves std empty below 2 runs).",
        "",
        tables.columns_codebook(TABLE_EXPERIMENTS).to_markdown(index=False),
    ]
    index = args.out / "INDEX.md"
    index.write_text("\n".join(lines) + "\n")
    return [prov, index]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8rl.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", default="tiny", choices=("tiny", "paper"))
    parser.add_argument("--out", type=Path, default=None, help="default: results/<scale>")
    parser.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI or ./mlflow.db")
    sub = parser.add_subparsers(dest="what", required=True)
    for name, text in (
        ("table", "paper tables of sweep experiments"),
        ("reruns", "did the runs of a sweep that repeat another's config hashes reproduce"),
    ):
        sub.add_parser(name, help=text).add_argument("experiments", nargs="+", choices=TABLE_EXPERIMENTS)
    sub.add_parser("rebuild", help="re-render tables from their own per-run files").add_argument(
        "experiments", nargs="*", help=f"default: every table in the output folder; of {', '.join(TABLE_EXPERIMENTS)}"
    )
    again = sub.add_parser("reproduction", help="a table's runs against the same table run again (its files in DIR)")
    again.add_argument("experiment", choices=TABLE_EXPERIMENTS)
    again.add_argument("--again", type=Path, required=True, metavar="DIR", help="the other run's table folder")
    for name in ("mechanism", "figures", "index"):
        sub.add_parser(name)
    args = parser.parse_args(argv)
    args.out = args.out or Path("results") / args.scale
    handler = {
        "table": cmd_table,
        "rebuild": cmd_rebuild,
        "reruns": cmd_reruns,
        "reproduction": cmd_reproduction,
        "mechanism": cmd_mechanism,
        "figures": cmd_figures,
        "index": cmd_index,
    }[args.what]
    for path in handler(args):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
