"""Fixtures for the rollout-engine tests: the arithmetic task and the tiny preset at its vocabulary."""

from __future__ import annotations

import pytest

from fp8rl.models.config import ModelConfig, get_model_config, with_tokenizer_vocab
from fp8rl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask


@pytest.fixture(scope="session")
def task() -> ArithmeticTask:
    return ArithmeticTask(ArithmeticConfig(num_train=512, num_eval=64))


@pytest.fixture(scope="session")
def tiny_cfg(task) -> ModelConfig:
    return with_tokenizer_vocab(get_model_config("tiny"), task.tokenizer.vocab_size)
