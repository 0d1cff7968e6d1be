"""One step's data: prompts -> this rank's share of the rollout -> rewards -> advantages (-> DAPO refill).

Everything random is a function of (seed, step, round, prompt index, sample index), never of the rank:
the prompts of a step are drawn from one (seed, step, round) generator, and each sampled row has its own
seed, so DP = 1 and DP = 2 sample the same responses. A rank rolls out a contiguous share of the step's
groups (whole groups: advantages are computed within a group).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fp8rl import algos
from fp8rl.config import AlgoConfig
from fp8rl.models.dims import SINGLE, ParallelDims
from fp8rl.models.sampling import SamplingConfig
from fp8rl.rollout.base import RolloutBatch, RolloutEngine
from fp8rl.tasks.base import Problem, Task, batch_rewards, garble_metrics, response_metrics
from fp8rl.trainer.hooks import MiniBatchAblation

STEP_SEED_STRIDE = 1_000_003
PROMPT_SALT, SAMPLE_SALT, SHUFFLE_SALT = 1, 2, 3


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """The seed of (run seed, step, salt): resumed runs draw exactly the same data."""
    return seed * STEP_SEED_STRIDE + step * 7919 + salt


def step_generator(seed: int, step: int, salt: int = 0) -> torch.Generator:
    """A torch generator that depends only on (seed, step, salt)."""
    return torch.Generator().manual_seed(step_seed(seed, step, salt))


def epoch_key(step: int, epoch: int) -> int:
    """The key of a step's PPO epoch for `step_seed` (its mini-batch shuffle)."""
    return step * 131 + epoch


def update_key(step: int, update: int, rank: int) -> int:
    """The key of one mini-batch update on one data-parallel rank for `step_seed` (a study's ablation draws)."""
    return step * 1009 + update * 31 + rank


def row_seeds(seed: int, step: int, round_: int, rows: range) -> list[int]:
    """One sampling seed per global row index of a step's round (the same whatever rank samples the row)."""
    base = step_generator(seed, step, salt=SAMPLE_SALT if round_ == 0 else 200 + round_)
    table = torch.randint(0, 2**62, (rows.stop,), generator=base)
    return [int(table[i]) for i in rows]


