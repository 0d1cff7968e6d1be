"""Evaluation during training: every evaluation set of the task, in the rollout's precision and (optionally)
in BF16, so that FP8 inference noise can be told apart from what training did to the weights.

With ``eval.samples`` = 1 each problem gets one greedy answer (the tiny task's accuracy); with k > 1, k
samples at ``eval.temperature`` / ``eval.top_p`` give Avg@k (mean reward) and Pass@k (share of problems
with at least one right answer), as the paper reports AIME. Sampling seeds are fixed per (problem, sample)
and never change between evaluations, so successive evaluations differ only by the weights.

Data-parallel ranks split each set's (problem, sample) rows and gather the per-row results, so the numbers
do not depend on the layout.

Metrics, for each set S: ``eval/S/avg_at_k`` (Avg@k), ``eval/S/pass_at_k`` (Pass@k; MLflow metric names
cannot hold "@"), ``eval/S/garbled_rate``, ``eval/S/response_len``, ``eval/S/entropy``; over the sets:
``eval/accuracy`` (the mean of the sets' Avg@k: the headline number), ``eval/garbled_rate``,
``eval/response_len``, ``eval/entropy``. In BF16 the same keys under ``eval/bf16/``.

Junk probe (a task with junk tokens, e.g. the chain task; the junk organism's primary measurement):
``eval/junk_mass``, the policy's probability on junk tokens at every position of the clean reference answers of
the first ``PROBE_PROBLEMS`` held-out problems (teacher-forced, <eos> position included, in BF16), mean over
positions, and ``eval/probe_entropy`` at the same positions. It sees junk mass grow long before junk is sampled
often. Not on a model split over ranks (TP or PP > 1: no rank holds whole logits).

Sample generations: after `run`, ``samples`` holds the first ``SAMPLES_PER_SET`` (problem, sample) rows of every
set, in each precision (prompt, reference answer, decoded response, reward, why it is garbled if it is), as the
first data-parallel rank generated them; the fit loop logs them (garbled output is one of the paper's symptoms).
"""

from __future__ import annotations

import dataclasses
import statistics

import torch

from fp8rl.config import EvalConfig
from fp8rl.models.dims import SINGLE, ParallelDims
from fp8rl.models.gpt import compute_precision
from fp8rl.models.logprobs import forward_logits
from fp8rl.models.policy import Policy
from fp8rl.models.sampling import SamplingConfig
from fp8rl.rollout.base import RolloutEngine
from fp8rl.rollout.builtin import BuiltinEngine
from fp8rl.tasks.base import Problem, Task, junk_ids
from fp8rl.trainer.warmstart import teacher_forcing_batch

EVAL_SEED = 20_240_611  # base of the fixed per-(problem, sample) sampling seeds
ROWS_PER_CALL = 512  # prompts per generate call
SAMPLES_PER_SET = 8  # generations kept per evaluation set and precision (`Evaluator.samples`)
PROBE_PROBLEMS = 256  # held-out problems of the junk probe


