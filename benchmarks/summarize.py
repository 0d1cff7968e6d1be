"""Rebuild results/bench/SUMMARY.md from the benchmark JSONs in a directory (run by `make bench`).

Every number in the summary is read from a JSON a benchmark wrote in the same `make bench` (or an
earlier one: each section names its file, git SHA and date); nothing is typed by hand.

    .venv/bin/python benchmarks/summarize.py [results/bench]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path


def _provenance_line(name: str, record: dict) -> str:
    p = record.get("provenance", {})
    date = p.get("date") or p.get("date_utc") or "?"
    sha = (p.get("git_sha") or "?")[:12]
    dirty = " (dirty tree)" if str(p.get("git_dirty", "")).lower() == "true" else ""
    torch_version = p.get("version.torch") or p.get("torch") or "?"
    cpus = p.get("machine.cpu_count") or p.get("cpu_count") or "?"
    malloc = record.get("malloc") or p.get("malloc") or p.get("machine.malloc")
    extra = f", allocator: {malloc}" if malloc else ""
    return f"`{name}`: git {sha}{dirty}, {date}, torch {torch_version}, {cpus} CPUs{extra}"


def _yes_no(met: object) -> str:
    return "met" if met is True else ("NOT met" if met is False else "n/a")


def quant_throughput(record: dict) -> list[str]:
    lines = [
        f"Input: {record['config']['size']}^2 float32 -> {record['config']['fmt']}; copy bandwidth "
        f"{record['copy_gbps']:.1f} GB/s; target: compiled >= 10% of copy, bit-identical to eager: "
        f"**{_yes_no(record.get('target_met'))}**.",
        "",
        "| granularity | eager GB/s | compiled GB/s | compiled / copy | torchao GB/s | compiled / torchao "
        "| bit-identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in record["granularities"].items():
        lines.append(
            f"| {name} | {row.get('eager_gbps', float('nan')):.2f} | {row.get('compiled_gbps', float('nan')):.2f} "
            f"| {row.get('compiled_over_copy', float('nan')):.1%} | {row.get('torchao_gbps', float('nan')):.2f} "
            f"| {row.get('compiled_over_torchao', float('nan')):.1f} | {row.get('compiled_bit_identical', 'n/a')} |"
        )
    return lines


def rl_step(record: dict) -> list[str]:
    seconds, summary = record["seconds"], record["summary"]
    base = seconds["bf16"]["time/step"]
    lines = [
        f"Tiny preset, {record['args']['prompts']} prompts x 8 samples a step, {record['args']['steps']} timed "
        "steps per config taking turns (median). Target: a full-pipeline FP8 step <= 1.5x a BF16 step; "
        f"Calibrated Clipping at K = {summary['interval_K']} adds <= 5%.",
        "",
        "| config | rollout s | old log-probs s | shadow s | update s | step s | x BF16 step | <= 1.5x |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, phases in seconds.items():
        ratio = phases["time/step"] / base
        verdict = "" if name == "bf16" or name.endswith("+shadow") else _yes_no(ratio <= 1.5)
        lines.append(
            f"| {name} | {phases['time/rollout']:.3f} | {phases['time/old_logp']:.3f} | {phases['time/shadow']:.3f} "
            f"| {phases['time/update']:.3f} | {phases['time/step']:.3f} | {ratio:.2f} | {verdict} |"
        )
    overhead = summary["calibrated_K_overhead_fraction"]
    verdict = _yes_no(overhead <= 0.05)
    lines += ["", f"Calibrated Clipping at K = {summary['interval_K']}: +{overhead:.2%} of the FP8 step ({verdict})."]
    return lines + profile_lines(record.get("profile", {}))


def profile_lines(profiles: dict) -> list[str]:
    """One profiled step per config: each operator's self CPU time in ms (its share of the step's operator time),
    for the operators among any config's top five."""
    if not profiles:
        return []
    ops = list(dict.fromkeys(e["op"] for p in profiles.values() for e in p["top"][:5]))
    head = "| operator | " + " | ".join(profiles) + " |"
    lines = [
        "",
        "Where one step's time goes (torch.profiler, one step per config after the timed ones; self CPU "
        "ms and share of all operators' self time):",
        "",
        head,
        "|---" * (len(profiles) + 1) + "|",
    ]
    for op in ops:
        cells = []
        for p in profiles.values():
            entry = next((e for e in p["top"] if e["op"] == op), None)
            cells.append(f"{entry['self_ms']:.0f} ({entry['share']:.0%})" if entry else "-")
        lines.append(f"| `{op}` | " + " | ".join(cells) + " |")
    totals = " | ".join(f"{p['self_ms_total']:.0f}" for p in profiles.values())
    return [*lines, f"| all operators | {totals} |"]


def clip_overhead(record: dict) -> list[str]:
    lines = [
        f"{record['tokens']} tokens ({record['shape'][0]} x {record['shape'][1]}), reference: {record['reference']}.",
        "",
        "| workload | wall ms | x loss (wall) | x loss (CPU time) |",
        "|---|---|---|---|",
    ]
    for name, t in record["timings"].items():
        wall_ms = 1000 * t["wall_median_s"]
        lines.append(f"| {name} | {wall_ms:.1f} | {t['wall_ratio_to_loss']:.2f} | {t['cpu_ratio_to_loss']:.2f} |")
    return lines


def gemm_floor(record: dict) -> list[str]:
    rows = record["args"]["rows"]
    lines = [
        f"The three GEMMs of the tiny preset's four linears at {rows} token rows, {record['threads']} threads, "
        "median of round-robin rounds; each recipe's GEMM dtype read from the emulator's `gemm_input`. A recipe "
        "whose GEMMs must run in float32 to stay bit-identical (block scales that are not powers of two) pays "
        "that ratio on every GEMM of its step.",
        "",
        "| recipe | GEMM dtype | GEMM time x BF16's |",
        "|---|---|---|",
    ]
    for name, row in record["recipes"].items():
        lines.append(f"| {name} | {row['gemm_dtype']} | {row['gemm_time_over_bf16']:.2f} |")
    return lines


SECTIONS: dict[str, tuple[str, Callable[[dict], list[str]]]] = {
    "quant_throughput.json": ("FP8 quantization throughput (issue 2)", quant_throughput),
    "rl_step.json": ("RL step, FP8 vs BF16 (issue 4)", rl_step),
    "rl_step.malloc-keep-freed.json": (
        "RL step with freed buffers kept (glibc MALLOC_*_THRESHOLD_, for comparison)",
        rl_step,
    ),
    "clip_overhead.json": ("Calibrated Clipping and loss diagnostics vs the PPO loss", clip_overhead),
    "gemm_floor.json": ("The GEMM floor of each recipe's bit-identical emulation (issue 29)", gemm_floor),
}


def summarize(directory: Path) -> str:
    out = [
        "# Benchmark results (generated by `benchmarks/summarize.py`; do not edit)",
        "",
        "Ratios are measured side by side in one run on one machine; absolute times are this machine's.",
    ]
    for filename, (title, render) in SECTIONS.items():
        path = directory / filename
        if not path.exists():
            continue
        record = json.loads(path.read_text())
        out += ["", f"## {title}", "", _provenance_line(filename, record), "", *render(record)]
    return "\n".join(out) + "\n"


def main() -> None:
    directory = Path(sys.argv[1] if len(sys.argv) > 1 else "results/bench")
    target = directory / "SUMMARY.md"
    target.write_text(summarize(directory))
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
