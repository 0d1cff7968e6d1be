"""One rank of a multi-rank check, launched by the tests with ``torchrun --standalone --nproc-per-node N``.

    worker.py first-step OUT [overrides ...]   one RL step from the small config; rank 0 writes OUT/result.pt:
                                               the step's rollouts and rewards (all DP ranks, in global order),
                                               its metrics, the updated full model, the clip bounds and
                                               the engine's KV cache scales (every rank's)
    worker.py run OUT [overrides ...]          `fp8rl.job.run_job` (tracking off); rank 0 writes the history
    worker.py hf-export OUT [overrides ...]    the vLLM engine's first checkpoint of the policy (every rank
                                               gathers; rank 0 writes OUT/hf/model.safetensors)

The same script with one process gives the reference (DP = TP = PP = 1).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.conftest import SMALL as TEST_SMALL  # noqa: E402 - the suite's small run

SMALL = {**TEST_SMALL, "precision.compute": "fp32"}  # layouts are compared to fp32 round-off


def config(out: Path, overrides: list[str]):
    import yaml

    from fp8rl.choices import validated
    from fp8rl.config import RunConfig, with_overrides

    (out.parent / "warmstart").mkdir(parents=True, exist_ok=True)
    changes = {**SMALL, "warmstart.cache_dir": str(out.parent / "warmstart"), "trainer.out_dir": str(out / "run")}
    changes.update({k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in overrides)})
    return validated(with_overrides(RunConfig(), changes))


def gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Every DP rank's rows, in rank order (rollouts are padded to a common width by the step)."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    size = parallel_state.get_data_parallel_world_size()
    if size == 1:
        return tensor
    parts = [None] * size
    dist.all_gather_object(parts, tensor.cpu(), group=group)
    width = max(p.shape[-1] for p in parts) if tensor.dim() > 1 else None
    padded = [torch.nn.functional.pad(p, (0, width - p.shape[-1])) if width else p for p in parts]
    return torch.cat(padded)


def first_step(out: Path, overrides: list[str]) -> None:
    from fp8rl.job import build_trainer
    from fp8rl.job.distributed import dist_env_from_environ, init_distributed

    init_distributed(dist_env_from_environ())
    cfg = config(out, overrides)
    trainer = build_trainer(cfg)
    data = trainer.sampler.collect(0)
    # Advantages from a fixed generator, the same for every layout: a tiny policy after a short warm start gets
    # every group's answers equally right or wrong, and zero advantages would test no update at all.
    rows = cfg.algo.prompts_per_step * cfg.algo.group_size
    data.adv = torch.randn(rows, generator=torch.Generator().manual_seed(7))[trainer.dims.share(rows)]
    trainer.sampler.collect = lambda step: data  # the step trains on exactly these rollouts
    clip_state = trainer.clip_policy.state_dict()
    if "next_step" in clip_state:  # Calibrated Clipping: calibrate on this step
        trainer.clip_policy.load_state_dict({**clip_state, "next_step": 0})
    result = trainer.train_step(0)
    rows = {
        "response_ids": gather_rows(data.rollout.response_ids),
        "rollout_logp": gather_rows(data.rollout.rollout_logp),
        "adv": gather_rows(data.adv),
    }
    metrics = trainer.dims.mean_of_floats(result.metrics)
    state = {k: v.detach().cpu() for k, v in trainer.policy.full_state_dict().items()}
    state = {k.removeprefix("module."): v for k, v in state.items()}
    every_rank_bounds = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank_bounds, [float(b) for b in trainer.clip_policy.bounds])
    every_rank_kv_scales = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank_kv_scales, dict(trainer.engine.kv_scales))
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        result = {"rows": rows, "metrics": metrics, "state": state, "bounds": every_rank_bounds}
        result["kv_scales"] = every_rank_kv_scales
        torch.save(result, out / "result.pt")
    dist.barrier()


def run(out: Path, overrides: list[str]) -> None:
    """`run_job` as a launched job runs it; ``stop-after=N`` (first override) ends it after N steps, resumable."""
    from fp8rl.job import run_job
    from fp8rl.tracking import NullTracker

    stop_after = None
    if overrides and overrides[0].startswith("stop-after="):
        stop_after = int(overrides.pop(0).split("=", 1)[1])
    tracker = NullTracker()
    summary = run_job(config(out, overrides), tracker=tracker, stop_after=stop_after)
    if int(os.environ.get("RANK", "0")) == 0:
        out.mkdir(parents=True, exist_ok=True)
        history = [{"step": step, **metrics} for step, metrics in tracker.history]
        name = "history.json" if stop_after is None else f"history-stop{stop_after}.json"
        (out / name).write_text(json.dumps({"steps_done": summary.steps_done, "history": history}))


def hf_export(out: Path, overrides: list[str]) -> None:
    """What `VllmEngine` writes before vLLM starts, from this layout's policy (no vLLM needed)."""
    from fp8rl.job import build_trainer
    from fp8rl.job.distributed import dist_env_from_environ, init_distributed
    from fp8rl.models.hf import save_hf_checkpoint
    from fp8rl.rollout.vllm_engine import whole_model_state

    init_distributed(dist_env_from_environ())
    trainer = build_trainer(config(out, overrides))
    state = whole_model_state(trainer.policy)  # a collective under TP / PP
    if int(os.environ.get("RANK", "0")) == 0:
        save_hf_checkpoint(state, trainer.policy.cfg, out / "hf")
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    mode, out, *rest = sys.argv[1:]
    {"first-step": first_step, "run": run, "hf-export": hf_export}[mode](Path(out), rest)
