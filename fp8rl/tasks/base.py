"""What a verifiable-reward task provides, the task registry, and batch-level reward / garble metrics."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fp8rl.tasks.tokenizer import CharTokenizer

GARBLE_REASONS = (
    "invalid_token",  # a token outside the answer grammar (a special token, an operator, ...) before <eos>
    "no_eos",  # no <eos> within the response length limit
    "unparseable",  # only grammar characters before <eos>, but no answer can be read from them
)


@dataclass(frozen=True)
class Problem:
    """One prompt and its reference answer (text, without special tokens)."""

    prompt: str  # e.g. "123+456="
    answer: str  # e.g. "579"


class Task(Protocol):
    """A deterministic, verifiable-reward task with its own tokenizer."""

    tokenizer: CharTokenizer
    train_problems: list[Problem]  # prompts for warm start and RL
    eval_problems: list[Problem]  # held out, disjoint from train_problems
    max_response_tokens: int  # response length limit, EOS included

    def prompt_ids(self, problem: Problem) -> list[int]:
        """Token ids of the prompt, starting with <bos>."""
        ...

    def target_ids(self, problem: Problem) -> list[int]:
        """Token ids of the reference response: the answer then <eos>."""
        ...

    def reward(self, problem: Problem, response_ids: Sequence[int]) -> float:
        """1.0 for an exactly right answer before <eos>, else 0.0."""
        ...

    def garble_reason(self, response_ids: Sequence[int]) -> str | None:
        """Why a response is garbled (one of GARBLE_REASONS), or None if it is well formed."""
        ...


# ---------------------------------------------------------------------------------------------
# Registry: name -> (config class, task factory). Unknown names raise and list the valid ones.

_TASKS: dict[str, tuple[type, Callable[[Any], Task]]] = {}


def register_task(name: str, config_cls: type) -> Callable[[Callable[[Any], Task]], Callable[[Any], Task]]:
    """Decorator registering a factory ``config -> Task`` under ``name``; a different one under a taken name raises."""

    def decorate(factory: Callable[[Any], Task]) -> Callable[[Any], Task]:
        taken = _TASKS.get(name)
        if taken is not None and taken != (config_cls, factory):
            raise ValueError(f"task {name!r} is already registered")
        _TASKS[name] = (config_cls, factory)
        return factory

    return decorate


def task_names() -> list[str]:
    """Names of all registered tasks, sorted."""
    return sorted(_TASKS)


def _lookup(name: str) -> tuple[type, Callable[[Any], Task]]:
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; valid: {task_names()}")
    return _TASKS[name]


def task_config(name: str, **overrides: Any) -> Any:
    """The config dataclass of task ``name`` with its defaults and ``overrides``."""
    config_cls, _ = _lookup(name)
    return config_cls(**overrides)


def build_task(cfg: Any) -> Task:
    """The task for a config produced by :func:`task_config` (its ``name`` field selects the task)."""
    config_cls, factory = _lookup(cfg.name)
    if not isinstance(cfg, config_cls):
        raise TypeError(f"task {cfg.name!r} expects a {config_cls.__name__}, got {type(cfg).__name__}")
    return factory(cfg)


# ---------------------------------------------------------------------------------------------
# Batch helpers.


def batch_rewards(task: Task, problems: Sequence[Problem], responses: Sequence[Sequence[int]]) -> torch.Tensor:
    """Rewards of a batch of responses -> (batch,) fp32."""
    if len(problems) != len(responses):
        raise ValueError(f"{len(problems)} problems but {len(responses)} responses")
    return torch.tensor([task.reward(p, r) for p, r in zip(problems, responses, strict=True)], dtype=torch.float32)


def garble_metrics(reasons: Sequence[str | None]) -> dict[str, float]:
    """Share of garbled responses, overall and per reason (every reason always present), as ``rollout/`` metrics."""
    counts = Counter(reason for reason in reasons if reason is not None)
    total = max(len(reasons), 1)
    metrics = {"rollout/garbled_rate": sum(counts.values()) / total}
    for reason in sorted(set(GARBLE_REASONS) | set(counts)):
        metrics[f"rollout/garbled_{reason}"] = counts[reason] / total
    return metrics
