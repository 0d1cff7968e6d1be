"""The demo under other CPU kernels (``make kernel-spread``): how far its results move on another CPU.

Every tiny run starts from the shipped warm start, so what differs between machines is the RL phase's kernels.
With one machine type at hand, the demo's three arms run once per kernel setting (`SETTINGS`: environment
variables that make oneDNN and ATen take the paths another CPU would), each in its own MLflow experiment and run
folders, and the table ``results/tiny/kernel_spread.{md,csv}`` puts the settings side by side: the demo's three
verdicts (`fp8rl.demo.demo_verdicts`), each arm's numbers and their spread, and whether every run started from
the same weights. Design and endpoints: results/studies/2026-12-03-kernel-spread.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

from fp8rl.demo import ARMS, demo_verdicts

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "onednn-avx512core": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},  # BF16 GEMMs without the BF16 instructions
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},  # ATen's vectorised kernels as on an AVX2-only CPU
}
SPREAD_COLUMNS = {  # the summary's columns whose spread across settings the table states -> their CSV names
    "clip/low_neg (mean)": "low_neg_mean",
    "over-clip at own bounds (neg, mean)": "overclip_own_bounds_neg_mean",
    "final eval accuracy": "final_eval_accuracy",
    "mean reward": "mean_reward",
}
EXPERIMENT_PREFIX = "kernel-spread-"


def run_setting(name: str, out_root: Path, steps: int) -> Path:
    """The demo in a process of its own under setting `name`'s environment; returns its summary folder."""
    out = out_root / name
    env = {**os.environ, **SETTINGS[name]}
    for variable in {v for setting in SETTINGS.values() for v in setting} - set(SETTINGS[name]):
        env.pop(variable, None)  # a setting is exactly its variables: nothing inherited from the shell
    command = [sys.executable, "-m", "fp8rl.demo", "--steps", str(steps), "--out", str(out)]
    subprocess.run([*command, "--experiment", EXPERIMENT_PREFIX + name], env=env, check=True)
    return out


def start_sha256(experiment: str, arm: str) -> str | None:
    """The sha256 of the weights the arm's run started from (its ``start_weights.json``)."""
    path = Path("outputs") / experiment / arm / "start_weights.json"
    return json.loads(path.read_text()).get("sha256") if path.exists() else None


def spread_table(summaries: dict[str, pd.DataFrame], run_ids: dict[str, dict[str, str]]) -> pd.DataFrame:
    """One row per (setting, arm): the spread columns, the start's sha256 and the MLflow run id (tidy)."""
    rows = []
    for name, frame in summaries.items():
        for record in frame.to_dict("records"):
            arm = record["run"]
            rows.append(
                {
                    "setting": name,
                    "arm": arm,
                    **{tidy: record.get(column) for column, tidy in SPREAD_COLUMNS.items()},
                    "start_sha256": start_sha256(EXPERIMENT_PREFIX + name, arm),
                    "run_id": run_ids.get(name, {}).get(arm),
                }
            )
    return pd.DataFrame(rows)


def verdict_table(summaries: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per setting: the demo's three verdicts (True / False / None = not measured)."""
    return pd.DataFrame([{"setting": name, **demo_verdicts(frame)} for name, frame in summaries.items()])


def ranges(table: pd.DataFrame) -> pd.DataFrame:
    """Per arm and spread column: min and max across the settings."""
    grouped = table.groupby("arm", sort=False)[list(SPREAD_COLUMNS.values())].agg(["min", "max"])
    grouped.columns = [f"{column} {stat}" for column, stat in grouped.columns]
    return grouped.reindex([arm for arm in ARMS if arm in grouped.index]).reset_index()


def _markdown(frame: pd.DataFrame) -> str:
    """A Markdown table with 4 decimals and "-" where an arm has no value (BF16 has no over-clip)."""
    return frame.astype(object).where(frame.notna(), None).to_markdown(index=False, floatfmt=".4f", missingval="-")


def write_report(summaries: dict[str, pd.DataFrame], out_dir: Path, run_ids: dict[str, dict[str, str]]) -> list[Path]:
    """``kernel_spread.csv`` (tidy), ``kernel_spread.md`` (verdicts, ranges, same-start check, provenance)."""
    from fp8rl.tracking.provenance import provenance

    table = spread_table(summaries, run_ids)
    verdicts = verdict_table(summaries)
    starts = set(table["start_sha256"])
    prov = provenance()
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / "kernel_spread.csv", out_dir / "kernel_spread.md"
    table.to_csv(csv_path, index=False)
    held = {column: int(verdicts[column].eq(True).sum()) for column in verdicts.columns if column != "setting"}
    lines = [
        "# The demo under other CPU kernels (`make kernel-spread`)",
        "",
        f"Generated {prov['date']} at git {prov.get('git_sha', '?')[:10]} on {prov.get('machine.cpu_model', '?')} "
        f"({prov.get('machine.cpu_flags', '?')}, {prov.get('machine.cpu_count', '?')} CPUs), torch "
        f"{prov.get('version.torch', '?')}. Design: "
        "[results/studies/2026-12-03-kernel-spread.md](../studies/2026-12-03-kernel-spread.md). Run ids and every "
        "number: [kernel_spread.csv](kernel_spread.csv).",
        "",
        "Settings: "
        + "; ".join(
            f"`{n}` = {' '.join(f'{k}={v}' for k, v in e.items()) or 'nothing set'}" for n, e in SETTINGS.items()
        )
        + ".",
        "",
        "Same start: "
        + (
            f"every run started from one warm start (sha256 {next(iter(starts))[:16]}...)."
            if len(starts) == 1 and None not in starts
            else f"NO: starts {sorted(map(str, starts))}."
        ),
        "",
        "## The demo's verdicts per setting",
        "",
        verdicts.to_markdown(index=False),
        "",
        "Held in: " + ", ".join(f"{column} {n} of {len(verdicts)}" for column, n in held.items()) + ".",
        "",
        "## Each arm's numbers across the settings (min, max)",
        "",
        _markdown(ranges(table)),
        "",
        "## Every run",
        "",
        _markdown(table.drop(columns=["start_sha256", "run_id"])),
        "",
    ]
    md_path.write_text("\n".join(lines))
    return [csv_path, md_path]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=15, help="RL steps per arm (the demo's)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--out", type=Path, default=Path("results/tiny"), help="the table's folder")
    parser.add_argument("--report-only", action="store_true", help="rebuild the table from the last runs' summaries")
    args = parser.parse_args(argv)
    summaries, run_ids = {}, {}
    for name in args.settings:
        folder = Path("outputs/kernel_spread") / name
        if not args.report_only:
            run_setting(name, Path("outputs/kernel_spread"), args.steps)
        summaries[name] = pd.read_csv(folder / "summary.csv")
        run_ids[name] = json.loads((folder / "runs.json").read_text())
    for path in write_report(summaries, args.out, run_ids):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
