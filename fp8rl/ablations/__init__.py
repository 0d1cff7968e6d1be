"""The studies' reach into a run, built by the job from the config and run by the trainer through
`fp8rl.trainer.hooks` (core code never imports this package):

- gradient ablations (`gradient`): the 2026-12-01 collapse study's synthetic over-clipping
  (``clipping.synthetic_overclip_std``) and the junk organism's class-targeted removal of negative gradients
  (``clipping.synthetic_drop_neg``, ``clipping.synthetic_drop_class``);
- evaluation probes (`probes`): the junk organism's junk-mass probe (tasks with junk tokens).
"""

from __future__ import annotations

from fp8rl.ablations.gradient import ClassDrop, SyntheticOverclip
from fp8rl.ablations.probes import JunkProbe
from fp8rl.config import ClippingConfig
from fp8rl.models.dims import ParallelDims
from fp8rl.models.policy import Policy
from fp8rl.tasks.base import Task, junk_ids
from fp8rl.trainer.hooks import EvalProbe, GradientAblation


def build_ablations(clipping: ClippingConfig, task: Task, seed: int) -> tuple[GradientAblation, ...]:
    """The run's gradient ablations (none by default), seeded by the run's seed."""
    ablations: list[GradientAblation] = []
    if clipping.synthetic_overclip_std:
        ablations.append(SyntheticOverclip(clipping.synthetic_overclip_std, seed))
    if clipping.synthetic_drop_neg:
        matched = clipping.synthetic_drop_class == "matched_other"
        ablations.append(ClassDrop(clipping.synthetic_drop_neg, matched, junk_ids(task), seed))
    return tuple(ablations)


def build_probes(task: Task, policy: Policy, dims: ParallelDims) -> tuple[EvalProbe, ...]:
    """The run's evaluation probes: the junk probe for a task with junk tokens (not under a model split: it runs
    the whole model on each rank)."""
    if junk_ids(task) and not dims.model_split:
        return (JunkProbe(task, policy, dims),)
    return ()


__all__ = ["ClassDrop", "JunkProbe", "SyntheticOverclip", "build_ablations", "build_probes"]
