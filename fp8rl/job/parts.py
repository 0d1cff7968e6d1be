"""Build the parts a run trains with, from its config: task, policy (and its start weights), optimizer,
rollout engine, clip-bound policy, precision plan, sampling, reference policy.

Where the start weights come from:

- ``model.hf_path`` set: the Hugging Face checkpoint (`fp8rl.models.hf`): architecture from its
  config.json, weights mapped into the Megatron model, tokenizer from the same folder (the task loads it);
- else the tiny task's supervised warm start (cached by config hash; ``warmstart.steps=0``: a fresh
  random initialisation).

Needs megatron's process state (`fp8rl.models.runtime.init_megatron`), which the job sets up first.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from fp8rl import algos
from fp8rl.config import AlgoConfig, ClippingConfig, RunConfig, TaskConfig
from fp8rl.models.config import ModelConfig, get_model_config, with_tokenizer_vocab
from fp8rl.models.gpt import build_gpt_model
from fp8rl.models.outliers import inject_activation_outliers
from fp8rl.models.parallel import ParallelLayout
from fp8rl.models.sampling import SamplingConfig
from fp8rl.tasks import Task, build_task
from fp8rl.trainer.distributed import DataParallel
from fp8rl.trainer.loop import Parts
from fp8rl.trainer.optim import MegatronPolicyOptimizer, TorchPolicyOptimizer
from fp8rl.trainer.precision import PrecisionPlan, plan_precision
from fp8rl.trainer.warmstart import warmstart

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartWeights:
    """The policy's architecture and the tensors it starts from (None: a fresh random initialisation)."""

    model_cfg: ModelConfig
    tensors: dict[str, torch.Tensor] | None
    source: str  # where they came from, for the run's description


PROMPT_BUDGET = 2048  # tokens of the layout's sequence length kept for the prompt (math tasks on GPUs)


def checkpoint_folder(source: str) -> str:
    """A local checkpoint folder for ``model.hf_path``: the folder itself, or a hub id downloaded (once, into
    the Hugging Face cache) with ``huggingface_hub.snapshot_download``."""
    if Path(source).exists():
        return source
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id=source, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except Exception as err:
        raise RuntimeError(
            f"could not download {source} from the Hugging Face hub ({err}); download it where the hub can be "
            "reached and pass the folder: model.hf_path=<local folder>"
        ) from err


def task_for_layout(cfg: RunConfig, layout: ParallelLayout) -> TaskConfig:
    """The task section with a response limit: the configured one, else (math on a GPU) the layout's sequence
    length less the prompt budget."""
    task = cfg.task
    if task.name == "math" and task.max_response_tokens is None and cfg.model.device == "cuda":
        return dataclasses.replace(task, max_response_tokens=layout.max_seq_len - PROMPT_BUDGET)
    return task


def start_weights(cfg: RunConfig, task: Task, hf_folder: str | None) -> StartWeights:
    """The start weights of the policy (module docstring)."""
    if hf_folder is not None:
        from fp8rl.models.hf import hf_to_megatron, model_config_from_hf_folder, read_hf_tensors

        model_cfg = model_config_from_hf_folder(hf_folder)
        tensors = hf_to_megatron({k: v.float() for k, v in read_hf_tensors(hf_folder).items()}, model_cfg)
        return StartWeights(model_cfg, tensors, f"Hugging Face checkpoint {cfg.model.hf_path}")
    model_cfg = with_tokenizer_vocab(get_model_config(cfg.model.preset), task.tokenizer.vocab_size)
    if cfg.warmstart.steps == 0 or not hasattr(task, "target_ids"):
        return StartWeights(model_cfg, None, f"random initialisation (seed {cfg.warmstart.seed})")
    result = warmstart(model_cfg, task, cfg.task, cfg.warmstart)
    accuracy = result.metadata.get("eval/accuracy", float("nan"))
    source = f"{cfg.warmstart.steps}-step supervised warm start ({accuracy:.1%} greedy held-out accuracy)"
    return StartWeights(model_cfg, safetensors.torch.load_file(str(result.weights_path)), source)


