"""Small, fast run configs for trainer tests (a short warm start cached once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fp8rl.config import RunConfig


@pytest.fixture(scope="session")
def warmstart_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("warmstart")


@pytest.fixture
def small_cfg(warmstart_cache: Path, tmp_path: Path) -> RunConfig:
    """4 prompts x 4 samples, 2 mini-batches, 30-step warm start, no MLflow."""
    cfg = RunConfig()
    cfg.warmstart.steps = 30
    cfg.warmstart.batch_size = 64
    cfg.warmstart.cache_dir = str(warmstart_cache)
    cfg.task.num_eval = 32
    cfg.trainer.steps = 2
    cfg.trainer.eval_size = 16
    cfg.trainer.eval_every = 0
    cfg.trainer.checkpoint_every = 1
    cfg.trainer.out_dir = str(tmp_path / "run")
    cfg.algo.prompts_per_step = 4
    cfg.algo.group_size = 4
    cfg.algo.num_minibatches = 2
    cfg.tracking.enabled = False
    return cfg
