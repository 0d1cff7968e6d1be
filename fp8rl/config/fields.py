"""What every config section is built from: `option` (a field with its help and its part in the run's
identity), `ConfigError`, and the vocabularies no registry owns."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A config that cannot run; the message says what to change."""


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    neutral: tuple[Any, ...] = (),
    hashed: bool = True,
    **kwargs: Any,
) -> Any:
    """A config field with its one-line help (shown by ``make docs`` in docs/configuration.md) and what it means
    for a run's identity (``fp8rl.identity`` derives the config hash from these):

    - ``hashed=False``: the field changes where or how fast a run runs, not what it computes;
    - ``neutral``: for a field added after runs were published, the value(s) that reproduce the behaviour from
      before it existed; at them the field is left out of the hash, so finished runs keep their identity."""
    metadata = {"help": help, "neutral": tuple(neutral), "hashed": hashed}
    if isinstance(default, dict):
        frozen = dict(default)
        return field(default_factory=lambda: dict(frozen), metadata=metadata, **kwargs)
    return field(default=default, metadata=metadata, **kwargs)


# Vocabularies that no registry owns: what the pipeline itself can do.
PRECISION_MODES = ("bf16", "fp8_rollout", "fp8_full")
FP8_BACKENDS = ("emulated", "te", "torchao")
DEVICES = ("cpu", "cuda")
PLACEMENTS = ("colocated", "separate")


def _one_of(value: Any, valid: tuple, where: str) -> None:
    if value not in valid:
        raise ConfigError(f"{where}={value!r} is not valid; choose one of {list(valid)}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
