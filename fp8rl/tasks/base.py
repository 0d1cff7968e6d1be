"""What a verifiable-reward task provides, the task registry, and batch-level reward / garble metrics.

A task brings its tokenizer (the tiny task's character tokenizer, or a Hugging Face tokenizer loaded from
the model's checkpoint), its problems (a training set and named evaluation sets), a reward and a garbled-
output detector. Tasks are configured by the run's `TaskConfig` and registered by name; each registers a
pure check of its config, run when the config is built (`fp8rl.choices`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from fp8rl.config import TaskConfig

GARBLE_REASONS = (
    "invalid_token",  # a token outside the answer grammar (a special token, an operator, ...) before <eos>
    "no_eos",  # no <eos> within the response length limit
    "unparseable",  # only grammar characters before <eos>, but no answer can be read from them
)
HELDOUT = "heldout"  # the name of the tiny task's one evaluation set


@dataclass(frozen=True)
class Problem:
    """One prompt and its reference answer (text, without special tokens)."""

    prompt: str  # e.g. "123+456="
    answer: str  # e.g. "579"


class Tokenizer(Protocol):
    """What the trainer, the engines and the rewards need from a tokenizer."""

    vocab_size: int  # ids 0 .. vocab_size - 1 are real tokens (the model's embedding may have padding rows)
    pad_id: int  # fills prompts (left) and responses (right)
    eos_ids: tuple[int, ...]  # every id that ends a response (it is part of the response)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class Task(Protocol):
    """A deterministic, verifiable-reward task with its own tokenizer."""

    name: str
    tokenizer: Tokenizer
    train_problems: list[Problem]  # RL prompts (and the warm start's, for tasks that have one)
    eval_sets: dict[str, list[Problem]]  # benchmark name -> held-out problems
    max_response_tokens: int  # response length limit, EOS included

    def prompt_ids(self, problem: Problem) -> list[int]:
        """Token ids of the prompt as the model sees it (special tokens and chat template included)."""
        ...

    def rewards(self, problems: Sequence[Problem], responses: Sequence[Sequence[int]]) -> list[float]:
        """1.0 for a right answer, else 0.0, for each (problem, response ids) pair."""
        ...

    def garble_reason(self, response_ids: Sequence[int]) -> str | None:
        """Why a response is garbled (one of GARBLE_REASONS), or None if it is well formed."""
        ...

    # Optional: ``response_metrics(responses) -> {"rollout/...": float}``, the task's own statistics of a batch
    # of responses (e.g. the chain task's junk-token rates), logged every step (`response_metrics` below);
    # ``junk_ids``: token ids that are never right (the chain task's junk letters), which the junk organism's
    # warm-start data, probe and controls use (`junk_ids` below).


# ---------------------------------------------------------------------------------------------
# Registry: name -> (config class, task factory). Unknown names raise and list the valid ones.

TaskFactory = Callable[[TaskConfig, "str | None"], Task]  # (task config, model checkpoint path) -> task
ConfigCheck = Callable[[TaskConfig], None]  # raises ValueError saying what to change


@dataclass(frozen=True)
class _Entry:
    factory: TaskFactory
    check: ConfigCheck | None


_TASKS: dict[str, _Entry] = {}


def register_task(name: str, check: ConfigCheck | None = None) -> Callable[[TaskFactory], TaskFactory]:
    """Decorator registering ``factory(task_cfg, model_path) -> Task`` under ``name``, with a pure config check;
    registering a different factory under a taken name raises."""

    def decorate(factory: TaskFactory) -> TaskFactory:
        taken = _TASKS.get(name)
        if taken is not None and taken.factory is not factory:
            raise ValueError(f"task {name!r} is already registered")
        _TASKS[name] = _Entry(factory, check)
        return factory

    return decorate


def task_names() -> list[str]:
    """Names of all registered tasks, sorted."""
    return sorted(_TASKS)


def _lookup(name: str) -> _Entry:
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; valid: {task_names()}")
    return _TASKS[name]


def check_task_config(cfg: TaskConfig) -> None:
    """The registered task's own check of `cfg` (ValueError saying what to change); unknown names raise KeyError."""
    entry = _lookup(cfg.name)
    if entry.check is not None:
        entry.check(cfg)


def build_task(cfg: TaskConfig, model_path: str | None = None) -> Task:
    """The task `cfg.name` configured by `cfg`; `model_path` is the policy's checkpoint (its tokenizer)."""
    return _lookup(cfg.name).factory(cfg, model_path)


# ---------------------------------------------------------------------------------------------
# Batch helpers.


def batch_rewards(task: Task, problems: Sequence[Problem], responses: Sequence[Sequence[int]]) -> torch.Tensor:
    """Rewards of a batch of responses -> (batch,) fp32."""
    if len(problems) != len(responses):
        raise ValueError(f"{len(problems)} problems but {len(responses)} responses")
    return torch.tensor(task.rewards(problems, responses), dtype=torch.float32)


def response_metrics(task: Task, responses: Sequence[Sequence[int]]) -> dict[str, float]:
    """The task's own per-batch response statistics (its optional ``response_metrics``), else none."""
    own = getattr(task, "response_metrics", None)
    return dict(own(responses)) if own is not None else {}


def junk_ids(task: Task) -> frozenset[int]:
    """The task's junk token ids (its optional ``junk_ids``); empty for a task without them."""
    return frozenset(getattr(task, "junk_ids", frozenset()))


def token_classes(task: Task) -> dict[str, frozenset[int]]:
    """The task's response tokens by class (its optional ``token_classes``: class name -> ids), for FP8's
    clipping error per class; empty for a task without them."""
    return dict(getattr(task, "token_classes", {}))


def garble_metrics(reasons: Sequence[str | None]) -> dict[str, float]:
    """Share of garbled responses, overall and per reason (every reason always present), as ``rollout/`` metrics."""
    counts = Counter(reason for reason in reasons if reason is not None)
    total = max(len(reasons), 1)
    metrics = {"rollout/garbled_rate": sum(counts.values()) / total}
    for reason in sorted(set(GARBLE_REASONS) | set(counts)):
        metrics[f"rollout/garbled_{reason}"] = counts[reason] / total
    return metrics
