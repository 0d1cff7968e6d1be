"""The trainer's view of data parallelism: which share of each batch this rank owns, and reductions.

Every rank of a job runs the same trainer (SPMD). Data is a function of (seed, step, prompt index), never
of the rank; a rank takes its contiguous share of the step's groups. Statistics that decide something
(loss normalisers, clip-bound quantiles, metrics) are reduced over the data-parallel group with these
helpers, so a run's numbers do not depend on the layout. With one rank every helper is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DataParallel:
    """This rank's place among the data-parallel replicas (``group`` None = one process, or the default group)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def share(self, num_items: int) -> slice:
        """This rank's contiguous share of `num_items` items (num_items must divide evenly)."""
        if num_items % self.size:
            raise ValueError(f"{num_items} items do not split over {self.size} data-parallel ranks")
        per_rank = num_items // self.size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (a new tensor; the input is left alone)."""
        return self._all_reduce(tensor, dist.ReduceOp.SUM)

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(tensor, dist.ReduceOp.MAX)

    def mean_of_floats(self, values: dict[str, float]) -> dict[str, float]:
        """The mean over ranks of each metric (every rank must pass the same keys, in any order)."""
        if self.size == 1 or not values:
            return dict(values)
        keys = sorted(values)
        total = self.sum(torch.tensor([values[k] for k in keys], dtype=torch.float64))
        return {k: float(v) / self.size for k, v in zip(keys, total.tolist(), strict=True)}

    def gather_1d(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's 1-D tensor, in rank order (lengths may differ between ranks)."""
        if self.size == 1:
            return tensor
        length = torch.tensor([tensor.numel()], dtype=torch.long)
        lengths = [torch.zeros_like(length) for _ in range(self.size)]
        dist.all_gather(lengths, length, group=self.group)
        longest = int(max(int(n) for n in lengths))
        padded = torch.zeros(longest, dtype=tensor.dtype)
        padded[: tensor.numel()] = tensor.detach().cpu()
        parts = [torch.zeros_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[: int(n)] for part, n in zip(parts, lengths, strict=True)]).to(tensor.device)

    def all_gather_objects(self, value: Any) -> list[Any]:
        """Every rank's `value` (picklable), in rank order."""
        if self.size == 1:
            return [value]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _all_reduce(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        out = tensor.detach().clone()
        if self.size > 1:
            dist.all_reduce(out, op=op, group=self.group)
        return out


SINGLE = DataParallel()
