"""Fixtures for the rollout-engine tests: the arithmetic task and the tiny preset at its vocabulary."""

from __future__ import annotations

import pytest

from fp8rl.config import TaskConfig
from fp8rl.models.config import ModelConfig, get_model_config, with_tokenizer_vocab
from fp8rl.tasks.arithmetic import ArithmeticTask


@pytest.fixture(scope="session")
def task() -> ArithmeticTask:
    return ArithmeticTask(TaskConfig(num_train=512, num_eval=64))


@pytest.fixture(scope="session")
def tiny_cfg(task) -> ModelConfig:
    return with_tokenizer_vocab(get_model_config("tiny"), task.tokenizer.vocab_size)


@pytest.fixture(autouse=True, scope="session")
def _megatron(megatron: None) -> None:
    """Every model test runs with megatron's process state set up (tests/conftest.py)."""
