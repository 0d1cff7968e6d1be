"""The RL loop end to end on CPU: every precision mode and recipe, resume equality, divergence handling."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl.config import ConfigError, RunConfig, with_overrides
from fp8rl.job import build_trainer, run_job
from fp8rl.tracking import NullTracker
from fp8rl.trainer import checkpoint as ckpt
from fp8rl.trainer.fit import TrainingDiverged


def run(cfg: RunConfig, tracker: NullTracker, stop_after: int | None = None):
    return run_job(cfg, tracker=tracker, stop_after=stop_after)


REQUIRED_METRICS = (
    "rollout/reward",
    "rollout/entropy",
    "rollout/garbled_rate",
    "clip/low_neg",
    "clip/high_pos",
    "clip/bound_low",
    "rollout/token_mult_prob_error",
    "time/rollout",
    "time/update",
)


@pytest.mark.parametrize(
    ("mode", "recipe"),
    [
        ("bf16", "tensorwise"),
        ("fp8_rollout", "tensorwise"),
        ("fp8_full", "tensorwise"),
        ("fp8_full", "rowwise"),
        ("fp8_full", "blockwise"),
        ("fp8_full", "mxfp8"),
    ],
)
def test_a_step_runs_in_every_precision_mode_and_recipe(small_cfg: RunConfig, mode: str, recipe: str) -> None:
    small_cfg = with_overrides(small_cfg, {"precision.mode": mode, "precision.recipe": recipe, "trainer.steps": 1})
    if mode == "bf16":
        small_cfg = with_overrides(small_cfg, {"precision.recipe": "tensorwise"})
    tracker = NullTracker()
    summary = run(small_cfg, tracker=tracker)
    assert summary.steps_done == 1
    step_metrics = [m for step, m in tracker.history if step == 1][0]
    for key in REQUIRED_METRICS:
        assert key in step_metrics and math.isfinite(step_metrics[key]), key
    mismatch = step_metrics["rollout/token_mult_prob_error"]
    if mode == "fp8_rollout":
        assert mismatch > 1.0  # FP8 sampler vs BF16 trainer
    else:
        # Same precision in both: per-token scales (rowwise, blockwise, mxfp8) give identical log-probs;
        # a tensorwise scale depends on the batch (amax over all tokens), BF16 on the GEMM shape.
        assert 1.0 <= mismatch < 1.05


def test_a_builtin_fp8_kv_cache_is_the_only_rollout_train_mismatch_of_a_rowwise_run(small_cfg: RunConfig) -> None:
    """Rowwise FP8 in rollout and trainer alike gives identical log-probs (above); the rollout's FP8 KV
    cache (the trainer has none) is then the only source of a mismatch."""
    changes = {"precision.mode": "fp8_full", "precision.recipe": "rowwise", "precision.fp8_kv_cache": True}
    small_cfg = with_overrides(small_cfg, {**changes, "trainer.steps": 1})
    tracker = NullTracker()
    assert run(small_cfg, tracker=tracker).steps_done == 1
    step_metrics = [m for step, m in tracker.history if step == 1][0]
    assert 1.0 < step_metrics["rollout/token_mult_prob_error"] < 1.05


def test_fp8_logprobs_differ_from_bf16_within_the_recipes_range(small_cfg: RunConfig) -> None:
    trainer = build_trainer(small_cfg)
    _, batch = trainer.sampler.rollout(0)
    mask = batch.response_mask.bool()
    bf16, _ = trainer.logprobs(batch, None, grad=False)
    from fp8rl.quant import get_recipe

    for name in ("tensorwise", "rowwise", "blockwise", "mxfp8"):
        fp8, _ = trainer.logprobs(batch, get_recipe(name), grad=False)
        diff = (fp8 - bf16)[mask].abs().mean().item()
        # Pilot on this task: 0.016-0.019 for a 3.2M model; E4M3's 2^-4 step bounds it well below 0.2.
        assert 1e-4 < diff < 0.2, (name, diff)


def test_calibrated_clipping_runs_shadow_passes_and_moves_bounds(small_cfg: RunConfig) -> None:
    small_cfg = with_overrides(
        small_cfg,
        {
            "precision.mode": "fp8_full",
            "clipping.policy": "calibrated",
            "clipping.interval": 1,
            "clipping.ema": 0.0,
            "algo.lr": 1e-4,
            "algo.num_minibatches": 4,
            "algo.prompts_per_step": 8,
        },
    )
    tracker = NullTracker()
    run(small_cfg, tracker=tracker)
    steps = {step: m for step, m in tracker.history if step >= 1}
    # first calibration at step K = 1 (the second step), once per step, on the pooled shadow tokens
    assert steps[1]["clip/calib_count"] == 0 and steps[2]["clip/calib_count"] == 1
    assert steps[2]["time/shadow"] > 0
    # pooled over the three mini-batches after the first update, and measured out of sample
    assert steps[2]["clip/shadow_tokens"] > 0 and "clip/cc_oos_overclip_neg" in steps[2]
    assert "clip/overclip_neg" in steps[2] and "clip/shadow_overclip_neg" in steps[2]
    statuses = {k: v for k, v in steps[2].items() if k in ("clip/calib_ok", "clip/calib_no_neg", "clip/calib_empty")}
    assert sum(statuses.values()) >= 1, statuses  # the rule that fired, by name
    assert 0 < steps[2]["clip/bound_low"] < 1 < steps[2]["clip/bound_high"]


def _history_by_step(tracker: NullTracker) -> dict[int, dict[str, float]]:
    drop = ("time/",)
    return {step: {k: v for k, v in m.items() if not k.startswith(drop)} for step, m in tracker.history}


def test_kill_and_resume_gives_exactly_the_uninterrupted_metrics(small_cfg: RunConfig, tmp_path) -> None:
    small_cfg = with_overrides(
        small_cfg, {"precision.mode": "fp8_full", "trainer.steps": 3, "trainer.out_dir": str(tmp_path / "straight")}
    )
    straight = NullTracker()
    run(small_cfg, tracker=straight)

    small_cfg = with_overrides(small_cfg, {"trainer.out_dir": str(tmp_path / "interrupted")})
    first = NullTracker()
    run(small_cfg, tracker=first, stop_after=1)  # "killed" after one step (checkpoint at step 1)
    assert ckpt.latest_checkpoint(small_cfg.trainer.out_dir).name == "step_000001.pt"
    second = NullTracker()
    run(small_cfg, tracker=second)
    resumed = _history_by_step(first) | _history_by_step(second)
    assert resumed == _history_by_step(straight)


def test_resume_refuses_a_checkpoint_of_another_config(small_cfg: RunConfig) -> None:
    small_cfg = with_overrides(small_cfg, {"trainer.steps": 1})
    run(small_cfg, tracker=NullTracker())
    with pytest.raises(ConfigError, match="different config"):
        run(with_overrides(small_cfg, {"algo.lr": 3e-5}), tracker=NullTracker())


def test_non_finite_steps_are_rolled_back_then_stop_the_run_with_the_checkpoint_intact(
    small_cfg: RunConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    small_cfg = with_overrides(small_cfg, {"trainer.steps": 6, "trainer.max_bad_steps": 2})
    run(small_cfg, tracker=NullTracker(), stop_after=1)
    good = ckpt.load_checkpoint(ckpt.latest_checkpoint(small_cfg.trainer.out_dir))

    def nan_loss(self, *args, **kwargs):
        loss, metrics = original(self, *args, **kwargs)
        return loss * float("nan"), metrics

    from fp8rl.algos.policy_loss import PolicyLoss

    original = PolicyLoss.__call__
    monkeypatch.setattr(PolicyLoss, "__call__", nan_loss)
    tracker = NullTracker()
    with pytest.raises(TrainingDiverged, match="max_bad_steps=2"):
        run(small_cfg, tracker=tracker)
    assert [m["train/skipped"] for _, m in tracker.history if "train/skipped" in m] == [1.0, 1.0]  # stops at 2
    latest = ckpt.load_checkpoint(ckpt.latest_checkpoint(small_cfg.trainer.out_dir))
    assert latest["step"] == good["step"] == 1
    for key, value in good["model"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(latest["model"][key], value)


def test_a_step_with_a_non_finite_second_update_leaves_no_trace_of_its_first(small_cfg: RunConfig, monkeypatch) -> None:
    """Rolled back as a whole: weights, optimizer state, everything as before the step."""
    from fp8rl.algos.policy_loss import PolicyLoss

    trainer = build_trainer(small_cfg)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    calls = []
    original = PolicyLoss.__call__

    def second_is_nan(self, *args, **kwargs):
        loss, metrics = original(self, *args, **kwargs)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 2 else loss), metrics

    monkeypatch.setattr(PolicyLoss, "__call__", second_is_nan)
    result = trainer.train_step(0)
    assert len(calls) == 2 and not result.good and result.metrics["train/skipped"] == 1.0
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.parts.optimizer.state_dict()["state"] == {}  # AdamW's moments were never kept


@pytest.mark.parametrize("kl_type", ["k1", "k2", "low_var_kl"])
def test_a_kl_penalty_to_the_start_policy_runs(small_cfg: RunConfig, kl_type: str) -> None:
    small_cfg = with_overrides(small_cfg, {"algo.kl_coef": 0.1, "algo.kl_type": kl_type, "trainer.steps": 1})
    trainer = build_trainer(small_cfg)
    reference = trainer.parts.reference.module
    assert reference is not None and reference is not trainer.model
    assert all(not p.requires_grad for p in reference.parameters())
    start = {k: v.clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    assert all(torch.equal(start[k], v) for k, v in reference.state_dict().items() if torch.is_tensor(v))
    metrics = trainer.train_step(0).metrics
    assert math.isfinite(metrics["actor/kl_loss"])
    assert all(torch.equal(start[k], v) for k, v in reference.state_dict().items() if torch.is_tensor(v))


def test_a_dapo_step_whose_groups_are_all_dropped_takes_no_optimizer_step(small_cfg: RunConfig, monkeypatch) -> None:
    import fp8rl.trainer.batch as batch

    small_cfg = with_overrides(small_cfg, {"algo.dynamic_sampling": True})
    trainer = build_trainer(small_cfg)
    monkeypatch.setattr(batch, "batch_rewards", lambda task, problems, responses: torch.ones(len(problems)))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    metrics = trainer.train_step(1).metrics
    assert metrics["train/empty_batch"] == 1.0 and metrics["rollout/dropped_groups"] == small_cfg.algo.prompts_per_step
    assert "rollout/token_mult_prob_error" not in metrics and "clip/low_neg" not in metrics  # no zeros for no tokens
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # AdamW momentum/decay did not move the weights


def _rewards_uniform_on_first_call(monkeypatch) -> None:
    """Every group uniform in the first rollout round, every group varied in later ones."""
    import fp8rl.trainer.batch as loop

    calls = []

    def rewards(task, problems, responses):
        calls.append(len(problems))
        if len(calls) == 1:
            return torch.ones(len(problems))
        return torch.tensor([float(i % 2) for i in range(len(problems))])

    monkeypatch.setattr(loop, "batch_rewards", rewards)


def test_dapo_resampling_refills_the_batch_with_groups_that_have_reward_variation(
    small_cfg: RunConfig, monkeypatch
) -> None:
    small_cfg = with_overrides(small_cfg, {"algo.dynamic_sampling": True, "algo.resample_rounds": 2})
    trainer = build_trainer(small_cfg)
    _rewards_uniform_on_first_call(monkeypatch)
    metrics = trainer.train_step(1).metrics
    assert metrics["rollout/dropped_groups"] == small_cfg.algo.prompts_per_step  # the first round's
    assert metrics["rollout/sampling_rounds"] == 2.0 and metrics["rollout/kept_groups"] == 4.0
    assert "train/empty_batch" not in metrics and math.isfinite(metrics["clip/low_neg"])


def test_dapo_resampling_is_deterministic_and_keeps_the_batch_size(small_cfg: RunConfig) -> None:
    small_cfg = with_overrides(small_cfg, {"algo.dynamic_sampling": True, "algo.resample_rounds": 3})
    trainer = build_trainer(small_cfg)
    first = trainer.sampler.collect(5)
    second = trainer.sampler.collect(5)
    rows = small_cfg.algo.prompts_per_step * small_cfg.algo.group_size
    assert first.rollout.response_ids.shape[0] == rows and first.adv.shape == (rows,)
    for name in first.rollout.FIELDS:
        assert torch.equal(getattr(first.rollout, name), getattr(second.rollout, name)), name
    assert torch.equal(first.adv, second.adv) and torch.equal(first.keep, second.keep)
    assert first.metrics["rollout/kept_groups"] <= small_cfg.algo.prompts_per_step


def test_the_engine_sleeps_from_the_end_of_the_rollout_to_the_weight_push(small_cfg: RunConfig, monkeypatch) -> None:
    """A colocated vLLM must free its share while the trainer computes; nothing used to call sleep()."""
    from fp8rl.rollout.builtin import BuiltinEngine

    calls: list[str] = []
    for name in ("generate", "sleep", "sync_weights"):
        original = getattr(BuiltinEngine, name)

        def recorded(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(BuiltinEngine, name, recorded)
    trainer = build_trainer(with_overrides(small_cfg, {"trainer.steps": 1}))
    calls.clear()
    result = trainer.train_step(0)
    assert calls[-2:] == ["sleep", "sync_weights"] and set(calls[:-2]) == {"generate"}, calls
    assert "time/engine_sleep" in result.metrics


@pytest.mark.parametrize(("recipe", "tolerance"), [("rowwise", 0.0), ("tensorwise", 1e-4)])
def test_the_torchao_backend_takes_the_emulated_backends_first_step(small_cfg: RunConfig, recipe: str, tolerance):
    """precision.backend=torchao computes every FP8 GEMM (rollout, old log-probs, both updates' forward and backward)
    with torchao 0.18's float8 training (emulate=True on CPU). In FP32 compute a whole rowwise step equals the
    emulator's metric for metric; tensorwise agrees to round-off (torchao multiplies by 448 / amax, the emulator
    divides by amax / 448)."""
    pytest.importorskip("torchao", reason="needs torchao (the bench extra)")
    arm = {"precision.mode": "fp8_full", "precision.recipe": recipe, "precision.compute": "fp32", "trainer.steps": 1}
    steps = {}
    for backend in ("emulated", "torchao"):
        trainer = build_trainer(with_overrides(small_cfg, {**arm, "precision.backend": backend}))
        steps[backend] = {k: v for k, v in trainer.train_step(0).metrics.items() if not k.startswith("time/")}
    emulated, torchao_step = steps["emulated"], steps["torchao"]
    assert emulated.keys() == torchao_step.keys()
    for key, value in emulated.items():
        # tensorwise: relative, and absolute for differences of nearly equal numbers (actor/ppo_kl ~ 3e-4)
        expected = pytest.approx(value, rel=tolerance, abs=tolerance / 100, nan_ok=True)
        assert torchao_step[key] == expected, key


def test_a_calibrated_fp8_kv_cache_takes_each_steps_scales_and_keeps_them_across_a_resume(small_cfg: RunConfig):
    """Unit scales were the only FP8 KV cache (NeMo-RL filed that as a bug): the scales now follow the keys and
    values of each step's old-log-prob pass, per layer, and a checkpoint carries them."""
    arm = {"precision.mode": "fp8_full", "precision.fp8_kv_cache": True, "precision.kv_cache_scales": "calibrated"}
    trainer = build_trainer(with_overrides(small_cfg, arm))
    assert trainer.engine.calibrates_kv_cache and trainer.engine.kv_scales == {}  # the first rollout: unit scales
    trainer.train_step(0)
    scales = trainer.engine.kv_scales
    assert sorted(scales) == list(range(1, trainer.model.config.num_layers + 1))
    assert all(0 < k < 1 and 0 < v < 1 for k, v in scales.values())  # the tiny model's keys and values: amax < 448
    state = trainer.state_dict()
    fresh = build_trainer(with_overrides(small_cfg, arm))
    fresh.load_state_dict(state)
    assert fresh.engine.kv_scales == scales
    unit = build_trainer(with_overrides(small_cfg, {**arm, "precision.kv_cache_scales": "unit"}))
    assert not unit.engine.calibrates_kv_cache


