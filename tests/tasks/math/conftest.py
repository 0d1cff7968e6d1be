"""Shared fixtures of the math-task tests: a ``datasets`` cache inside the test's temp folder, no hub access, and
one set of mini assets (tokenizer, checkpoint, data files) per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from fp8rl.tasks.math import write_mini_assets


@pytest.fixture(autouse=True)
def _hermetic_datasets(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrow caches under the session's temp folder; the hub is declared offline (no test may reach it)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.getbasetemp() / "datasets_cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def mini_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_mini_assets(tmp_path_factory.mktemp("mini"), seed=0)
