"""The two ways a study reaches into a run without the trainer knowing the study: gradient ablations and
evaluation probes. The job builds them from the config (`fp8rl.ablations`) and hands them over in `Parts`; the
trainer only calls these interfaces, so core code holds no study's rule (torchtitan's experiments rule: core never
imports them).

- A `GradientAblation` zeroes the gradient of chosen response tokens in an update (the loss value is kept; the
  share of negative-advantage tokens zeroed is logged as ``clip/synthetic_overclip_neg``). For each mini-batch
  update it gets the `UpdateSite` and returns that update's `MiniBatchAblation` (or None), whose `select` gives a
  micro-batch's rows and whose `zeroed` is asked inside the loss, with the live log-ratio.
- An `EvalProbe` adds metrics to each evaluation (it runs on every rank and returns the same metrics on each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from fp8rl import algos
from fp8rl.rollout.base import RolloutBatch


@dataclass(frozen=True)
class UpdateSite:
    """Where the trainer is when it asks an ablation for a mini-batch update's tokens."""

    step: int
    update: int  # the step's update index (from 0)
    rank: int  # the data-parallel rank
    batch: RolloutBatch  # the mini-batch (this rank's rows)
    loss_mask: torch.Tensor  # (rows, response_len)
    adv: torch.Tensor  # (rows,)
    old_logp: torch.Tensor  # (rows, response_len)


class MiniBatchAblation(Protocol):
    def select(self, index: torch.Tensor) -> MiniBatchAblation:
        """The share of a micro-batch (`index`: its rows in the mini-batch)."""
        ...

    def zeroed(self, log_ratio: torch.Tensor, tokens: algos.TokenBatch, low: float) -> torch.Tensor:
        """Bool (rows, response_len): the tokens whose gradient this update zeroes; `log_ratio` is the live
        log pi_theta / pi_old (detached), `low` the lower clip bound in force."""
        ...


class GradientAblation(Protocol):
    def for_update(self, site: UpdateSite) -> MiniBatchAblation | None:
        """The update's ablation, None when it leaves this update alone."""
        ...


class EvalProbe(Protocol):
    def __call__(self) -> dict[str, float]:
        """This evaluation's metrics of the probe."""
        ...
