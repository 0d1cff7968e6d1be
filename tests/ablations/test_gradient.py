"""The studies' gradient ablations and their builders (fp8rl.ablations), apart from a trainer."""

from __future__ import annotations

import torch

from fp8rl.ablations import ClassDrop, SyntheticOverclip, build_ablations, build_probes
from fp8rl.config import ClippingConfig, TaskConfig
from fp8rl.tasks import build_task
from fp8rl.trainer.hooks import UpdateSite


def site(step: int = 3, update: int = 1, rank: int = 0) -> UpdateSite:
    """A mini-batch of 4 rows x 6 response tokens: ids 0-9, negative advantages in rows 0 and 2."""
    ids = torch.arange(24).reshape(4, 6) % 10
    batch = type("Batch", (), {"response_ids": ids})()
    adv = torch.tensor([-1.0, 1.0, -1.0, 1.0])
    return UpdateSite(step, update, rank, batch, torch.ones(4, 6), adv, torch.full((4, 6), -0.5))


def test_no_ablation_by_default_and_each_one_from_its_config_field() -> None:
    task = build_task(TaskConfig(name="chain", num_train=10, num_eval=10))
    assert build_ablations(ClippingConfig(), task, 0) == ()
    both = build_ablations(ClippingConfig(synthetic_overclip_std=0.1, synthetic_drop_neg=0.5), task, 7)
    assert both == (SyntheticOverclip(0.1, 7), ClassDrop(0.5, False, task.junk_ids, 7))
    matched = build_ablations(ClippingConfig(synthetic_drop_neg=1.0, synthetic_drop_class="matched_other"), task, 7)
    assert matched[0].matched


def test_class_drop_removes_negative_class_tokens_seeded_by_the_update() -> None:
    drop = ClassDrop(1.0, False, frozenset({2, 3}), seed=0)
    ablation = drop.for_update(site())
    zeroed = ablation.zeroed(torch.zeros(4, 6), None, 0.8)
    expected = torch.isin(site().batch.response_ids, torch.tensor([2, 3])) & (site().adv[:, None] < 0)
    assert torch.equal(zeroed, expected)
    assert torch.equal(ablation.select(torch.tensor([2])).mask, zeroed[2:3])
    half = ClassDrop(0.5, False, frozenset(range(10)), seed=0)
    first, again, other = (half.for_update(s).mask for s in (site(), site(), site(update=2)))
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_synthetic_overclip_noise_is_drawn_per_update_and_cut_per_micro_batch() -> None:
    overclip = SyntheticOverclip(0.3, seed=1)
    noise = overclip.for_update(site()).noise
    assert noise.shape == (4, 6) and torch.equal(noise, overclip.for_update(site()).noise)
    assert not torch.equal(noise, overclip.for_update(site(rank=1)).noise)
    assert torch.equal(overclip.for_update(site()).select(torch.tensor([1, 3])).noise, noise[[1, 3]])


def test_the_junk_probe_only_for_a_task_with_junk_tokens() -> None:
    from fp8rl.models.dims import SINGLE

    chain = build_task(TaskConfig(name="chain", num_train=10, num_eval=10))
    arithmetic = build_task(TaskConfig(num_train=10, num_eval=10))
    assert len(build_probes(chain, None, SINGLE)) == 1
    assert build_probes(arithmetic, None, SINGLE) == ()
