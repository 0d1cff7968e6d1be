"""Shared fixtures for the model tests: the tiny preset at the arithmetic task's vocabulary."""

import pytest

from fp8rl.models.config import ModelConfig, get_model_config, with_tokenizer_vocab
from fp8rl.models.gpt import build_gpt_model

ARITHMETIC_VOCAB = 18  # 4 special tokens + 14 characters


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    return with_tokenizer_vocab(get_model_config("tiny"), ARITHMETIC_VOCAB)


@pytest.fixture()
def tiny_model(tiny_cfg):
    return build_gpt_model(tiny_cfg, seed=0)


@pytest.fixture(autouse=True, scope="session")
def _megatron(megatron: None) -> None:
    """Every model test runs with megatron's process state set up (tests/conftest.py)."""
