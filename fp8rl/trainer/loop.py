"""The RL loop: rollout -> rewards -> advantages -> old log-probs -> (BF16 shadow, calibration) ->
PPO mini-batch updates -> metrics -> eval -> checkpoint.

`run(cfg)` is the whole job: it builds everything from one validated `RunConfig`, resumes from the
newest checkpoint in `trainer.out_dir` (continuing the same MLflow run), and returns a summary.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp8rl import algos
from fp8rl.config import RunConfig, validate
from fp8rl.malloc import keep_freed_memory
from fp8rl.models.config import get_model_config, with_tokenizer_vocab
from fp8rl.models.generate import SamplingConfig
from fp8rl.models.gpt import fp8_switchable_linears
from fp8rl.models.logprobs import token_logprobs_and_entropy
from fp8rl.models.outliers import inject_activation_outliers
from fp8rl.rollout import BuiltinEngine, RolloutBatch
from fp8rl.tasks.base import Problem, batch_rewards, build_task, garble_metrics, task_config
from fp8rl.tracking import NullTracker, Tracker
from fp8rl.trainer import checkpoint as ckpt
from fp8rl.trainer.optim import MegatronPolicyOptimizer, TorchPolicyOptimizer
from fp8rl.trainer.precision import PrecisionPlan, plan_precision, running_in
from fp8rl.trainer.warmstart import WarmStartConfig, load_warmstarted_model, warmstart

log = logging.getLogger(__name__)
STEP_SEED_STRIDE = 1_000_003


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row; the last good checkpoint is intact."""


@dataclass
class StepResult:
    metrics: dict[str, float]
    good: bool


@dataclass
class RunSummary:
    run_id: str | None
    steps_done: int
    final_eval: dict[str, float]
    history: list[dict[str, float]] = field(default_factory=list)
    out_dir: str = ""


def step_generator(seed: int, step: int, salt: int = 0) -> torch.Generator:
    """A generator that depends only on (seed, step): resumed runs draw exactly the same data."""
    return torch.Generator().manual_seed(seed * STEP_SEED_STRIDE + step * 7919 + salt)


def clip_policy_from_config(cfg: RunConfig) -> algos.ClipBoundPolicy:
    a, c = cfg.algo, cfg.clipping
    if c.policy == "standard":
        return algos.make_clip_bound_policy("standard", eps_low=a.eps_low, eps_high=a.eps_high)
    initial = None
    if c.init_low is not None or c.init_high is not None:
        low, high = algos.standard_bounds(a.eps_low, a.eps_high)
        initial = (c.init_low if c.init_low is not None else low, c.init_high if c.init_high is not None else high)
    return algos.make_clip_bound_policy(
        "calibrated",
        eps_low=a.eps_low,
        eps_high=a.eps_high,
        interval=c.interval,
        initial_bounds=initial,
        ema=c.ema,
        lower_bound_only=c.lower_only,
    )


