"""benchmarks/summarize.py: the summary is built from the benchmark JSONs, verdicts included."""

from __future__ import annotations

import json
from pathlib import Path

from . import load_benchmark


def phases(step: float) -> dict[str, float]:
    return {"time/rollout": 0.1, "time/old_logp": 0.1, "time/shadow": 0.0, "time/update": 0.2, "time/step": step}


def rl_step_record(fp8_step: float) -> dict:
    seconds = {"bf16": phases(1.0), "fp8_full-tensorwise": phases(fp8_step), "fp8_full-blockwise": phases(1.6)}
    return {
        "provenance": {"date": "2026-11-30T00:00:00+00:00", "git_sha": "abcdef1234567890", "version.torch": "2.13"},
        "malloc": "keep-freed (mmap 32 MiB, trim 1 GiB)",
        "args": {"prompts": 32, "steps": 5},
        "seconds": seconds,
        "summary": {"interval_K": 20, "calibrated_K_overhead_fraction": 0.007},
    }


def test_the_summary_reads_every_number_from_the_jsons(tmp_path: Path) -> None:
    (tmp_path / "rl_step.json").write_text(json.dumps(rl_step_record(1.25)))
    text = load_benchmark("summarize").summarize(tmp_path)
    assert "git abcdef123456" in text and "keep-freed" in text
    assert "| fp8_full-tensorwise | 0.100 | 0.100 | 0.000 | 0.200 | 1.250 | 1.25 | met |" in text
    assert "| fp8_full-blockwise | 0.100 | 0.100 | 0.000 | 0.200 | 1.600 | 1.60 | NOT met |" in text
    assert "+0.70% of the FP8 step (met)" in text
    assert "quantization throughput" not in text  # no JSON, no section


def test_main_writes_summary_md(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "rl_step.json").write_text(json.dumps(rl_step_record(1.7)))
    module = load_benchmark("summarize")
    monkeypatch.setattr("sys.argv", ["summarize.py", str(tmp_path)])
    module.main()
    assert "| 1.70 | NOT met |" in (tmp_path / "SUMMARY.md").read_text()


def test_the_profiled_step_is_a_table_of_each_configs_top_operators(tmp_path: Path) -> None:
    record = rl_step_record(1.25)
    record["profile"] = {
        "bf16": {"self_ms_total": 900.0, "top": [{"op": "aten::mm", "self_ms": 450.0, "calls": 10, "share": 0.5}]},
        "fp8_full-tensorwise": {
            "self_ms_total": 1200.0,
            "top": [
                {"op": "aten::mm", "self_ms": 480.0, "calls": 10, "share": 0.4},
                {"op": "aten::_to_copy", "self_ms": 240.0, "calls": 90, "share": 0.2},
            ],
        },
    }
    (tmp_path / "rl_step.json").write_text(json.dumps(record))
    text = load_benchmark("summarize").summarize(tmp_path)
    assert "| `aten::mm` | 450 (50%) | 480 (40%) |" in text
    assert "| `aten::_to_copy` | - | 240 (20%) |" in text and "| all operators | 900 | 1200 |" in text
