"""Shared fixtures for the model tests: the tiny preset at the arithmetic task's vocabulary.

megatron-core is imported inside the fixtures, not here: on a GPU image without it (benchmarks/gpu_check.sh
on a torch-only host) the tests that need a model skip with the reason instead of failing collection.
"""

import pytest

from fp8rl.models.config import ModelConfig, get_model_config, with_tokenizer_vocab

ARITHMETIC_VOCAB = 18  # 4 special tokens + 14 characters


def require_megatron() -> None:
    """Skip the calling test when megatron-core cannot be imported (the reason says why)."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as err:
        pytest.skip(f"needs megatron-core ({err})")


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    return with_tokenizer_vocab(get_model_config("tiny"), ARITHMETIC_VOCAB)


@pytest.fixture()
def tiny_model(tiny_cfg):
    require_megatron()
    from fp8rl.models.gpt import build_gpt_model

    return build_gpt_model(tiny_cfg, seed=0)


@pytest.fixture(autouse=True, scope="session")
def _megatron(megatron: None) -> None:
    """Every model test runs with megatron's process state set up (tests/conftest.py)."""
