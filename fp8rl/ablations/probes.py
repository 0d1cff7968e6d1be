"""Evaluation probes (`fp8rl.trainer.hooks.EvalProbe`).

`JunkProbe` (a task with junk tokens, e.g. the chain task; the junk organism's primary measurement):
``eval/junk_mass``, the policy's probability on junk tokens at every position of the clean reference answers of
the first ``PROBE_PROBLEMS`` held-out problems (teacher-forced, <eos> position included, in BF16), mean over
positions, and ``eval/probe_entropy`` at the same positions. It sees junk mass grow long before junk is sampled
often. Data-parallel ranks split the problems and sum; not on a model split over ranks (TP or PP > 1: no rank
holds whole logits).
"""

from __future__ import annotations

import torch

from fp8rl.models.dims import ParallelDims
from fp8rl.models.gpt import compute_precision
from fp8rl.models.logprobs import forward_logits
from fp8rl.models.policy import Policy
from fp8rl.tasks.base import Task, junk_ids
from fp8rl.trainer.warmstart import teacher_forcing_batch

PROBE_PROBLEMS = 256  # held-out problems of the junk probe
ROWS_PER_CALL = 512  # problems per forward pass


class JunkProbe:
    def __init__(self, task: Task, policy: Policy, dims: ParallelDims) -> None:
        self.task, self.policy, self.dims = task, policy, dims

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        """``eval/junk_mass`` and ``eval/probe_entropy`` (module docstring), this rank's share of the problems
        summed over data-parallel ranks."""
        problems = next(iter(self.task.eval_sets.values()))[:PROBE_PROBLEMS]
        dims, module = self.dims, self.policy.module
        mine = problems[len(problems) * dims.dp_rank // dims.dp : len(problems) * (dims.dp_rank + 1) // dims.dp]
        junk = torch.tensor(sorted(junk_ids(self.task)))
        device = next(module.parameters()).device
        sums = torch.zeros(3, dtype=torch.float64)  # junk mass, entropy, positions
        was_training = module.training
        module.eval()
        for start in range(0, len(mine), ROWS_PER_CALL):
            input_ids, attention_mask, loss_mask = (
                t.to(device) for t in teacher_forcing_batch(self.task, mine[start : start + ROWS_PER_CALL])
            )
            with compute_precision("bf16"):
                logits = forward_logits(module, input_ids, attention_mask)
            log_probs = torch.log_softmax(logits[:, :-1, : self.task.tokenizer.vocab_size].float(), dim=-1)
            at = loss_mask[:, 1:].bool()  # the positions that predict an answer token or <eos>
            mass = log_probs[..., junk.to(device)].exp().sum(-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
            sums += torch.tensor(
                [float(mass[at].sum()), float(entropy[at].sum()), float(at.sum())], dtype=torch.float64
            )
        module.train(was_training)
        total = dims.sum(sums)
        positions = float(total[2]) or 1.0
        return {"eval/junk_mass": float(total[0]) / positions, "eval/probe_entropy": float(total[1]) / positions}
