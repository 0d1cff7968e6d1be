"""The RL step: rollout -> rewards -> advantages -> old log-probs -> (BF16 shadow, calibration) -> PPO
mini-batch updates -> metrics. The trainer runs steps on parts the job built (`Parts`); it knows no
launcher, no tracker and no config file.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import random
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from fp8rl import algos
from fp8rl.config import AlgoConfig, ClippingConfig, EvalConfig, RunConfig, TrainerConfig
from fp8rl.models.dims import SINGLE, ParallelDims
from fp8rl.models.gpt import fp8_switchable_linears
from fp8rl.models.kv_cache import kv_amax, kv_scales_from_amax, recording_kv_amax
from fp8rl.models.policy import Policy, unwrapped
from fp8rl.models.sampling import SamplingConfig
from fp8rl.quant import DelayedScalingState
from fp8rl.rollout.base import RolloutBatch, RolloutEngine
from fp8rl.tasks.base import Task, junk_ids, token_classes
from fp8rl.trainer.batch import (
    SHUFFLE_SALT,
    MicroBatch,
    StepBatch,
    StepSampler,
    epoch_key,
    micro_batches,
    step_seed,
)
from fp8rl.trainer.evaluation import Evaluator
from fp8rl.trainer.hooks import EvalProbe, GradientAblation, MiniBatchAblation, UpdateSite
from fp8rl.trainer.optim import PolicyOptimizer
from fp8rl.trainer.precision import PrecisionPlan, running_in
from fp8rl.trainer.shadow import ShadowComparison, ratio_histogram, sequence_keys

log = logging.getLogger(__name__)


@dataclass
class Parts:
    """What the job builds and the trainer runs on."""

    policy: Policy  # this rank's part of the trained model (fp32 masters; its module Megatron-DDP-wrapped)
    optimizer: PolicyOptimizer
    engine: RolloutEngine
    task: Task
    clip_policy: algos.ClipBoundPolicy
    objective: algos.Objective  # the loss and its options, the rollout correction, KL and entropy terms
    plan: PrecisionPlan
    sampling: SamplingConfig
    reference: torch.nn.Module | None = None  # frozen start policy for the KL penalty (algo.kl_coef > 0)
    dims: ParallelDims = SINGLE
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    micro_batch_size: int | None = None  # rows per forward/backward pass (None: a mini-batch / batch at once)
    ablations: tuple[GradientAblation, ...] = ()  # a study's gradient ablations (`fp8rl.trainer.hooks`)
    probes: tuple[EvalProbe, ...] = ()  # a study's evaluation probes


@dataclass(frozen=True)
class StepSettings:
    """The sections of a run config the trainer reads; the rest (model, precision, task, parallel layout,
    tracking) the job has already turned into `Parts`."""

    algo: AlgoConfig
    clipping: ClippingConfig
    trainer: TrainerConfig
    eval: EvalConfig

    @classmethod
    def of(cls, cfg: RunConfig) -> StepSettings:
        return cls(cfg.algo, cfg.clipping, cfg.trainer, cfg.eval)


@dataclass
class StepResult:
    metrics: dict[str, float]
    good: bool  # every update of the step was finite (else the step was rolled back)
    histograms: list[dict[str, Any]] = field(default_factory=list)  # BF16-shadow vs FP8 ratios, shadow steps


class RLTrainer:
    """Runs RL steps on `parts` as `cfg` (the run's algo, clipping, trainer and eval sections) says."""

    def __init__(self, parts: Parts, cfg: StepSettings) -> None:
        self.parts, self.cfg = parts, cfg
        self.policy = parts.policy
        self.model = parts.policy.module
        self.task, self.engine, self.sampling = parts.task, parts.engine, parts.sampling
        self.clip_policy, self.plan, self.dims = parts.clip_policy, parts.plan, parts.dims
        self.objective = parts.objective
        self.sampler = StepSampler(self.task, self.engine, self.sampling, cfg.algo, cfg.trainer.seed, self.dims)
        self.evaluator = Evaluator(
            self.task, self.engine, self.policy, self.sampling, cfg.eval, self.dims, parts.probes
        )
        self.step = 0
        self.bad_steps_in_a_row = 0
        self.model.train()

    # ------------------------------------------------------------------------------------------- log-probs
    def logprobs(
        self, batch: RolloutBatch, recipe, grad: bool = False, policy: Policy | None = None, compute: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (log-prob, entropy) of the batch's responses, (rows, response_len), in `recipe` (None = BF16),
        on every rank; `compute` overrides the run's non-FP8 precision (the mechanism study's fp32 row)."""
        policy = policy or self.policy
        with running_in(policy.module, recipe, compute or self.plan.compute):
            return policy.logprobs(
                batch.input_ids,
                batch.attention_mask,
                batch.response_ids.shape[1],
                self.sampling.temperature,
                self.sampling.vocab_size,
                grad=grad,
                micro_batch_size=self.parts.micro_batch_size,
            )

    def _old_logprobs(self, rollout: RolloutBatch) -> torch.Tensor:
        """The old policy's log-probs of the rollout; an engine with a calibrated FP8 KV cache gets its next scales
        from this pass's keys and values (`fp8rl.models.kv_cache`)."""
        if not getattr(self.engine, "calibrates_kv_cache", False):
            return self.logprobs(rollout, self.plan.train_recipe)[0]
        with recording_kv_amax(self.model, self.engine.kv_cache_keys) as records:
            old_logp, _ = self.logprobs(rollout, self.plan.train_recipe)
        amax = self.dims.max_over_model_replicas(kv_amax(records, rollout.attention_mask))
        self.engine.set_kv_scales(self.dims.union_over_stages(kv_scales_from_amax(sorted(records), amax)))
        return old_logp

    def wants_shadow(self, step: int) -> bool:
        """BF16 shadow passes of fp8_full runs: on the steps the clip policy needs (calibration steps, and the
        steps that fill its calibration pool), and on diagnostic steps (every trainer.shadow_every)."""
        if self.plan.train_recipe is None:
            return False
        if self.clip_policy.wants_shadow(step):
            return True
        every = self.cfg.trainer.shadow_every
        return every > 0 and step % every == 0

    # ------------------------------------------------------------------------------------------- one step
    def train_step(self, step: int) -> StepResult:
        """One RL step. A non-finite update rolls the whole step back (weights and optimizer state)."""
        timings: dict[str, float] = {}
        started = time.perf_counter()
        data = self.sampler.collect(step)
        data.rollout = data.rollout.to(self.parts.device)
        data.adv, data.keep = data.adv.to(self.parts.device), data.keep.to(self.parts.device)
        timings["time/rollout"] = time.perf_counter() - started
        timings["time/engine_sleep"] = self.engine.sleep()  # a colocated vLLM frees its share; sync_weights wakes it

        t = time.perf_counter()
        old_logp = self._old_logprobs(data.rollout)
        timings["time/old_logp"] = time.perf_counter() - t
        shadow = ShadowComparison(self.logprobs, self.cfg.algo, self.dims) if self.wants_shadow(step) else None
        if shadow is not None:
            shadow.record_old(data.rollout)
        reference_logp = None
        if self.parts.reference is not None:
            reference_logp = self.logprobs(data.rollout, None, policy=self.parts.reference)[0]

        t = time.perf_counter()
        snapshot = self._snapshot()
        update_metrics, good = self.update(step, data, old_logp, shadow, reference_logp)
        if not good:
            self._restore(snapshot)
        histograms: list[dict[str, Any]] = []
        if shadow is not None:
            update_metrics.update(shadow.finish(step, self.clip_policy))
            if self.cfg.trainer.log_ratio_histograms and shadow.has_tokens:
                histograms.append(ratio_histogram(step, *shadow.pooled()))
        shadow_time = shadow.seconds if shadow is not None else 0.0
        timings["time/weight_push"] = self.engine.sync_weights(self.policy)
        timings["time/update"] = time.perf_counter() - t - shadow_time - timings["time/weight_push"]
        timings["time/shadow"] = shadow_time
        timings["time/step"] = time.perf_counter() - started
        metrics = {**data.metrics, **update_metrics, **timings, **self._offpolicy_metrics(old_logp, data.rollout)}
        metrics.update(algos.metrics_to_floats(self.clip_policy.metrics()))
        metrics["rollout/entropy"] = self._mean_over_tokens(data.rollout.rollout_entropy, data.rollout.response_mask)
        metrics["train/skipped"] = 0.0 if good else 1.0
        return StepResult(metrics, good, histograms)

    def _offpolicy_metrics(self, old_logp: torch.Tensor, rollout: RolloutBatch) -> dict[str, float]:
        """verl's ``rollout_corr/`` mismatch metrics of the step's whole batch (every data-parallel rank's rows)."""
        stats = algos.offpolicy_statistics(old_logp, rollout.rollout_logp, rollout.response_mask)
        combined = {k: self.dims.sum(v) if k == "token_sums" else self.dims.gather_1d(v) for k, v in stats.items()}
        return algos.metrics_to_floats(algos.offpolicy_metrics(combined))

    def _mean_over_tokens(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        totals = self.dims.sum(torch.stack([(values * mask).sum().double(), mask.sum().double()]).cpu())
        return float(totals[0] / totals[1].clamp(min=1))

    def minibatches(self, rows: int, epoch_seed: int) -> list[torch.Tensor]:
        """Row indices (this rank's rows) of each mini-batch: whole groups, stratified by a (seed, step)-fixed
        generator. The step's groups, in global order, form blocks of ``algo.num_minibatches``; each block
        sends one group, drawn at random, to each mini-batch. A group's mini-batch depends on its global index
        only, so the mini-batches are the same whatever the data-parallel layout (and balanced over ranks
        when each rank's groups fill whole blocks)."""
        group, count = self.cfg.algo.group_size, self.cfg.algo.num_minibatches
        local_groups = rows // group
        first = self.dims.dp_rank * local_groups
        rng = random.Random(step_seed(self.cfg.trainer.seed, epoch_seed, SHUFFLE_SALT))
        blocks = -(-local_groups * self.dims.dp // count)
        assignment = [m for _ in range(blocks) for m in rng.sample(range(count), count)]  # global group -> mini-batch
        mine = assignment[first : first + local_groups]
        out = []
        for m in range(count):
            rows_of_m = [g * group + i for g, owner in enumerate(mine) if owner == m for i in range(group)]
            if rows_of_m:
                out.append(torch.tensor(rows_of_m, dtype=torch.long))
        return out

    def update(
        self,
        step: int,
        data: StepBatch,
        old_logp: torch.Tensor,
        shadow: ShadowComparison | None,
        reference_logp: torch.Tensor | None,
    ) -> tuple[dict[str, float], bool]:
        """PPO mini-batch updates; returns (mean metrics, whether every update was finite)."""
        collected: list[dict[str, float]] = []
        loss_mask = data.loss_mask
        updates_done = 0
        for epoch in range(self.cfg.algo.ppo_epochs):
            for rows in self.minibatches(data.adv.shape[0], epoch_key(step, epoch)):
                rows = rows.to(self.parts.device)
                mb, mb_mask = data.rollout.select(rows), loss_mask[rows]
                if float(self.dims.sum(mb_mask.sum().double().cpu())) == 0:  # DAPO dropped every group: no step
                    continue
                ratio_ref = None
                if shadow is not None and updates_done >= 1:  # after an update: pi_theta != pi_old
                    ratio_ref = shadow.bf16_ratio(mb, rows)
                reference = None if reference_logp is None else reference_logp[rows]
                site = UpdateSite(step, updates_done, self.dims.dp_rank, mb, mb_mask, data.adv[rows], old_logp[rows])
                ablations = self._ablations(site)
                metrics, logp, good = self.minibatch_update(
                    mb, mb_mask, old_logp[rows], data.adv[rows], ratio_ref, reference, ablations
                )
                if ratio_ref is not None and good:
                    keys = sequence_keys(mb.response_ids, mb_mask)
                    shadow.add(ratio_ref, torch.exp(logp - old_logp[rows]), data.adv[rows], mb_mask, keys)
                collected.append(metrics)
                updates_done += 1
                if not good:
                    return _mean_metrics(collected), False
        if not collected:
            return {"train/empty_batch": 1.0}, True
        return _mean_metrics(collected), True

    def _ablations(self, site: UpdateSite) -> tuple[MiniBatchAblation, ...]:
        """The study ablations acting on this update (none by default)."""
        chosen = (ablation.for_update(site) for ablation in self.parts.ablations)
        return tuple(a for a in chosen if a is not None)

    def _junk_tokens(self, response_ids: torch.Tensor) -> torch.Tensor | None:
        """Where `response_ids` holds the task's junk tokens (bool), None for a task without them."""
        junk = junk_ids(self.task)
        if not junk:
            return None
        return torch.isin(response_ids, torch.tensor(sorted(junk), device=response_ids.device))

    def _token_groups(self, response_ids: torch.Tensor, old_logp: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The groups FP8's clipping error is counted by on shadow updates (``clip/count/...``): the task's token
        classes and the p_old buckets, bool (rows, response_len) each; None for a task without token classes."""
        classes = token_classes(self.task)
        if not classes:
            return None
        groups = {
            name: torch.isin(response_ids, torch.tensor(sorted(ids), device=response_ids.device))
            for name, ids in classes.items()
        }
        groups.update(algos.p_old_groups(old_logp))
        return groups

    def minibatch_update(self, mb, mask, old_logp, adv, ratio_ref, reference_logp, ablations=()):
        """One optimizer step on this rank's share of a mini-batch, with the loss normalised over the whole
        global mini-batch; `ablations`: a study's tokens whose gradient is zeroed. Returns (metrics, detached
        log-probs (rows, response_len), whether it was applied)."""
        correction = self.objective.correct(old_logp, mb.rollout_logp, mask)  # once per mini-batch
        denominator = float(self.dims.sum(torch.tensor(self.objective.count(correction), dtype=torch.float64)))
        tokens = algos.TokenBatch(old_logp, adv, mask, correction, reference_logp)
        micro = micro_batches(mb, tokens, self.parts.micro_batch_size, ablations)
        loss_fn = partial(self._loss, denominator=denominator)
        self.parts.optimizer.zero_grad()
        try:
            with running_in(self.model, self.plan.train_recipe, self.plan.compute):
                parts_metrics, logps = self.policy.forward_backward(
                    micro, loss_fn, self.sampling.temperature, self.sampling.vocab_size
                )
        except ValueError as err:  # FP8 quantization met NaN/Inf in a gradient
            log.warning("step %d: non-finite FP8 gradient (%s); the step is rolled back", self.step, err)
            self.parts.optimizer.zero_grad()
            return {"train/nonfinite": 1.0}, None, False
        logp = torch.cat(logps)[_inverse(micro)]
        finite = all(m.pop("loss_finite", 1.0) == 1.0 for m in parts_metrics)
        local = combine_shares(parts_metrics)
        local.update(algos.metrics_to_floats(correction.metrics))
        if ratio_ref is not None:
            junk, groups = self._junk_tokens(mb.response_ids), self._token_groups(mb.response_ids, old_logp)
            local.update(
                ShadowComparison.overclip(ratio_ref, logp, tokens, self.clip_policy.bounds, self.cfg.algo, junk, groups)
            )
        out = combine_shares(self.dims.all_gather_objects(local))
        if not finite:
            self.parts.optimizer.zero_grad()
            out["train/nonfinite"] = 1.0
            return out, logp, False
        grad_norm, applied = self.parts.optimizer.clip_and_step(self.cfg.algo.grad_clip)
        out["actor/grad_norm"] = float(grad_norm)
        if not applied:
            out["train/nonfinite"] = 1.0
        return out, logp, applied

    def _loss(self, mb: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor, denominator: float):
        """The objective of one micro-batch, normalised by `denominator` (the global mini-batch's). Returns
        (loss, float metrics)."""
        bounds = self.clip_policy.bounds
        tokens = mb.tokens
        if mb.ablations:  # a study's tokens whose gradient is zeroed
            log_ratio = logp.detach().float() - tokens.old_logp.float()
            zeroed = [ablation.zeroed(log_ratio, tokens, bounds[0]) for ablation in mb.ablations]
            if tokens.grad_zero_mask is not None:
                zeroed.append(tokens.grad_zero_mask)
            tokens = dataclasses.replace(tokens, grad_zero_mask=functools.reduce(torch.logical_or, zeroed))
        loss, metrics = self.objective(logp, entropy, tokens, bounds, denominator)
        # The loss is this rank's share of the global loss; Megatron DDP averages gradients over DP ranks.
        scale = self.dims.dp if self.parts.optimizer.averages_over_data_parallel else 1
        return loss * scale, algos.metrics_to_floats(metrics)

    # ------------------------------------------------------------------------------------------- rollback
    def _snapshot(self) -> dict[str, Any]:
        """Weights, optimizer and FP8 scaling state before a step's updates (restored if one is non-finite), kept
        in host memory: on a GPU a copy on the device would cost the weights and optimizer state again (~20 GB
        per GPU for qwen3_8b); the restore copies back to each tensor's device."""
        return {
            "model": {k: _to_host(v) for k, v in unwrapped(self.model).state_dict().items() if torch.is_tensor(v)},
            "optimizer": _clone_tree(self.parts.optimizer.state_dict(), _to_host),
            "fp8_delayed_scaling": self._delayed_scaling_states(),
        }

    def _restore(self, snapshot: dict[str, Any]) -> None:
        unwrapped(self.model).load_state_dict(snapshot["model"], strict=False)
        self.parts.optimizer.load_state_dict(snapshot["optimizer"])
        self._load_delayed_scaling_states(snapshot["fp8_delayed_scaling"])

    # ------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit for bit (tensors and plain containers only)."""
        return {
            "step": self.step,
            "model": unwrapped(self.model).state_dict(),
            "optimizer": self.parts.optimizer.state_dict(),
            "clip_policy": self.clip_policy.state_dict(),
            "bad_steps_in_a_row": self.bad_steps_in_a_row,
            "torch_rng": torch.get_rng_state(),
            "fp8_delayed_scaling": self._delayed_scaling_states(),
            "kv_cache_scales": dict(getattr(self.engine, "kv_scales", {})),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        missing, unexpected = unwrapped(self.model).load_state_dict(state["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.parts.optimizer.load_state_dict(state["optimizer"])
        self.clip_policy.load_state_dict(state["clip_policy"])
        self.bad_steps_in_a_row = int(state["bad_steps_in_a_row"])
        torch.set_rng_state(state["torch_rng"])
        self._load_delayed_scaling_states(state.get("fp8_delayed_scaling", []))
        if state.get("kv_cache_scales") and hasattr(self.engine, "set_kv_scales"):
            self.engine.set_kv_scales(state["kv_cache_scales"])
        self.engine.sync_weights(self.policy)

    def _delayed_scaling_states(self) -> list[dict | None]:
        """Amax histories of every FP8 linear (delayed scaling), in module order."""
        return [
            None if layer.fp8_scaling_state is None else _clone_tree(layer.fp8_scaling_state.state_dict())
            for layer in fp8_switchable_linears(self.model)
        ]

    def _load_delayed_scaling_states(self, states: list[dict | None]) -> None:
        for layer, state in zip(fp8_switchable_linears(self.model), states, strict=False):
            layer.fp8_scaling_state = None
            if state is not None:
                layer.fp8_scaling_state = DelayedScalingState()
                layer.fp8_scaling_state.load_state_dict(state)

    def evaluate(self) -> dict[str, float]:
        return self.evaluator.run()


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in host memory (on CPU: a clone)."""
    return tensor.detach().to("cpu", copy=True)


def _clone_tree(value: Any, copy=lambda t: t.detach().clone()) -> Any:
    """A deep copy of nested dicts/lists whose tensors are copied with `copy` (default: cloned in place)."""
    if torch.is_tensor(value):
        return copy(value)
    if isinstance(value, dict):
        return {k: _clone_tree(v, copy) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_clone_tree(v, copy) for v in value)
    return value


COUNT_PREFIX = "clip/count/"  # token counts (`algos.overclip_breakdown_counts`): summed over ranks
LOSS_KEYS = ("actor/pg_loss", "actor/loss", "actor/kl_loss")  # shares of one global loss: summed over ranks


def _inverse(micro: list[MicroBatch]) -> torch.Tensor:
    """The permutation that puts the micro-batches' concatenated rows back in the mini-batch's order."""
    order = torch.cat([m.rows for m in micro])
    return torch.argsort(order)


def combine_shares(items: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of a whole mini-batch from those of its shares (micro-batches, data-parallel ranks): loss
    shares and token counts (``train/tokens``, ``clip/count/...``) summed, per-token statistics weighted by
    tokens, ``p`` ratios recomputed from the combined sign contributions. Ratio quantiles become token-weighted
    means of the shares' quantiles (an approximation: exact with one share)."""
    if len(items) == 1:
        return dict(items[0])
    weights = [m.get("train/tokens", 1.0) for m in items]
    total = math.fsum(weights) or 1.0
    out = {}
    for key in dict.fromkeys(k for m in items for k in m):
        values = [(m[key], w) for m, w in zip(items, weights, strict=True) if key in m]
        if key in LOSS_KEYS or key == "train/tokens" or key.startswith(COUNT_PREFIX):
            out[key] = math.fsum(v for v, _ in values)
        else:
            out[key] = math.fsum(v * w for v, w in values) / total
    for key in [k for k in out if k.endswith("contrib_pos")]:
        prefix = key.removesuffix("contrib_pos")
        if prefix + "contrib_neg" in out and prefix + "p" in out:
            negative = out[prefix + "contrib_neg"]
            out[prefix + "p"] = out[key] / negative if negative else 0.0
    return out


def _mean_metrics(items: list[dict[str, float]]) -> dict[str, float]:
    """Mean over mini-batches of each metric's finite values (NaN when it has none: logged as NaN); token counts
    (``clip/count/...``) summed: the step's."""
    keys = dict.fromkeys(k for item in items for k in item)
    out = {}
    for key in keys:
        values = [item[key] for item in items if key in item and math.isfinite(item[key])]
        if key.startswith(COUNT_PREFIX):
            out[key] = math.fsum(values)
        else:
            out[key] = math.fsum(values) / len(values) if values else float("nan")
    return out
