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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import safetensors.torch
import torch

from fp8rl import algos
from fp8rl.ablations import build_ablations, build_probes
from fp8rl.config import AlgoConfig, ClippingConfig, ConfigError, PrecisionConfig, RunConfig, TaskConfig, to_dict
from fp8rl.models.config import ModelConfig, get_model_config, with_tokenizer_vocab
from fp8rl.models.dims import ParallelDims
from fp8rl.models.fp8_layers import set_fp8_amax_reduction, set_fp8_engine
from fp8rl.models.outliers import inject_activation_outliers
from fp8rl.models.parallel import ParallelLayout
from fp8rl.models.policy import Policy
from fp8rl.models.policy import build_policy as build_policy_module
from fp8rl.models.sampling import SamplingConfig
from fp8rl.tasks import Task, build_task
from fp8rl.tasks.base import junk_ids
from fp8rl.trainer.loop import Parts
from fp8rl.trainer.optim import TorchPolicyOptimizer, megatron_policy_optimizer
from fp8rl.trainer.precision import PrecisionPlan, plan_precision
from fp8rl.trainer.warmstart import cached_warmstart, warmstart, warmstart_in_own_process

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class StartWeights:
    """The policy's architecture and the tensors it starts from (None: a fresh random initialisation; from a HF
    checkpoint, a mapping that reads each tensor when a rank loads its part)."""

    model_cfg: ModelConfig
    tensors: Mapping[str, torch.Tensor] | None
    source: str  # where they came from, for the run's description
    details: dict = dataclasses.field(default_factory=dict)  # the warm start's identity, accuracy and machine


WARMSTART_DETAILS = (
    "key",
    "origin",
    "sha256",
    "steps_done",
    "eval/accuracy",
    "train_seconds",
    "torch_threads",
    "machine",
)
PROMPT_BUDGET = 2048  # tokens of the layout's sequence length kept for the prompt (math tasks on GPUs)


def checkpoint_folder(source: str) -> str:
    """A local checkpoint folder for ``model.hf_path``: the folder itself, or a hub id downloaded (once, into
    the Hugging Face cache) with ``huggingface_hub.snapshot_download``."""
    if Path(source).exists():
        return source
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt"]
    try:
        return rank_zero_first(lambda: snapshot_download(repo_id=source, allow_patterns=patterns))
    except Exception as err:
        raise RuntimeError(
            f"could not download {source} from the Hugging Face hub ({err}); download it where the hub can be "
            "reached and pass the folder: model.hf_path=<local folder>"
        ) from err