class RLTrainer:
    """Owns the policy, optimizer, rollout engine and clip-bound policy of one run."""

    def __init__(self, cfg: RunConfig, tracker: Tracker | None = None) -> None:
        self.cfg = validate(cfg, cuda_available=torch.cuda.is_available())
        if cfg.trainer.threads:
            torch.set_num_threads(cfg.trainer.threads)
        if cfg.trainer.keep_freed_memory:
            keep_freed_memory()
        self.tracker: Tracker = tracker or NullTracker()
        self.task_cfg = task_config(
            cfg.task.name,
            operations=cfg.task.operations,
            num_digits=cfg.task.num_digits,
            num_train=cfg.task.num_train,
            num_eval=cfg.task.num_eval,
            seed=cfg.task.seed,
        )
        self.task = build_task(self.task_cfg)
        self.model_cfg = with_tokenizer_vocab(get_model_config(cfg.model.preset), self.task.tokenizer.vocab_size)
        ws = cfg.warmstart
        ws_cfg = WarmStartConfig(steps=ws.steps, lr=ws.lr, batch_size=ws.batch_size, seed=ws.seed)
        self.warmstart = warmstart(self.model_cfg, self.task_cfg, ws_cfg, ws.cache_dir)
        self.plan: PrecisionPlan = plan_precision(cfg.precision)
        self.model, self.optimizer = self._policy_and_optimizer(self.warmstart.weights_path)
        self.model.train()
        self.ref_model = self._reference_model()
        self.engine = self._rollout_engine()
        self.clip_policy = clip_policy_from_config(cfg)
        self.policy_loss = algos.get_policy_loss(cfg.algo.policy_loss)
        self.sampling = SamplingConfig(
            max_new_tokens=cfg.rollout.max_new_tokens or self.task.max_response_tokens,
            eos_token_id=self.task.tokenizer.eos_id,
            pad_token_id=self.task.tokenizer.pad_id,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            vocab_size=self._sampled_vocab_size(),
        )
        self.step = 0
        self.bad_steps_in_a_row = 0

    def _sampled_vocab_size(self) -> int | None:
        """The built-in engine samples among the tokenizer's ids, never the embedding's padding rows; the
        vLLM engine samples every row of the checkpoint it was given (None), and the trainer scores alike."""
        return None if self.cfg.rollout.engine == "vllm" else self.task.tokenizer.vocab_size

    def _policy_and_optimizer(self, weights_path):
        """The policy on its backend: local spec + torch AdamW, or the TE spec + Megatron DDP/optimizer."""
        cfg, ws = self.cfg, self.cfg.warmstart
        model = load_warmstarted_model(weights_path, self.model_cfg, seed=ws.seed)
        if cfg.model.outlier_channels:
            inject_activation_outliers(model, cfg.model.outlier_channels, cfg.model.outlier_scale, seed=ws.seed)
        if cfg.precision.backend != "te":
            return model, TorchPolicyOptimizer(model, cfg.algo.lr, cfg.algo.weight_decay)
        from fp8rl.config import parallel_layout
        from fp8rl.models import te_backend

        layout = parallel_layout(cfg)
        te_model = te_backend.build_te_gpt_model(self.model_cfg, layout, self.plan.train_recipe, seed=ws.seed)
        state = te_backend.local_to_te_state_dict(model.state_dict())
        te_model.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()}, strict=False)
        ddp_model, optimizer = te_backend.policy_optimizer(te_model, layout, cfg.algo.lr, cfg.algo.weight_decay)
        return ddp_model, MegatronPolicyOptimizer(ddp_model, optimizer)

    def _rollout_engine(self):
        cfg = self.cfg
        if cfg.rollout.engine != "vllm":
            pad_id, fp8_kv_cache = self.task.tokenizer.pad_id, cfg.precision.fp8_kv_cache
            return BuiltinEngine(self.model, self.plan.rollout_recipe, pad_id, fp8_kv_cache=fp8_kv_cache)
        from fp8rl.rollout.vllm_engine import VllmEngine

        return VllmEngine(
            self.model,
            self.model_cfg,
            self.task.tokenizer.pad_id,
            recipe=self.plan.rollout_recipe,
            fp8_kv_cache=cfg.precision.fp8_kv_cache,
            dtype="bfloat16",
            device=cfg.model.device,
            tokenizer=self.task.tokenizer,
            max_num_seqs=cfg.algo.prompts_per_step * cfg.algo.group_size,
            seed=cfg.trainer.seed,
        )

    def close(self) -> None:
        """Release the rollout engine (vLLM holds process groups and memory)."""
        getattr(self.engine, "close", lambda: None)()

    def _reference_model(self) -> torch.nn.Module | None:
        if self.cfg.algo.kl_coef <= 0:
            return None
        ref = copy.deepcopy(self.model)
        ref.requires_grad_(False)
        return ref

    # ----------------------------------------------------------------------------------------
    # Checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "clip_policy": self.clip_policy.state_dict(),
            "bad_steps_in_a_row": self.bad_steps_in_a_row,
            "torch_rng": torch.get_rng_state(),
            "fp8_delayed_scaling": self._delayed_scaling_states(),
            "run_id": self.tracker.run_id,
            "config": dataclasses.asdict(self.cfg),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.clip_policy.load_state_dict(state["clip_policy"])
        self.bad_steps_in_a_row = int(state["bad_steps_in_a_row"])
        torch.set_rng_state(state["torch_rng"])
        self._load_delayed_scaling_states(state.get("fp8_delayed_scaling", []))
        self.engine.sync_weights(self.model)

    def _delayed_scaling_states(self) -> list[dict | None]:
        """Amax histories of every FP8 linear (delayed scaling), in module order."""
        return [
            None if layer.fp8_scaling_state is None else layer.fp8_scaling_state.state_dict()
            for layer in fp8_switchable_linears(self.model)
        ]

    def _load_delayed_scaling_states(self, states: list[dict | None]) -> None:
        from fp8rl.quant import DelayedScalingState

        for layer, state in zip(fp8_switchable_linears(self.model), states, strict=False):
            if state is not None:
                layer.fp8_scaling_state = DelayedScalingState()
                layer.fp8_scaling_state.load_state_dict(state)

    def save(self) -> Path:
        return ckpt.save_checkpoint(
            self.cfg.trainer.out_dir, self.step, self.state_dict(), self.cfg.trainer.keep_checkpoints
        )

    # ----------------------------------------------------------------------------------------
    # One RL step

    def sample_problems(self, step: int, round_: int = 0) -> list[Problem]:
        """The step's prompts: a (seed, step, round)-determined draw from the train set."""
        gen = step_generator(self.cfg.trainer.seed, step, salt=1 if round_ == 0 else 100 + round_)
        picks = torch.randint(len(self.task.train_problems), (self.cfg.algo.prompts_per_step,), generator=gen)
        return [self.task.train_problems[int(i)] for i in picks]

    def rollout(self, step: int, round_: int = 0) -> tuple[list[Problem], RolloutBatch]:
        problems = self.sample_problems(step, round_)
        group = self.cfg.algo.group_size
        repeated = [p for p in problems for _ in range(group)]
        prompts = [self.task.prompt_ids(p) for p in repeated]
        salt = 2 if round_ == 0 else 200 + round_
        batch = self.engine.generate(prompts, self.sampling, step_generator(self.cfg.trainer.seed, step, salt=salt))
        return repeated, batch

    def rollout_and_advantages(self, step: int) -> tuple[RolloutBatch, torch.Tensor, torch.Tensor, dict[str, float]]:
        """Rollout, rewards, advantages and the kept-sequence mask of one step.

        With DAPO's dynamic sampling and ``algo.resample_rounds`` = R > 0, up to R more rounds of fresh
        prompts are sampled until ``prompts_per_step`` groups with reward variation are collected; the
        batch is those groups (first come first), topped up with dropped groups of the first round
        (masked out, as without refilling) when R rounds were not enough. Its size never changes.
        The ``rollout/*`` reward metrics describe the first round, as without refilling.
        """
        problems, batch = self.rollout(step)
        _, adv, keep, metrics = self.rewards_and_advantages(problems, batch)
        rounds = self.cfg.algo.resample_rounds or 0
        if not self.cfg.algo.dynamic_sampling or rounds == 0:
            return batch, adv, keep, metrics
        parts = [(batch, adv, keep)]
        wanted, group = self.cfg.algo.prompts_per_step, self.cfg.algo.group_size
        for round_ in range(1, rounds + 1):
            if sum(len(_kept_groups(k, group)) for _, _, k in parts) >= wanted:
                break
            more_problems, more = self.rollout(step, round_)
            _, more_adv, more_keep, _ = self.rewards_and_advantages(more_problems, more)
            parts.append((more, more_adv, more_keep))
        batch, adv, keep, kept_groups = _refilled_batch(parts, wanted, group, self.task.tokenizer.pad_id)
        metrics["rollout/sampling_rounds"] = float(len(parts))
        metrics["rollout/kept_groups"] = float(kept_groups)
        return batch, adv, keep, metrics

    def rewards_and_advantages(
        self, problems: list[Problem], batch: RolloutBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
        """Per-sequence rewards (with DAPO shaping), advantages, and the kept-sequence mask."""
        a = self.cfg.algo
        responses = batch.responses()
        task_reward = batch_rewards(self.task, problems, responses)
        reward = task_reward.clone()
        lengths = batch.response_mask.sum(dim=1)
        if a.overlong_buffer > 0:
            reward = reward + algos.overlong_penalty(
                lengths, self.sampling.max_new_tokens, a.overlong_buffer, a.overlong_factor
            )
        adv = algos.compute_advantages(a.advantage, reward, group_size=a.group_size, **self._adv_kwargs())
        keep = torch.ones_like(reward, dtype=torch.bool)
        metrics = {
            "rollout/reward": float(task_reward.mean()),
            "rollout/shaped_reward": float(reward.mean()),
            "rollout/response_len": float(lengths.float().mean()),
        }
        metrics.update(garble_metrics([self.task.garble_reason(r) for r in responses]))
        if a.dynamic_sampling:
            kept = algos.filter_uniform_groups(reward, a.group_size)
            keep = kept.keep
            metrics["rollout/dropped_groups"] = float(kept.num_dropped_groups)
        return reward, adv, keep, metrics

    def _adv_kwargs(self) -> dict[str, Any]:
        return {"norm_by_std": self.cfg.algo.norm_adv_by_std} if self.cfg.algo.advantage == "grpo" else {}

    def logprobs(self, batch: RolloutBatch, recipe, grad: bool, model: torch.nn.Module | None = None) -> tuple:
        model = model or self.model
        context = torch.enable_grad() if grad else torch.no_grad()
        with context, running_in(model, recipe):
            response_len, sampling = batch.response_ids.shape[1], self.sampling
            return token_logprobs_and_entropy(
                model, batch.input_ids, batch.attention_mask, response_len, sampling.temperature, sampling.vocab_size
            )

    def wants_shadow(self, step: int) -> bool:
        """BF16 shadow passes: on calibration steps, and on diagnostic steps of fp8_full runs."""
        if self.plan.train_recipe is None:
            return False
        if self.clip_policy.needs_calibration(step) and self.cfg.clipping.policy == "calibrated":
            return True
        every = self.cfg.trainer.shadow_every
        return every > 0 and step % every == 0

    def train_step(self, step: int) -> StepResult:
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        batch, adv, keep, metrics = self.rollout_and_advantages(step)
        timings["time/rollout"] = time.perf_counter() - t0
        response_mask = batch.response_mask * keep[:, None].long()

        t = time.perf_counter()
        old_logp, _ = self.logprobs(batch, self.plan.train_recipe, grad=False)
        timings["time/old_logp"] = time.perf_counter() - t
        shadow = self.wants_shadow(step)
        ref_old_logp = None
        timings["time/shadow"] = 0.0
        if shadow:
            t = time.perf_counter()
            ref_old_logp, _ = self.logprobs(batch, None, grad=False)
            timings["time/shadow"] += time.perf_counter() - t
        ref_logp_policy = self.logprobs(batch, None, grad=False, model=self.ref_model)[0] if self.ref_model else None

        t = time.perf_counter()
        update_metrics, good, shadow_time = self.update(
            step, batch, old_logp, adv, response_mask, ref_old_logp, ref_logp_policy
        )
        timings["time/shadow"] += shadow_time
        timings["time/weight_push"] = self.engine.sync_weights(self.model)
        timings["time/update"] = time.perf_counter() - t - shadow_time
        timings["time/step"] = time.perf_counter() - t0
        metrics.update(update_metrics)
        metrics.update(timings)
        metrics.update(algos.metrics_to_floats(self.clip_policy.metrics()))
        metrics["rollout/entropy"] = float(
            (batch.rollout_entropy * batch.response_mask).sum() / batch.response_mask.sum().clamp(min=1)
        )
        return StepResult(metrics, good)

    def minibatches(self, batch_size: int, epoch_seed: int) -> list[torch.Tensor]:
        """Row indices of each mini-batch: whole groups, shuffled by a (seed, step)-fixed generator."""
        group = self.cfg.algo.group_size
        n_groups = batch_size // group
        order = torch.randperm(n_groups, generator=step_generator(self.cfg.trainer.seed, epoch_seed, salt=3))
        rows = (order[:, None] * group + torch.arange(group)).reshape(-1)
        return list(rows.chunk(self.cfg.algo.num_minibatches))

    def update(self, step, batch, old_logp, adv, response_mask, ref_old_logp, ref_policy_logp):
        """PPO mini-batch updates; returns (mean metrics, whether every update was finite, shadow seconds)."""
        a = self.cfg.algo
        collected: list[dict[str, float]] = []
        shadow_time = 0.0
        update_index = 0
        shadow_pending = ref_old_logp is not None
        for epoch in range(a.ppo_epochs):
            for rows in self.minibatches(adv.shape[0], step * 131 + epoch):
                mb = batch.select(rows)
                mb_mask = response_mask[rows]
                if not bool(mb_mask.any()):  # DAPO dropped every group here: no loss, no step, no metrics
                    continue
                logp, entropy = self.logprobs(mb, self.plan.train_recipe, grad=True)
                ratio_ref, extra = None, {}
                # One shadow comparison per step, on the first mini-batch after an update (pi_theta != pi_old).
                if shadow_pending and update_index >= 1:
                    t = time.perf_counter()
                    ref_logp, _ = self.logprobs(mb, None, grad=False)
                    shadow_time += time.perf_counter() - t
                    ratio_ref = torch.exp(ref_logp - ref_old_logp[rows])
                    ratio_fp8 = torch.exp(logp.detach() - old_logp[rows])
                    if self.cfg.clipping.policy == "calibrated" and self.clip_policy.needs_calibration(step):
                        self.clip_policy.update(ratio_ref, ratio_fp8, adv[rows], mb_mask, step)
                    extra = self.ratio_histograms(step, ratio_ref, ratio_fp8, adv[rows], mb_mask)
                    shadow_pending = False
                metrics, good = self.minibatch_update(
                    mb,
                    mb_mask,
                    logp,
                    entropy,
                    old_logp[rows],
                    adv[rows],
                    ratio_ref,
                    None if ref_policy_logp is None else ref_policy_logp[rows],
                )
                metrics.update(extra)
                collected.append(metrics)
                update_index += 1
                if not good:
                    return _mean_metrics(collected), False, shadow_time
        if not collected:
            return {"train/empty_batch": 1.0}, True, shadow_time
        return _mean_metrics(collected), True, shadow_time

    def minibatch_update(self, mb, mask, logp, entropy, old_logp, adv, ratio_ref, ref_policy_logp):
        a, c = self.cfg.algo, self.cfg.clipping
        low, high = self.clip_policy.bounds
        ref_low, ref_high = algos.standard_bounds(a.eps_low, a.eps_high)
        loss, metrics = self.policy_loss(
            logp,
            old_logp,
            adv,
            mask,
            clip_low=low,
            clip_high=high,
            agg=a.loss_agg,
            rollout_logp=mb.rollout_logp,
            rollout_correction=c.rollout_correction,
            tis_cap=c.tis_cap,
            mis_low=c.mis_low,
            mis_high=c.mis_high,
            ratio_ref=ratio_ref,
            ref_clip_low=ref_low,
            ref_clip_high=ref_high,
            **({"dual_clip_c": a.dual_clip_c} if a.policy_loss == "dual_clip" else {}),
        )
        if ref_policy_logp is not None:
            kl, kl_metrics = algos.kl_loss(logp, ref_policy_logp, mask, kind=a.kl_type, agg=a.loss_agg)
            loss = loss + a.kl_coef * kl
            metrics.update(kl_metrics)
        if a.entropy_coef:
            loss = loss - a.entropy_coef * algos.aggregate_loss(entropy, mask, a.loss_agg)
        out = algos.metrics_to_floats(metrics)
        out["actor/loss"] = float(loss.detach())
        out["actor/entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
        self.optimizer.zero_grad()
        if not torch.isfinite(loss):
            out["train/nonfinite"] = 1.0
            return out, False
        try:
            loss.backward()
        except ValueError as err:  # FP8 quantization met NaN/Inf in a gradient
            log.warning("step %d: non-finite FP8 gradient: %s", self.step, err)
            out["train/nonfinite"] = 1.0
            self.optimizer.zero_grad()
            return out, False
        grad_norm, applied = self.optimizer.clip_and_step(a.grad_clip)
        out["actor/grad_norm"] = float(grad_norm)
        if not applied:
            out["train/nonfinite"] = 1.0
        return out, applied

    def ratio_histograms(self, step, ratio_ref, ratio_fp8, adv, mask) -> dict[str, float]:
        """Write BF16-shadow vs FP8 ratio histograms (split by advantage sign) as a JSON artifact."""
        if not self.cfg.trainer.log_ratio_histograms:
            return {}
        m = mask.bool()
        adv_tok = algos.broadcast_to_tokens(adv, mask) if adv.dim() == 1 else adv
        edges = torch.linspace(0.5, 1.5, 101)
        hist = {"step": step, "edges": edges.tolist()}
        for sign, sel in (("neg", adv_tok < 0), ("pos", adv_tok > 0)):
            for name, ratio in (("bf16", ratio_ref), ("fp8", ratio_fp8)):
                values = ratio[m & sel].float().clamp(0.5, 1.5)
                hist[f"{name}_{sign}"] = torch.histc(values, bins=100, min=0.5, max=1.5).tolist()
        path = Path(self.cfg.trainer.out_dir) / "histograms" / f"ratio_step_{step:06d}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(hist))
        self.tracker.log_artifact(path, "ratio_histograms")
        return {}

    # ----------------------------------------------------------------------------------------
    # Eval

    def evaluate(self) -> dict[str, float]:
        """Greedy decoding on the held-out set in the rollout precision."""
        problems = self.task.eval_problems[: self.cfg.trainer.eval_size]
        greedy = dataclasses.replace(self.sampling, temperature=0.0)
        batch = self.engine.generate([self.task.prompt_ids(p) for p in problems], greedy, None)
        responses = batch.responses()
        rewards = batch_rewards(self.task, problems, responses)
        garbled = garble_metrics([self.task.garble_reason(r) for r in responses])
        mask = batch.response_mask
        return {
            "eval/accuracy": float(rewards.mean()),
            "eval/garbled_rate": garbled["rollout/garbled_rate"],
            "eval/response_len": float(mask.sum(1).float().mean()),
            "eval/entropy": float((batch.rollout_entropy * mask).sum() / mask.sum().clamp(min=1)),
        }


def _refilled_batch(
    parts: list[tuple[RolloutBatch, torch.Tensor, torch.Tensor]], wanted: int, group: int, pad_id: int
) -> tuple[RolloutBatch, torch.Tensor, torch.Tensor, int]:
    """`wanted` groups from the rounds in `parts`: kept groups first (in sampling order), then dropped
    groups of the first round. Returns (batch, advantages, keep mask, number of kept groups used)."""
    kept = [(i, g) for i, (_, _, keep) in enumerate(parts) for g in _kept_groups(keep, group)]
    first_round_dropped = [(0, g) for g in range(len(parts[0][2]) // group) if (0, g) not in kept]
    chosen = (kept + first_round_dropped)[:wanted]
    rows = [torch.arange(g * group, (g + 1) * group) for _, g in chosen]
    batch = RolloutBatch.concat([parts[i][0].select(r) for (i, _), r in zip(chosen, rows, strict=True)], pad_id)
    adv = torch.cat([parts[i][1][r] for (i, _), r in zip(chosen, rows, strict=True)])
    keep = torch.cat([parts[i][2][r] for (i, _), r in zip(chosen, rows, strict=True)])
    return batch, adv, keep, min(len(kept), wanted)


def _kept_groups(keep: torch.Tensor, group: int) -> list[int]:
    return [g for g, kept in enumerate(keep.view(-1, group)[:, 0].tolist()) if kept]


def _mean_metrics(items: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for item in items for k in item}
    out = {}
    for key in keys:
        values = [item[key] for item in items if key in item and math.isfinite(item[key])]
        if values:
            out[key] = sum(values) / len(values)
    return out