class Evaluator:
    """Evaluates the policy on the task's evaluation sets (module docstring)."""

    def __init__(
        self,
        task: Task,
        engine: RolloutEngine,
        policy: Policy,
        sampling: SamplingConfig,
        cfg: EvalConfig,
        dims: ParallelDims = SINGLE,
    ) -> None:
        self.task, self.engine, self.cfg, self.dims = task, engine, cfg, dims
        self.policy = policy
        if cfg.samples == 1:
            self.sampling = dataclasses.replace(sampling, temperature=0.0)
        else:
            self.sampling = dataclasses.replace(sampling, temperature=cfg.temperature, top_p=cfg.top_p)
        self.bf16_engine = BuiltinEngine(policy, None, sampling.pad_token_id, compute="bf16") if cfg.bf16 else None
        self.samples: list[dict[str, object]] = []  # of the last `run` (module docstring)

    def run(self) -> dict[str, float]:
        """All evaluation metrics (in the rollout engine's precision, and in BF16 when asked)."""
        self.samples = []
        metrics = self._evaluate(self.engine, "eval/")
        if self.bf16_engine is not None:
            metrics.update(self._evaluate(self.bf16_engine, "eval/bf16/"))
        if junk_ids(self.task) and not self.dims.model_split:
            metrics.update(self._junk_probe())
        return metrics

    @torch.no_grad()
    def _junk_probe(self) -> dict[str, float]:
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

    def _evaluate(self, engine: RolloutEngine, prefix: str) -> dict[str, float]:
        sets = self.task.eval_sets.items()
        per_set = {name: self._evaluate_set(engine, problems[: self.cfg.size], name, prefix) for name, problems in sets}
        k = self.cfg.samples
        out = {f"{prefix}{name}/{key}": value for name, values in per_set.items() for key, value in values.items()}
        out[f"{prefix}accuracy"] = statistics.fmean(v[f"avg_at_{k}"] for v in per_set.values())
        for key in ("garbled_rate", "response_len", "entropy"):
            out[f"{prefix}{key}"] = statistics.fmean(v[key] for v in per_set.values())
        return out

    def _evaluate_set(self, engine: RolloutEngine, problems: list[Problem], name: str, prefix: str) -> dict[str, float]:
        k = self.cfg.samples
        rows = [p for p in problems for _ in range(k)]
        dims = self.dims
        mine = range(len(rows) * dims.dp_rank // dims.dp, len(rows) * (dims.dp_rank + 1) // dims.dp)
        rewards, garbled, lengths, entropy_sum, tokens = [], [], [], 0.0, 0
        for start in range(mine.start, mine.stop, ROWS_PER_CALL):
            indices = range(start, min(start + ROWS_PER_CALL, mine.stop))
            chunk = [rows[i] for i in indices]
            seeds = None if k == 1 else [EVAL_SEED + i for i in indices]
            batch = engine.generate([self.task.prompt_ids(p) for p in chunk], self.sampling, seeds)
            responses = batch.responses()
            rewards += self.task.rewards(chunk, responses)
            garbled += [float(self.task.garble_reason(r) is not None) for r in responses]
            if start < SAMPLES_PER_SET:  # the set's first rows are the first data-parallel rank's
                self._keep_samples(
                    chunk[: SAMPLES_PER_SET - start], responses, rewards[start - mine.start :], name, prefix
                )
            mask = batch.response_mask
            lengths += mask.sum(1).tolist()
            entropy_sum += float((batch.rollout_entropy * mask).sum())
            tokens += int(mask.sum())
        gather = self.dims.gather_1d
        per_problem = gather(torch.tensor(rewards, dtype=torch.float64)).view(len(problems), k)
        entropy_and_tokens = self.dims.sum(torch.tensor([entropy_sum, tokens], dtype=torch.float64))
        return {
            f"avg_at_{k}": float(per_problem.mean()),
            f"pass_at_{k}": float((per_problem > 0).any(dim=1).float().mean()),
            "garbled_rate": float(gather(torch.tensor(garbled, dtype=torch.float64)).mean()),
            "response_len": float(gather(torch.tensor(lengths, dtype=torch.float64)).mean()),
            "entropy": float(entropy_and_tokens[0] / entropy_and_tokens[1].clamp(min=1)),
        }

    def _keep_samples(self, problems, responses, rewards, set_name: str, prefix: str) -> None:
        for problem, response, reward in zip(problems, responses, rewards, strict=False):
            reason = self.task.garble_reason(response)
            self.samples.append(
                {
                    "precision": "bf16" if prefix.startswith("eval/bf16") else "rollout",
                    "set": set_name,
                    "prompt": problem.prompt,
                    "answer": problem.answer,
                    "response": self.task.tokenizer.decode(list(response)),
                    "reward": float(reward),
                    "garbled": reason or "",
                }
            )