def rank_zero_first(make: Callable[[], T]) -> T:
    """`make()` on rank 0, then on the other ranks (which then find what rank 0 cached: a warm start, a download)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return make()
    result = make() if dist.get_rank() == 0 else None
    dist.barrier()
    return result if dist.get_rank() == 0 else make()


def warmstart_here_or_apart(cfg: RunConfig, model_cfg: ModelConfig, task: Task, dims: ParallelDims):
    """The warm start: trained in this process, or (model split over ranks) in a process of its own."""
    if dims.model_split and cached_warmstart(model_cfg, task, cfg.task, cfg.warmstart) is None:
        warmstart_in_own_process(to_dict(cfg))
    return warmstart(model_cfg, task, cfg.task, cfg.warmstart)


def task_for_layout(cfg: RunConfig, layout: ParallelLayout) -> TaskConfig:
    """The task section with a response limit: the configured one, else (math on a GPU) the layout's sequence
    length less the prompt budget."""
    task = cfg.task
    if task.name == "math" and task.max_response_tokens is None and cfg.model.device == "cuda":
        return dataclasses.replace(task, max_response_tokens=layout.max_seq_len - PROMPT_BUDGET)
    return task


def start_weights(cfg: RunConfig, task: Task, hf_folder: str | None, dims: ParallelDims) -> StartWeights:
    """The start weights of the policy (module docstring)."""
    if hf_folder is not None:
        from fp8rl.models.hf import megatron_state_from_hf_folder, model_config_from_hf_folder

        model_cfg = model_config_from_hf_folder(hf_folder)
        tensors = megatron_state_from_hf_folder(hf_folder, model_cfg)  # read when this rank's part is loaded
        return StartWeights(model_cfg, tensors, f"Hugging Face checkpoint {cfg.model.hf_path}")
    model_cfg = with_tokenizer_vocab(get_model_config(cfg.model.preset), task.tokenizer.vocab_size)
    if cfg.warmstart.steps == 0 or not hasattr(task, "target_ids"):
        return StartWeights(model_cfg, None, f"random initialisation (seed {cfg.warmstart.seed})")
    result = rank_zero_first(lambda: warmstart_here_or_apart(cfg, model_cfg, task, dims))
    accuracy = result.metadata.get("eval/accuracy", float("nan"))
    steps = result.metadata.get("steps_done", cfg.warmstart.steps)  # fewer when stopped at an accuracy
    origin = result.metadata.get("origin", "cache")
    source = f"{steps}-step supervised warm start ({accuracy:.1%} greedy held-out accuracy, {origin})"
    details = {key: result.metadata.get(key) for key in WARMSTART_DETAILS}
    return StartWeights(model_cfg, safetensors.torch.load_file(str(result.weights_path)), source, details)


def build_policy(cfg: RunConfig, weights: StartWeights, dims: ParallelDims, device):
    """(policy, optimizer): this rank's model with the start weights and its optimizer:

    - one process, emulated FP8: the local layer spec and torch AdamW;
    - several ranks (CPU or GPU): Megatron DDP and Megatron's Adam around this rank's shard / stage (gradients
      reduced over DP, replicated parameters over TP, tied embeddings over PP);
    - Transformer Engine (GPU): the TE layer spec, BF16 parameters with FP32 master weights.
    """
    if cfg.precision.backend == "te":
        return _te_policy(cfg, weights, dims)
    policy = policy_with_weights(weights, cfg, device, dims)
    if dims.plan.world_size == 1:
        return policy, TorchPolicyOptimizer(policy.module, cfg.algo.lr, cfg.algo.weight_decay)
    ddp_model, optimizer = megatron_policy_optimizer(
        policy.module, cfg.algo.lr, cfg.algo.weight_decay, distributed=dims.plan.distributed_optimizer, bf16=False
    )
    return Policy(ddp_model, policy.cfg, dims), optimizer


def policy_with_weights(weights: StartWeights, cfg: RunConfig, device: torch.device, dims: ParallelDims) -> Policy:
    """This rank's part of the local-spec model with the start weights (and the outlier ablation, if asked)."""
    policy = build_policy_module(weights.model_cfg, weights.tensors, cfg.warmstart.seed, device, dims)
    if cfg.precision.backend == "torchao":
        set_fp8_engine(policy.module, "torchao")
    elif dims.tp > 1:
        set_fp8_amax_reduction(policy.module, amax_reduction_policy(cfg.precision))
    if cfg.model.outlier_channels:
        inject_activation_outliers(
            policy.module, cfg.model.outlier_channels, cfg.model.outlier_scale, seed=cfg.warmstart.seed
        )
    return policy


def amax_reduction_policy(precision: PrecisionConfig) -> str:
    """Which tensorwise amaxes the emulated FP8 linears all-reduce over their TP group (fp8_layers'
    AMAX_REDUCTION_ROLES). Transformer Engine's delayed scaling reduces over TP x DP; the emulator reduces over TP
    only (megatron's ``tp_only_amax_red``): the rollout's decode loops run different lengths on different DP
    ranks, and a per-GEMM collective across them would wait forever."""
    if precision.amax_reduction == "tp_invariant":
        return "tp_invariant"
    return "all" if precision.scaling == "delayed" else "te_current"


