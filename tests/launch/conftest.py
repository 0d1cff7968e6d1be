"""Fixtures for the launch tests: tiny run sizes, a warm-start cache shared across sessions, a sqlite MLflow.

The warm start (the slowest part of a tiny run on this CPU) is cached in pytest's cache directory
(``.pytest_cache/d/fp8rl-warmstart``), keyed by everything that determines it, so repeated sessions and
the Slurm jobs of the integration lane reuse it.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def tiny_overrides(warmstart_dir: Path, steps: int = 2) -> list[str]:
    """Hydra overrides that make any experiment point a seconds-per-step CPU run."""
    return [
        "warmstart.steps=30",
        "warmstart.batch_size=64",
        f"warmstart.cache_dir={warmstart_dir}",
        "task.num_eval=32",
        f"trainer.steps={steps}",
        "eval.size=16",
        "eval.every=0",
        "trainer.checkpoint_every=1",
        "trainer.log_ratio_histograms=false",
        "algo.prompts_per_step=4",
        "algo.group_size=4",
        "algo.num_minibatches=2",
    ]


@pytest.fixture(scope="session")
def warmstart_dir(request: pytest.FixtureRequest) -> Path:
    return Path(request.config.cache.mkdir("fp8rl-warmstart"))


@pytest.fixture(scope="session")
def tiny(warmstart_dir: Path) -> list[str]:
    return tiny_overrides(warmstart_dir)