JUNK_ORGANISM = {  # results/studies/2026-12-06-junk-organism.md, at the suite's small size
    "task.name": "chain",
    "task.num_digits": 1,
    "task.num_train": 1000,
    "task.junk_grading": "strip",
    "warmstart.junk_rate": 0.3,  # far above the study's 0.02: junk in every small batch
}


@pytest.mark.parametrize("drop_class", ["junk", "matched_other"])
def test_the_junk_organisms_control_drops_negative_gradients_of_its_class(small_cfg: RunConfig, drop_class: str):
    """clipping.synthetic_drop_neg=1 zeroes the gradient of every negative-advantage junk token (matched_other:
    of as many other tokens); the junk probe reads the policy's junk mass on clean answers."""
    control = {"clipping.synthetic_drop_neg": 1.0, "clipping.synthetic_drop_class": drop_class}
    trainer = build_trainer(with_overrides(small_cfg, {**JUNK_ORGANISM, **control}))
    data = trainer.sampler.collect(0)
    junk = torch.isin(data.rollout.response_ids, torch.tensor(sorted(trainer.task.junk_ids)))
    rows = data.adv.shape[0]
    data.adv = torch.randn(rows, generator=torch.Generator().manual_seed(7))  # negative advantages to act on
    negative_junk = junk & data.loss_mask.bool() & (data.adv[:, None] < 0)
    assert negative_junk.any()  # precondition: the junk-rich start samples junk
    trainer.sampler.collect = lambda step: data
    metrics = trainer.train_step(0).metrics
    negatives = (data.loss_mask.bool() & (data.adv[:, None] < 0)).sum()
    expected = float(negative_junk.sum() / negatives)  # the same count either way (each mini-batch has others)
    assert metrics["clip/synthetic_overclip_neg"] == pytest.approx(expected, rel=0.5)
    probe = trainer.evaluate()
    assert 0 < probe["eval/junk_mass"] < 1 and probe["eval/probe_entropy"] > 0