def _te_policy(cfg: RunConfig, weights: StartWeights, dims: ParallelDims):
    from fp8rl.models import te_backend

    te_model = te_backend.build_te_gpt_model(weights.model_cfg, dims.plan, plan_precision(cfg.precision).train_recipe)
    local = policy_with_weights(dataclasses.replace(weights), cfg, torch.device("cpu"), dims)
    te_backend.load_local_weights(te_model, local.module.state_dict())
    ddp_model, optimizer = megatron_policy_optimizer(
        te_model, cfg.algo.lr, cfg.algo.weight_decay, distributed=dims.plan.distributed_optimizer, bf16=True
    )
    return Policy(ddp_model, weights.model_cfg, dims), optimizer


def build_reference(cfg: RunConfig, weights: StartWeights, device: torch.device, dims: ParallelDims) -> Policy | None:
    """The frozen start policy for the KL penalty (a second model loaded from the same weights)."""
    if cfg.algo.kl_coef <= 0:
        return None
    reference = policy_with_weights(weights, cfg, device, dims)
    reference.module.requires_grad_(False)
    reference.module.eval()
    return reference


def build_engine(cfg: RunConfig, policy: Policy, model_cfg: ModelConfig, task: Task, plan: PrecisionPlan):
    """The rollout engine: the built-in one over the policy itself, or vLLM fed with its weights, placed where the
    layout says (its TP, longest sequence, memory share and sleep mode: `ParallelDims.rollout_engine_settings`)."""
    if cfg.rollout.engine == "builtin":
        from fp8rl.rollout.builtin import BuiltinEngine

        pad_id, kv_cache, kv_scales = task.tokenizer.pad_id, cfg.precision.fp8_kv_cache, cfg.precision.kv_cache_scales
        return BuiltinEngine(
            policy, plan.rollout_recipe, pad_id, compute=plan.compute, fp8_kv_cache=kv_cache, kv_cache_scales=kv_scales
        )
    from fp8rl.rollout.vllm_engine import VllmEngine

    return VllmEngine(
        policy,  # the whole model is exported (gathered over TP and PP), not this rank's shard
        model_cfg,
        task.tokenizer.pad_id,
        recipe=plan.rollout_recipe,
        fp8_kv_cache=cfg.precision.fp8_kv_cache,
        kv_cache_scales=cfg.precision.kv_cache_scales,
        dtype="bfloat16",
        device=cfg.model.device,
        tokenizer=task.tokenizer if hasattr(task.tokenizer, "save") else checkpoint_folder(cfg.model.hf_path),
        max_num_seqs=cfg.algo.batch_size,
        seed=cfg.trainer.seed,
        **policy.dims.rollout_engine_settings(cfg.model.device),
    )


def build_clip_policy(algo: AlgoConfig, clipping: ClippingConfig) -> algos.ClipBoundPolicy:
    """The clip-bound policy `clipping.policy`, built from the config by its registered class."""
    return algos.get_clip_bound_policy(clipping.policy).from_config(algo, clipping)