@dataclass
class StepBatch:
    """This rank's share of a step: rollout rows, their advantages and which rows carry loss."""

    rollout: RolloutBatch
    adv: torch.Tensor  # (rows,) per-sequence advantages
    keep: torch.Tensor  # (rows,) bool: rows of groups with reward variation (DAPO), else all True
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def loss_mask(self) -> torch.Tensor:
        """(rows, response_len): response tokens that carry loss."""
        return self.rollout.response_mask * self.keep[:, None].long()


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a mini-batch: the sequences the model scores (ids and mask (b, s), the last
    `response_len` positions scored) and the tensors the objective reads."""

    rows: torch.Tensor  # (b,) its rows in the mini-batch
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_len: int
    tokens: algos.TokenBatch
    ablations: tuple[MiniBatchAblation, ...] = ()  # a study's gradient ablations, this micro-batch's share


def micro_batches(
    mb: RolloutBatch, tokens: algos.TokenBatch, size: int | None, ablations: Sequence[MiniBatchAblation] = ()
) -> list[MicroBatch]:
    """A mini-batch cut into micro-batches of `size` rows (pipeline parallelism); one when `size` is None."""
    rows = mb.response_ids.shape[0]
    size = size or rows
    items = []
    for start in range(0, rows, size):
        index = torch.arange(start, min(start + size, rows), device=tokens.mask.device)
        part = mb.select(index)
        shares = tuple(ablation.select(index) for ablation in ablations)
        sequences = (part.input_ids, part.attention_mask, part.response_ids.shape[1])
        items.append(MicroBatch(index, *sequences, tokens.select(index), shares))
    return items


class StepSampler:
    """Draws a step's prompts, samples this rank's share, scores it."""

    def __init__(
        self,
        task: Task,
        engine: RolloutEngine,
        sampling: SamplingConfig,
        algo: AlgoConfig,
        seed: int,
        dims: ParallelDims = SINGLE,
    ) -> None:
        if algo.prompts_per_step % dims.dp:
            raise ValueError(
                f"algo.prompts_per_step={algo.prompts_per_step} does not split over {dims.dp} data-parallel ranks"
            )
        self.task, self.engine, self.sampling, self.algo = task, engine, sampling, algo
        self.seed, self.dims = seed, dims

    def problems(self, step: int, round_: int = 0) -> list[Problem]:
        """All prompts of the step's round (the same on every rank): a (seed, step, round)-determined draw."""
        gen = step_generator(self.seed, step, salt=PROMPT_SALT if round_ == 0 else 100 + round_)
        picks = torch.randint(len(self.task.train_problems), (self.algo.prompts_per_step,), generator=gen)
        return [self.task.train_problems[int(i)] for i in picks]

    def rollout(self, step: int, round_: int = 0) -> tuple[list[Problem], RolloutBatch]:
        """This rank's groups of the round: G samples of each of its prompts, with rollout log-probs."""
        group = self.algo.group_size
        mine = self.problems(step, round_)[self.dims.share(self.algo.prompts_per_step)]
        repeated = [p for p in mine for _ in range(group)]
        first_row = self.dims.share(self.algo.prompts_per_step).start * group
        seeds = row_seeds(self.seed, step, round_, range(first_row, first_row + len(repeated)))
        prompts = [self.task.prompt_ids(p) for p in repeated]
        return repeated, self.engine.generate(prompts, self.sampling, seeds)

    def score(self, problems: list[Problem], rollout: RolloutBatch) -> StepBatch:
        """Rewards (with DAPO's overlong shaping), advantages, DAPO's keep mask and the reward metrics."""
        a = self.algo
        responses = rollout.responses()
        task_reward = batch_rewards(self.task, problems, responses)
        reward = task_reward.clone()
        lengths = rollout.response_mask.sum(dim=1)
        if a.overlong_buffer > 0:
            reward = reward + algos.overlong_penalty(
                lengths, self.sampling.max_new_tokens, a.overlong_buffer, a.overlong_factor
            )
        estimator = algos.get_advantage_estimator(a.advantage)
        options = algos.declared_options(estimator, norm_by_std=a.norm_adv_by_std)
        adv = estimator(reward, group_size=a.group_size, **options)
        keep = torch.ones_like(reward, dtype=torch.bool)
        metrics = {
            "rollout/reward": float(task_reward.mean()),
            "rollout/shaped_reward": float(reward.mean()),
            "rollout/response_len": float(lengths.float().mean()),
        }
        metrics.update(garble_metrics([self.task.garble_reason(r) for r in responses]))
        metrics.update(response_metrics(self.task, responses))
        if a.dynamic_sampling:
            kept = algos.filter_uniform_groups(reward, a.group_size)
            keep = kept.keep
            metrics["rollout/dropped_groups"] = float(kept.num_dropped_groups)
        return StepBatch(rollout, adv, keep, metrics)

    def collect(self, step: int) -> StepBatch:
        """The step's batch (this rank's share). With DAPO's dynamic sampling and ``algo.resample_rounds``
        = R > 0, up to R more rounds of fresh prompts are sampled until ``prompts_per_step`` groups with
        reward variation are collected over all ranks; the batch is those groups (first come first, in
        global order), topped up with dropped groups of the first round (masked out) when R rounds were
        not enough. Its size never changes; ``rollout/*`` reward metrics describe the first round."""
        first = self.score(*self.rollout(step))
        first.metrics = self._global_metrics(first.metrics)
        if not self.algo.dynamic_sampling or self.algo.resample_rounds == 0:
            return first
        rounds = [first]
        while len(rounds) <= self.algo.resample_rounds and self._kept_groups(rounds) < self.algo.prompts_per_step:
            rounds.append(self.score(*self.rollout(step, len(rounds))))
        refilled = self._refill(rounds)
        refilled.metrics = {
            **first.metrics,
            "rollout/sampling_rounds": float(len(rounds)),
            "rollout/kept_groups": float(min(self._kept_groups(rounds), self.algo.prompts_per_step)),
        }
        return refilled

    def _global_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Means over ranks (equal shares), but the dropped-group count is a sum."""
        out = self.dims.mean_of_floats(metrics)
        if "rollout/dropped_groups" in out:
            out["rollout/dropped_groups"] *= self.dims.dp
        return out

    def _group_flags(self, part: StepBatch) -> torch.Tensor:
        """Kept flag of each group of a round, over all ranks in global order."""
        return self.dims.gather_1d(part.keep.view(-1, self.algo.group_size)[:, 0])

    def _kept_groups(self, rounds: list[StepBatch]) -> int:
        return sum(int(self._group_flags(part).sum()) for part in rounds)

    def _refill(self, rounds: list[StepBatch]) -> StepBatch:
        group, wanted = self.algo.group_size, self.algo.prompts_per_step
        flags = [self._group_flags(part) for part in rounds]
        kept = [(r, g) for r, f in enumerate(flags) for g in range(len(f)) if f[g]]
        dropped_first = [(0, g) for g in range(len(flags[0])) if not flags[0][g]]
        chosen = (kept + dropped_first)[:wanted][self.dims.share(wanted)]
        every_row = [gather_step_batch(part, self.dims, self.sampling.pad_token_id) for part in rounds]
        rows = [torch.arange(g * group, (g + 1) * group) for _, g in chosen]
        pad_id = self.sampling.pad_token_id
        parts = [every_row[r].rollout.select(idx) for (r, _), idx in zip(chosen, rows, strict=True)]
        rollout = RolloutBatch.concat(parts, pad_id)
        adv = torch.cat([every_row[r].adv[idx] for (r, _), idx in zip(chosen, rows, strict=True)])
        keep = torch.cat([every_row[r].keep[idx] for (r, _), idx in zip(chosen, rows, strict=True)])
        return StepBatch(rollout, adv, keep)


def gather_step_batch(part: StepBatch, dims: ParallelDims, pad_id: int) -> StepBatch:
    """Every rank's rows of a round, in global order (identity with one rank)."""
    if dims.dp == 1:
        return part
    import torch.distributed as dist

    widths = torch.tensor([part.rollout.prompt_ids.shape[1], part.rollout.response_ids.shape[1]])
    widest = dims.max(widths)
    padded = RolloutBatch.concat([part.rollout], pad_id, prompt_len=int(widest[0]), response_len=int(widest[1]))
    tensors = [*(getattr(padded, name) for name in RolloutBatch.FIELDS), part.adv, part.keep.long()]
    gathered = []
    for tensor in tensors:
        out = [torch.empty_like(tensor) for _ in range(dims.dp)]
        dist.all_gather(out, tensor.contiguous(), group=dims.dp_group)
        gathered.append(torch.cat(out))
    rollout = RolloutBatch(*gathered[: len(RolloutBatch.FIELDS)])
    return StepBatch(rollout, gathered[-2], gathered[-1].bool())
