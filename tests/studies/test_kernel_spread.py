"""The kernel-spread study's table: verdicts per setting, ranges per arm, and the same-start check."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from fp8rl.studies import kernel_spread as ks


def summary(bf16: float, fp8: float, cc: float, fp8_own: float, cc_own: float) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "run": ["bf16", "fp8_tensorwise", "cc_tensorwise"],
            "clip/low_neg (mean)": [bf16, fp8, cc],
            "over-clip at own bounds (neg, mean)": [None, fp8_own, cc_own],
            "final eval accuracy": [0.80, 0.78, 0.79],
            "mean reward": [0.7, 0.68, 0.69],
        }
    )


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def start_file(setting: str, arm: str, sha: str) -> None:
    folder = Path("outputs") / (ks.EXPERIMENT_PREFIX + setting) / arm
    folder.mkdir(parents=True)
    (folder / "start_weights.json").write_text(json.dumps({"source": "warm start", "sha256": sha}))


def test_the_report_counts_verdicts_states_ranges_and_checks_the_start(in_tmp: Path) -> None:
    summaries = {
        "default": summary(0.007, 0.014, 0.011, 0.029, 0.021),
        "aten-avx2": summary(0.008, 0.012, 0.013, 0.025, 0.027),  # CC worse here: two verdicts fail
    }
    for setting in summaries:
        for arm in ks.ARMS:
            start_file(setting, arm, "ab" * 32)
    ids = {s: {arm: f"{s}-{arm}" for arm in ks.ARMS} for s in summaries}
    csv_path, md_path = ks.write_report(summaries, in_tmp / "results", ids)
    table = pd.read_csv(csv_path)
    assert len(table) == 6 and set(table["run_id"]) == {f"{s}-{a}" for s in summaries for a in ks.ARMS}
    assert not any("," in column for column in table.columns)  # tidy names
    text = md_path.read_text()
    assert "fp8_inflates_low_neg 2 of 2, cc_lowers_overclip 1 of 2, cc_low_neg_below_fp8 1 of 2" in text
    assert "every run started from one warm start (sha256 abababababababab" in text
    ranges = ks.ranges(table)
    fp8 = ranges.set_index("arm").loc["fp8_tensorwise"]
    assert (fp8["low_neg_mean min"], fp8["low_neg_mean max"]) == (0.012, 0.014)


def test_a_run_that_started_elsewhere_is_called_out(in_tmp: Path) -> None:
    summaries = {"default": summary(0.007, 0.014, 0.011, 0.029, 0.021)}
    for arm, sha in zip(ks.ARMS, ["aa", "aa", "bb"], strict=True):
        start_file("default", arm, sha)
    _, md_path = ks.write_report(summaries, in_tmp / "results", {})
    assert "Same start: NO" in md_path.read_text()


def test_a_setting_is_exactly_its_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = {}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # left in the shell: must not leak into another setting
    monkeypatch.setattr(ks.subprocess, "run", lambda command, env, check: seen.update(env=env, command=command))
    ks.run_setting("aten-avx2", tmp_path, steps=3)
    assert seen["env"]["ATEN_CPU_CAPABILITY"] == "avx2" and "ONEDNN_MAX_CPU_ISA" not in seen["env"]
    assert seen["command"][-2:] == ["--experiment", "kernel-spread-aten-avx2"]
