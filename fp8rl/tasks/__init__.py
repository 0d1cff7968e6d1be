"""Verifiable-reward tasks: problems, tokenizers, rewards and garbled-output detection.

Tasks register by name (``build_task(TaskConfig(name="arithmetic"))``); importing this package registers
the built-in ones: ``arithmetic`` (the tiny CPU task), ``chain`` (running-sum chains with junk tokens: the
CPU-scale collapse study's task) and ``math`` (the paper's math data sets with a
verifier reward, `fp8rl.tasks.math`).
"""

from fp8rl.tasks import math as _math  # noqa: F401 - registers the "math" task
from fp8rl.tasks.arithmetic import ArithmeticTask
from fp8rl.tasks.base import (
    GARBLE_REASONS,
    HELDOUT,
    Problem,
    Task,
    Tokenizer,
    batch_rewards,
    build_task,
    check_task_config,
    garble_metrics,
    register_task,
    response_metrics,
    task_names,
)
from fp8rl.tasks.chain import ChainTask
from fp8rl.tasks.tokenizer import CharTokenizer, build_char_tokenizer


def dataset_names() -> list[str]:
    """Names of the math data sets a `TaskConfig` may name (training sets and benchmarks)."""
    from fp8rl.tasks.math.sources import DATASETS

    return sorted(DATASETS)


__all__ = [
    "GARBLE_REASONS",
    "HELDOUT",
    "ArithmeticTask",
    "ChainTask",
    "CharTokenizer",
    "Problem",
    "Task",
    "Tokenizer",
    "batch_rewards",
    "build_char_tokenizer",
    "build_task",
    "check_task_config",
    "dataset_names",
    "garble_metrics",
    "register_task",
    "response_metrics",
    "task_names",
]