def build_objective(algo: AlgoConfig, clipping: ClippingConfig) -> algos.Objective:
    """The run's objective, fixed here: the policy loss with its options (the ones its surrogate declares, read
    from `algo`), the rollout correction, KL penalty and entropy bonus."""
    loss = algos.get_policy_loss(algo.policy_loss)
    options = {name: getattr(algo, name) for name in loss.option_names}
    return algos.Objective(
        policy_loss=loss.configured(agg=algo.loss_agg, **options),
        correction=clipping.rollout_correction,
        correction_params=algos.CorrectionParams(clipping.tis_cap, clipping.mis_low, clipping.mis_high),
        kl_coef=algo.kl_coef,
        kl_type=algo.kl_type,
        entropy_coef=algo.entropy_coef,
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


def micro_batch_size(cfg: RunConfig, layout: ParallelLayout) -> int | None:
    """Rows per forward/backward pass: the layout's micro-batch under pipeline parallelism, on a GPU (a rank's whole
    batch of logits does not fit: qwen3_8b's ~1M tokens x 152K vocabulary) or when set; else (CPU, PP = 1) the
    whole mini-batch in one pass, as the golden record was made."""
    asked = layout.pipeline_parallel > 1 or cfg.model.device == "cuda" or cfg.parallel.micro_batch_size is not None
    return layout.micro_batch_size if asked else None


@dataclass(frozen=True)
class PreparedTask:
    """The run's task with its data loaded and checked, before anything else is built: `task`, the checkpoint
    folder its tokenizer came from (None: no ``model.hf_path``), and the count of prompts dropped per set for
    being too long for the sequence (``task.overlong_prompts=filter``; none otherwise)."""

    task: Task
    hf_folder: str | None
    dropped: dict[str, int]

    def log_dropped(self) -> None:
        """One warning line with the counts, if any prompt was dropped."""
        if any(self.dropped.values()):
            log.warning("dropped prompts too long for the sequence (task.overlong_prompts=filter): %s", self.dropped)


def prepare_task(cfg: RunConfig, layout: ParallelLayout) -> PreparedTask:
    """The task of `cfg` for `layout`: its data read and checked (a bad file, an empty set or prompts too long for
    the sequence raise a `ConfigError` naming the file and the row), the prompts fitted to the sequence. Cheap next
    to the model, so the job does it before the run folder and the MLflow run exist."""
    hf_folder = None if cfg.model.hf_path is None else checkpoint_folder(cfg.model.hf_path)
    task = build_task(task_for_layout(cfg, layout), hf_folder)
    dropped: dict[str, int] = {}
    if hasattr(task, "fit_prompts"):  # math: prompts of any length (the arithmetic tasks' are short by construction)
        dropped = task.fit_prompts(layout.max_seq_len)
    for field_name, value in (
        ("warmstart.junk_rate", cfg.warmstart.junk_rate),
        ("clipping.synthetic_drop_neg", cfg.clipping.synthetic_drop_neg),
    ):
        if value and not junk_ids(task):
            raise ConfigError(
                f"{field_name}={value} acts on junk tokens, and task {cfg.task.name!r} has none: use task=chain "
                f"(task.junk_tokens > 0), or set {field_name}=0"
            )
    return PreparedTask(task, hf_folder, dropped)


def build_parts(
    cfg: RunConfig, dims: ParallelDims, device: torch.device, prepared: PreparedTask | None = None
) -> tuple[Parts, StartWeights]:
    """Every part of the run, and a one-line description of where the policy starts from. `dims`: where this rank
    is and what it runs, read by every builder. `prepared`: the task from `prepare_task` (None: prepared here)."""
    layout = dims.plan
    if prepared is None:
        prepared = prepare_task(cfg, layout)
        prepared.log_dropped()
    task, hf_folder = prepared.task, prepared.hf_folder
    weights = start_weights(cfg, task, hf_folder, dims)
    policy, optimizer = build_policy(cfg, weights, dims, device)
    plan = plan_precision(cfg.precision)
    parts = Parts(
        policy=policy,
        optimizer=optimizer,
        engine=build_engine(cfg, policy, weights.model_cfg, task, plan),
        task=task,
        clip_policy=build_clip_policy(cfg.algo, cfg.clipping),
        objective=build_objective(cfg.algo, cfg.clipping),
        plan=plan,
        sampling=sampling_config(cfg, task),
        reference=build_reference(cfg, weights, device, dims),
        dims=dims,
        device=device,
        micro_batch_size=micro_batch_size(cfg, layout),
        ablations=build_ablations(cfg.clipping, task, cfg.trainer.seed),
        probes=build_probes(task, policy, dims),
    )
    return parts, dataclasses.replace(weights, tensors=None)
