"""`python -m fp8rl.report`: what it writes into results/ names no path of the machine that built it."""

from __future__ import annotations

from pathlib import Path

from fp8rl.report.__main__ import main
from tests.report.test_figures import store  # noqa: F401 - the synthetic three-seed sweep


def test_tables_figures_and_index_hold_no_local_path(store: str, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "results"
    for what in (["table", "grpo_granularity"], ["figures"], ["index"]):
        assert main(["--tracking-uri", store, "--out", str(out), *what]) == 0
    written = [p for p in out.rglob("*") if p.is_file() and p.suffix in (".md", ".json", ".csv")]
    assert {"PROVENANCE.json", "INDEX.md", "grpo_granularity-tiny.md"} <= {p.name for p in written}
    leaks = [p.name for p in written if str(tmp_path) in p.read_text() or "/tmp/" in p.read_text()]
    assert leaks == []


def test_a_path_inside_a_runs_description_is_made_relative() -> None:
    from fp8rl.report.tables import _without_local_paths

    text = f"Command: `python -m submitit.core._submit {Path.cwd()}/outputs/sweeps/x/%j`"
    assert _without_local_paths({"tags": {"mlflow.note.content": text}}) == {
        "tags": {"mlflow.note.content": "Command: `python -m submitit.core._submit outputs/sweeps/x/%j`"}
    }