def test_junk_ablations_are_refused_on_a_task_without_junk_before_anything_is_built(small_cfg: RunConfig):
    for field in ("warmstart.junk_rate", "clipping.synthetic_drop_neg"):
        with pytest.raises(ConfigError, match=f"{field}=0.5 acts on junk tokens, and task 'arithmetic' has none"):
            build_trainer(with_overrides(small_cfg, {field: 0.5}))


def test_fp8s_dose_on_junk_is_logged_on_shadow_updates(small_cfg: RunConfig):
    """An FP8 arm of the junk organism logs, on its shadow steps, the share of negative-advantage junk tokens FP8
    clips and BF16 does not (its dose), beside the over-clip metrics of all tokens."""
    fp8 = {"precision.mode": "fp8_full", "trainer.shadow_every": 1, "clipping.rollout_correction": "tis_token"}
    trainer = build_trainer(with_overrides(small_cfg, {**JUNK_ORGANISM, **fp8}))
    data = trainer.sampler.collect(0)
    data.adv = torch.randn(data.adv.shape[0], generator=torch.Generator().manual_seed(7))
    trainer.sampler.collect = lambda step: data
    metrics = trainer.train_step(0).metrics
    for key in ("clip/overclip_neg_junk", "clip/underclip_neg_junk", "clip/neg_share_junk"):
        assert 0 <= metrics[key] <= 1, key
    assert metrics["clip/neg_share_junk"] > 0
    # the step's token counts by class and by p_old bucket, at both bounds: two partitions of the same tokens
    from fp8rl.algos import p_old_groups
    from fp8rl.tasks.base import token_classes
    from fp8rl.tracking.glossary import unexplained

    buckets = list(p_old_groups(torch.zeros(1)))
    for sign in ("neg", "pos"):
        by_class = sum(metrics[f"clip/count/{sign}_{name}"] for name in token_classes(trainer.task))
        by_bucket = sum(metrics[f"clip/count/{sign}_{name}"] for name in buckets)
        assert by_class == by_bucket > 0, sign
        for group in [*token_classes(trainer.task), *buckets]:
            over, total = metrics[f"clip/count/overclip_{sign}_{group}"], metrics[f"clip/count/{sign}_{group}"]
            assert 0 <= over <= total and over == int(over), (sign, group)
    assert metrics["clip/count/neg_junk"] > 0
    assert not unexplained(metrics)
