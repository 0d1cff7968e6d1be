"""Verifiable-reward tasks: problems, tokenizers, rewards and garbled-output detection.

Tasks register by name (``build_task(task_config("arithmetic", num_digits=3))``); importing this
package registers the built-in ones.
"""

from fp8rl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from fp8rl.tasks.base import (
    GARBLE_REASONS,
    Problem,
    Task,
    batch_rewards,
    build_task,
    garble_metrics,
    register_task,
    task_config,
    task_names,
)
from fp8rl.tasks.tokenizer import CharTokenizer, build_char_tokenizer

__all__ = [
    "GARBLE_REASONS",
    "ArithmeticConfig",
    "ArithmeticTask",
    "CharTokenizer",
    "Problem",
    "Task",
    "batch_rewards",
    "build_char_tokenizer",
    "build_task",
    "garble_metrics",
    "register_task",
    "task_config",
    "task_names",
]
