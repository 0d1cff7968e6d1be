"""`ParallelDims`: where this rank is and what it runs, one object built once and handed to every builder.

torchtitan's ``ParallelDims`` is the model: the job builds it after megatron's process state exists
(`fp8rl.models.runtime.init_megatron`) and the policy, the rollout engine and the trainer all read it.
It holds

- the run's planned layout (`ParallelLayout`, checked by preflight): sizes, sequence length, micro-batch,
  where and how the rollout runs (placement, vLLM TP, its memory share, sleep mode);
- this rank's coordinates in megatron's groups (TP, PP and DP sizes and ranks), which must equal the plan's;
- the data-parallel group and the reductions over it. Every rank runs the same trainer (SPMD); data is a
  function of (seed, step, prompt index), never of the rank, and a rank takes its contiguous share of each
  step's groups. Statistics that decide something (loss normalisers, clip-bound quantiles, metrics) are
  reduced over DP with these helpers, so a run's numbers do not depend on the layout. With one rank every
  helper is the identity.

The launcher's rendezvous description (`fp8rl.job.distributed.DistEnv`) is read once, to create the
process group; nothing after that needs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fp8rl.models.parallel import ParallelLayout

ONE_PROCESS = ParallelLayout(gpus_per_node=1)


@dataclass(frozen=True)
class ParallelDims:
    """This rank's place in the run (module docstring). The defaults describe one process."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    plan: ParallelLayout = field(default=ONE_PROCESS)
    dp_group: Any = None  # None: one process, or the default group (tests of DP alone)
    tp_group: Any = None  # None: TP = 1
    pp_group: Any = None  # None: PP = 1

    @classmethod
    def current(cls, plan: ParallelLayout | None = None) -> ParallelDims:
        """This rank's dims from megatron's groups; `plan` (None: one node of exactly these ranks) must agree."""
        from megatron.core import parallel_state as ps

        sizes = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_data_parallel_world_size(),
        )
        if plan is None:
            plan = ParallelLayout(tensor_parallel=sizes[0], pipeline_parallel=sizes[1], gpus_per_node=math.prod(sizes))
        planned = (plan.tensor_parallel, plan.pipeline_parallel, plan.data_parallel)
        if sizes != planned:
            raise RuntimeError(f"megatron's groups are TP x PP x DP = {sizes}, the run's layout says {planned}")
        return cls(
            *sizes,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            plan=plan,
            dp_group=ps.get_data_parallel_group() if sizes[2] > 1 else None,
            tp_group=ps.get_tensor_model_parallel_group() if sizes[0] > 1 else None,
            pp_group=ps.get_pipeline_model_parallel_group() if sizes[1] > 1 else None,
        )

    @property
    def model_split(self) -> bool:
        """Whether this rank holds only part of the model (TP or PP > 1)."""
        return self.tp * self.pp > 1

    # ------------------------------------------------------------------------------ rollout placement
    def rollout_engine_settings(self, device: str) -> dict[str, Any]:
        """What the vLLM engine needs from the layout: its TP, the longest sequence, and on CUDA its memory share
        and sleep mode (colocated engines sleep while the trainer computes)."""
        plan = self.plan
        settings: dict[str, Any] = {
            "tensor_parallel_size": plan.rollout_tensor_parallel,
            "max_model_len": plan.max_seq_len,
            "enable_sleep_mode": device == "cuda" and plan.rollout_placement == "colocated" and plan.rollout_sleep,
        }
        if device == "cuda":
            settings["gpu_memory_utilization"] = plan.rollout_memory_fraction
        return settings

    # ------------------------------------------------------------------------------ data parallelism
    def share(self, num_items: int) -> slice:
        """This rank's contiguous share of `num_items` items (num_items must divide evenly over DP)."""
        if num_items % self.dp:
            raise ValueError(f"{num_items} items do not split over {self.dp} data-parallel ranks")
        per_rank = num_items // self.dp
        return slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks (a new tensor; the input is left alone)."""
        return self._all_reduce(tensor, dist.ReduceOp.SUM)

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(tensor, dist.ReduceOp.MAX)

    def mean_of_floats(self, values: dict[str, float]) -> dict[str, float]:
        """The mean over data-parallel ranks of each metric (every rank passes the same keys, in any order)."""
        if self.dp == 1 or not values:
            return dict(values)
        keys = sorted(values)
        total = self.sum(torch.tensor([values[k] for k in keys], dtype=torch.float64))
        return {k: float(v) / self.dp for k, v in zip(keys, total.tolist(), strict=True)}

    def gather_1d(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every data-parallel rank's 1-D tensor concatenated in rank order (lengths may differ)."""
        if self.dp == 1:
            return tensor
        length = torch.tensor([tensor.numel()], dtype=torch.long)
        lengths = [torch.zeros_like(length) for _ in range(self.dp)]
        dist.all_gather(lengths, length, group=self.dp_group)
        longest = int(max(int(n) for n in lengths))
        padded = torch.zeros(longest, dtype=tensor.dtype)
        padded[: tensor.numel()] = tensor.detach().cpu()
        parts = [torch.zeros_like(padded) for _ in range(self.dp)]
        dist.all_gather(parts, padded, group=self.dp_group)
        return torch.cat([part[: int(n)] for part, n in zip(parts, lengths, strict=True)]).to(tensor.device)

    def all_gather_objects(self, value: Any) -> list[Any]:
        """Every data-parallel rank's `value` (picklable), in rank order."""
        if self.dp == 1:
            return [value]
        out: list[Any] = [None] * self.dp
        dist.all_gather_object(out, value, group=self.dp_group)
        return out

    def max_over_model_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        """The max over the data-parallel ranks and this rank's tensor-parallel group (a layer's heads are split
        over TP): a statistic of every copy and shard of the model, the same on every rank."""
        out = self.max(tensor)
        if self.tp > 1:
            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.tp_group)
        return out

    def union_over_stages(self, value: dict) -> dict:
        """Every pipeline stage's `value` in one dict (each stage holds its own layers' entries): what a rank needs
        whose engine runs the whole model (vLLM)."""
        if self.pp == 1:
            return value
        parts: list[Any] = [None] * self.pp
        dist.all_gather_object(parts, value, group=self.pp_group)
        return {key: item for part in parts for key, item in part.items()}

    def _all_reduce(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        out = tensor.detach().clone()
        if self.dp > 1:
            dist.all_reduce(out, op=op, group=self.dp_group)
        return out


SINGLE = ParallelDims()
