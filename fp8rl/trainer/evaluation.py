"""Evaluation during training: every evaluation set of the task, in the rollout's precision and (optionally)
in BF16, so that FP8 inference noise can be told apart from what training did to the weights.

With ``eval.samples`` = 1 each problem gets one greedy answer (the tiny task's accuracy); with k > 1, k
samples at ``eval.temperature`` / ``eval.top_p`` give Avg@k (mean reward) and Pass@k (share of problems
with at least one right answer), as the paper reports AIME. Sampling seeds are fixed per (problem, sample)
and never change between evaluations, so successive evaluations differ only by the weights.

Metrics, for each set S: ``eval/S/avg_at_k`` (Avg@k), ``eval/S/pass_at_k`` (Pass@k; MLflow metric names
cannot hold "@"), ``eval/S/garbled_rate``, ``eval/S/response_len``, ``eval/S/entropy``; over the sets:
``eval/accuracy`` (the mean of the sets' Avg@k: the headline number), ``eval/garbled_rate``,
``eval/response_len``, ``eval/entropy``. In BF16 the same keys under ``eval/bf16/``.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch

from fp8rl.config import EvalConfig
from fp8rl.models.sampling import SamplingConfig
from fp8rl.rollout.base import RolloutEngine
from fp8rl.rollout.builtin import BuiltinEngine
from fp8rl.tasks.base import Problem, Task, garble_metrics

EVAL_SEED = 20_240_611  # base of the fixed per-(problem, sample) sampling seeds
ROWS_PER_CALL = 512  # prompts per generate call


class Evaluator:
    """Evaluates the policy on the task's evaluation sets (module docstring)."""

    def __init__(
        self,
        task: Task,
        engine: RolloutEngine,
        model: torch.nn.Module,
        sampling: SamplingConfig,
        cfg: EvalConfig,
        device: torch.device | str = "cpu",
    ) -> None:
        self.task, self.engine, self.cfg = task, engine, cfg
        if cfg.samples == 1:
            self.sampling = dataclasses.replace(sampling, temperature=0.0)
        else:
            self.sampling = dataclasses.replace(sampling, temperature=cfg.temperature, top_p=cfg.top_p)
        self.bf16_engine = BuiltinEngine(model, None, sampling.pad_token_id) if cfg.bf16 else None

    def run(self) -> dict[str, float]:
        """All evaluation metrics (in the rollout engine's precision, and in BF16 when asked)."""
        metrics = self._evaluate(self.engine, "eval/")
        if self.bf16_engine is not None:
            metrics.update(self._evaluate(self.bf16_engine, "eval/bf16/"))
        return metrics

    def _evaluate(self, engine: RolloutEngine, prefix: str) -> dict[str, float]:
        sets = self.task.eval_sets.items()
        per_set = {name: self._evaluate_set(engine, problems[: self.cfg.size]) for name, problems in sets}
        k = self.cfg.samples
        out = {f"{prefix}{name}/{key}": value for name, values in per_set.items() for key, value in values.items()}
        out[f"{prefix}accuracy"] = statistics.fmean(v[f"avg_at_{k}"] for v in per_set.values())
        for key in ("garbled_rate", "response_len", "entropy"):
            out[f"{prefix}{key}"] = statistics.fmean(v[key] for v in per_set.values())
        return out

    def _evaluate_set(self, engine: RolloutEngine, problems: list[Problem]) -> dict[str, float]:
        k = self.cfg.samples
        rows = [p for p in problems for _ in range(k)]
        seeds = None if k == 1 else [EVAL_SEED + i for i in range(len(rows))]
        rewards, reasons, lengths, entropy_sum, tokens = [], [], [], 0.0, 0
        for start in range(0, len(rows), ROWS_PER_CALL):
            chunk = rows[start : start + ROWS_PER_CALL]
            chunk_seeds = None if seeds is None else seeds[start : start + ROWS_PER_CALL]
            batch = engine.generate([self.task.prompt_ids(p) for p in chunk], self.sampling, chunk_seeds)
            responses = batch.responses()
            rewards += self.task.rewards(chunk, responses)
            reasons += [self.task.garble_reason(r) for r in responses]
            mask = batch.response_mask
            lengths += mask.sum(1).tolist()
            entropy_sum += float((batch.rollout_entropy * mask).sum())
            tokens += int(mask.sum())
        per_problem = torch.tensor(rewards).view(len(problems), k)
        return {
            f"avg_at_{k}": float(per_problem.mean()),
            f"pass_at_{k}": float((per_problem > 0).any(dim=1).float().mean()),
            "garbled_rate": garble_metrics(reasons)["rollout/garbled_rate"],
            "response_len": statistics.fmean(lengths),
            "entropy": entropy_sum / max(tokens, 1),
        }
