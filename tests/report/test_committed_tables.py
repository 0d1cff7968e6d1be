"""The committed tables are what the report code makes of their own per-run files (`make tables` re-renders them:
the same files give the same text, to the byte).

A change of the tables' layout or statistics fails here until the tables in results/ are re-rendered with it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fp8rl.report.__main__ import TABLE_EXPERIMENTS, main

RESULTS = Path(__file__).resolve().parents[2] / "results" / "tiny"
COMMITTED = sorted(e for e in TABLE_EXPERIMENTS if (RESULTS / f"{e}-tiny.runs.csv").exists())


@pytest.mark.skipif(not COMMITTED, reason="no committed table in results/tiny")
def test_every_committed_table_is_its_per_run_files_re_rendered(tmp_path: Path) -> None:
    for experiment in COMMITTED:
        for suffix in (".runs.csv", ".runs.json"):
            shutil.copy(RESULTS / f"{experiment}-tiny{suffix}", tmp_path)
    assert main(["--out", str(tmp_path), "rebuild"]) == 0
    for experiment in COMMITTED:
        for suffix in (".md", ".csv", ".paired.csv", ".runs.csv", ".runs.json"):
            committed = RESULTS / f"{experiment}-tiny{suffix}"
            if not committed.exists():  # a table without paired sections
                assert not (tmp_path / committed.name).exists(), committed.name
                continue
            lines = committed.read_text().splitlines()
            again = (tmp_path / committed.name).read_text().splitlines()
            assert again == lines, f"{committed.name}: run `make tables` after changing the report"