def build_model(weights: StartWeights, seed: int, device: torch.device) -> torch.nn.Module:
    """The local-spec Megatron model with the start weights (strict: every tensor must match)."""
    model = build_gpt_model(weights.model_cfg, seed=seed)
    if weights.tensors is not None:
        missing, unexpected = model.load_state_dict(weights.tensors, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"start weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.to(device)


def build_policy(cfg: RunConfig, weights: StartWeights, layout: ParallelLayout, device: torch.device):
    """(policy, optimizer): the local spec + torch AdamW, or the TE spec + Megatron DDP and optimizer (GPU)."""
    model = build_model(weights, cfg.warmstart.seed, device)
    if cfg.model.outlier_channels:
        inject_activation_outliers(model, cfg.model.outlier_channels, cfg.model.outlier_scale, seed=cfg.warmstart.seed)
    if cfg.precision.backend != "te":
        return model, TorchPolicyOptimizer(model, cfg.algo.lr, cfg.algo.weight_decay)
    from fp8rl.models import te_backend

    te_model = te_backend.build_te_gpt_model(weights.model_cfg, layout, plan_precision(cfg.precision).train_recipe)
    te_backend.load_local_weights(te_model, model.state_dict())
    ddp_model, optimizer = te_backend.policy_optimizer(te_model, layout, cfg.algo.lr, cfg.algo.weight_decay)
    return ddp_model, MegatronPolicyOptimizer(ddp_model, optimizer)


def build_reference(cfg: RunConfig, weights: StartWeights, device: torch.device) -> torch.nn.Module | None:
    """The frozen start policy for the KL penalty (a second model loaded from the same weights)."""
    if cfg.algo.kl_coef <= 0:
        return None
    reference = build_model(weights, cfg.warmstart.seed, device)
    if cfg.model.outlier_channels:
        inject_activation_outliers(
            reference, cfg.model.outlier_channels, cfg.model.outlier_scale, seed=cfg.warmstart.seed
        )
    reference.requires_grad_(False)
    return reference.eval()


def build_engine(cfg: RunConfig, policy: torch.nn.Module, model_cfg: ModelConfig, task: Task, plan: PrecisionPlan):
    """The rollout engine: the built-in one over the policy itself, or vLLM fed with its weights."""
    if cfg.rollout.engine == "builtin":
        from fp8rl.rollout.builtin import BuiltinEngine

        pad_id, kv_cache = task.tokenizer.pad_id, cfg.precision.fp8_kv_cache
        return BuiltinEngine(policy, plan.rollout_recipe, pad_id, fp8_kv_cache=kv_cache)
    from fp8rl.rollout.vllm_engine import VllmEngine

    return VllmEngine(
        policy,
        model_cfg,
        task.tokenizer.pad_id,
        recipe=plan.rollout_recipe,
        fp8_kv_cache=cfg.precision.fp8_kv_cache,
        dtype="bfloat16",
        device=cfg.model.device,
        tokenizer=task.tokenizer if hasattr(task.tokenizer, "save") else checkpoint_folder(cfg.model.hf_path),
        max_num_seqs=cfg.algo.batch_size,
        seed=cfg.trainer.seed,
    )


def build_clip_policy(algo: AlgoConfig, clipping: ClippingConfig) -> algos.ClipBoundPolicy:
    """The clip-bound policy `clipping.policy` with the config's bounds and schedule."""
    if clipping.policy == "standard":
        return algos.make_clip_bound_policy("standard", eps_low=algo.eps_low, eps_high=algo.eps_high)
    low, high = algos.standard_bounds(algo.eps_low, algo.eps_high)
    initial = (
        clipping.init_low if clipping.init_low is not None else low,
        clipping.init_high if clipping.init_high is not None else high,
    )
    return algos.make_clip_bound_policy(
        clipping.policy,
        eps_low=algo.eps_low,
        eps_high=algo.eps_high,
        interval=clipping.interval,
        initial_bounds=initial,
        ema=clipping.ema,
        lower_bound_only=clipping.lower_only,
    )


def sampling_config(cfg: RunConfig, task: Task) -> SamplingConfig:
    """How the rollout samples: the built-in engine never samples the embedding's padding rows (it samples
    among the tokenizer's ids); the vLLM engine samples every row of the checkpoint, and the trainer scores
    alike."""
    return SamplingConfig(
        max_new_tokens=cfg.rollout.max_new_tokens or task.max_response_tokens,
        eos_token_ids=task.tokenizer.eos_ids,
        pad_token_id=task.tokenizer.pad_id,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        vocab_size=None if cfg.rollout.engine == "vllm" else task.tokenizer.vocab_size,
    )


def build_parts(cfg: RunConfig, layout: ParallelLayout, dp: DataParallel, device: torch.device) -> tuple[Parts, str]:
    """Every part of the run, and a one-line description of where the policy starts from."""
    hf_folder = None if cfg.model.hf_path is None else checkpoint_folder(cfg.model.hf_path)
    task = build_task(task_for_layout(cfg, layout), hf_folder)
    weights = start_weights(cfg, task, hf_folder)
    policy, optimizer = build_policy(cfg, weights, layout, device)
    plan = plan_precision(cfg.precision)
    parts = Parts(
        policy=policy,
        optimizer=optimizer,
        engine=build_engine(cfg, policy, weights.model_cfg, task, plan),
        task=task,
        clip_policy=build_clip_policy(cfg.algo, cfg.clipping),
        plan=plan,
        sampling=sampling_config(cfg, task),
        reference=build_reference(cfg, weights, device),
        dp=dp,
        device=device,
    )
    return parts, weights.source
