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

Probes (`fp8rl.trainer.hooks.EvalProbe`, built by the job: e.g. the junk organism's junk-mass probe,
`fp8rl.ablations.probes`) add their metrics to each evaluation.

Sample generations: after `run`, ``samples`` holds the first ``SAMPLES_PER_SET`` (problem, sample) rows of every
set, in each precision (prompt, reference answer, decoded response, reward, why it is garbled if it is), as the
first data-parallel rank generated them; the fit loop logs them (garbled output is one of the paper's symptoms).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

import torch

from fp8rl.config import EvalConfig
from fp8rl.models.dims import SINGLE, ParallelDims
from fp8rl.models.policy import Policy
from fp8rl.models.sampling import SamplingConfig
from fp8rl.rollout.base import RolloutEngine
from fp8rl.rollout.builtin import BuiltinEngine
from fp8rl.tasks.base import Problem, Task
from fp8rl.trainer.hooks import EvalProbe

EVAL_SEED = 20_240_611  # base of the fixed per-(problem, sample) sampling seeds
ROWS_PER_CALL = 512  # prompts per generate call
SAMPLES_PER_SET = 8  # generations kept per evaluation set and precision (`Evaluator.samples`)


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
        probes: Sequence[EvalProbe] = (),
    ) -> None:
        self.task, self.engine, self.cfg, self.dims = task, engine, cfg, dims
        self.probes = tuple(probes)
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
        for probe in self.probes:
            metrics.update(probe())
        return metrics

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
