"""One typed config per run: frozen dataclasses, one per component, composed by `RunConfig`.

This module is the ground floor: it imports nothing else from fp8rl. Each section is the config its
component consumes as is (the clip-bound policy reads `ClippingConfig`, the warm start `WarmStartConfig`,
the task builder `TaskConfig`, ...), so every default has exactly one source: the field below. The YAML
groups in `sweeps/` only override what differs (a test says so).

Checks here are structural and pure (ranges, combinations); a bad config raises `ConfigError` naming
the override to change. Names that registries own (losses, advantage estimators, recipes, tasks, model
presets, rollout engines) are checked against those registries by `fp8rl.choices.validated`, and the
machine (CUDA, GPU capability, vLLM, memory, layout) by `fp8rl.preflight`: both run before anything
heavy starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, get_args, get_origin, get_type_hints


class ConfigError(ValueError):
    """A config that cannot run; the message says what to change."""


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    neutral: tuple[Any, ...] = (),
    hashed: bool = True,
    **kwargs: Any,
) -> Any:
    """A config field with its one-line help (shown by ``make docs`` in docs/configuration.md) and what it means
    for a run's identity (``fp8rl.identity`` derives the config hash from these):

    - ``hashed=False``: the field changes where or how fast a run runs, not what it computes;
    - ``neutral``: for a field added after runs were published, the value(s) that reproduce the behaviour from
      before it existed; at them the field is left out of the hash, so finished runs keep their identity."""
    metadata = {"help": help, "neutral": tuple(neutral), "hashed": hashed}
    if isinstance(default, dict):
        frozen = dict(default)
        return field(default_factory=lambda: dict(frozen), metadata=metadata, **kwargs)
    return field(default=default, metadata=metadata, **kwargs)


# Vocabularies that no registry owns: what the pipeline itself can do.
PRECISION_MODES = ("bf16", "fp8_rollout", "fp8_full")
FP8_BACKENDS = ("emulated", "te", "torchao")
DEVICES = ("cpu", "cuda")
PLACEMENTS = ("colocated", "separate")


def _one_of(value: Any, valid: tuple, where: str) -> None:
    if value not in valid:
        raise ConfigError(f"{where}={value!r} is not valid; choose one of {list(valid)}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class AlgoConfig:
    """The RL objective (GRPO and DAPO are presets of these fields)."""

    name: str = option("grpo", "label of the preset (grpo, dapo)")
    advantage: str = option("grpo", "advantage estimator (registry: grpo, rloo)")
    norm_adv_by_std: bool = option(True, "GRPO's std normalization; false = Dr.GRPO")
    policy_loss: str = option(
        "dual_clip", "policy loss (registry: ppo_clip, dual_clip, cispo); verl's PPO loss is dual-clip, c = 3"
    )
    eps_low: float = option(0.2, "standard lower clip bound is 1 - eps_low")
    eps_high: float = option(0.2, "standard upper clip bound is 1 + eps_high (DAPO clip-higher: 0.28)")
    dual_clip_c: float = option(3.0, "dual-clip constant c (policy_loss=dual_clip)")
    loss_agg: str = option("token-mean", "loss aggregation (token-mean, seq-mean-token-mean, ...); verl's default")
    kl_coef: float = option(0.0, "weight of the KL penalty to the reference (start) policy; 0 = off")
    kl_type: str = option("low_var_kl", "KL estimator (registry: k1, k2, low_var_kl)")
    dynamic_sampling: bool = option(False, "DAPO: drop groups whose rewards are all equal")
    resample_rounds: int = option(
        0, "DAPO: extra rollout rounds that refill the batch with kept groups", neutral=(None, 0)
    )
    overlong_buffer: int = option(0, "DAPO overlong shaping buffer in tokens; 0 = off")
    overlong_factor: float = option(1.0, "DAPO overlong penalty factor")
    group_size: int = option(8, "G responses per prompt")
    prompts_per_step: int = option(32, "prompts per RL step (batch = prompts_per_step x group_size)")
    num_minibatches: int = option(4, "PPO mini-batch updates per step (>= 2 for calibrated clipping)")
    ppo_epochs: int = option(1, "passes over the step's batch")
    lr: float = option(1e-5, "AdamW learning rate")
    weight_decay: float = option(0.0, "AdamW weight decay")
    grad_clip: float = option(1.0, "max global grad norm")
    entropy_coef: float = option(0.0, "entropy bonus weight (0 = off, as in the paper)")

    def __post_init__(self) -> None:
        _require(self.group_size >= 2, f"algo.group_size={self.group_size}: group advantages need >= 2 samples")
        for name in ("prompts_per_step", "num_minibatches", "ppo_epochs"):
            value = getattr(self, name)
            _require(value >= 1, f"algo.{name}={value} must be >= 1")
        batch = self.prompts_per_step * self.group_size
        _require(
            batch % self.num_minibatches == 0,
            f"batch {batch} (algo.prompts_per_step * algo.group_size) is not divisible by "
            f"algo.num_minibatches={self.num_minibatches}; change one of them",
        )
        _require(
            (batch // self.num_minibatches) % self.group_size == 0,
            f"a mini-batch of {batch // self.num_minibatches} sequences splits groups of {self.group_size}; make "
            "algo.prompts_per_step divisible by algo.num_minibatches",
        )
        _require(
            0 < self.eps_low < 1 and self.eps_high > 0,
            f"need 0 < algo.eps_low < 1 and algo.eps_high > 0, got {self.eps_low}, {self.eps_high}",
        )
        _require(self.lr > 0, f"algo.lr={self.lr} must be > 0")
        _require(self.kl_coef >= 0, f"algo.kl_coef={self.kl_coef} must be >= 0")
        _require(self.grad_clip > 0, f"algo.grad_clip={self.grad_clip} must be > 0")
        _require(self.dual_clip_c > 1, f"algo.dual_clip_c={self.dual_clip_c} must be > 1")
        _require(
            self.resample_rounds >= 0 and (self.resample_rounds == 0 or self.dynamic_sampling),
            f"algo.resample_rounds={self.resample_rounds}: refilling needs algo.dynamic_sampling=true and a count >= 0",
        )
        _require(self.overlong_buffer >= 0, f"algo.overlong_buffer={self.overlong_buffer} must be >= 0")

    @property
    def batch_size(self) -> int:
        """Sequences per RL step."""
        return self.prompts_per_step * self.group_size


@dataclass(frozen=True)
class PrecisionConfig:
    """Where FP8 enters the pipeline, and how it scales."""

    mode: str = option("bf16", "bf16, fp8_rollout (rollout FP8, trainer BF16), fp8_full (rollout + trainer FP8)")
    recipe: str = option("tensorwise", "FP8 scaling granularity (tensorwise, rowwise, blockwise, mxfp8)")
    fmt: str | None = option(
        None, "e4m3 everywhere, or hybrid (E5M2 gradients); None = the recipe's preset (tensorwise: hybrid, else e4m3)"
    )
    pow2_scale: bool | None = option(
        None,
        "round scales to powers of two; None = the recipe's preset (rowwise and mxfp8: true; tensorwise and "
        "blockwise: false, FP32 scales; TE's own blockwise default is true)",
        neutral=(None,),
    )
    scaling: str = option("current", "tensorwise only: current or delayed (amax history)")
    amax_history_len: int = option(16, "delayed scaling: amax history length", neutral=(16,))
    amax_compute_algo: str = option("max", "delayed scaling: max over the history or most_recent", neutral=("max",))
    margin: int = option(0, "delayed scaling: scale divided by 2^margin for headroom", neutral=(0,))
    backend: str = option(
        "emulated",
        "emulated (fp8rl.quant, any device), te (Transformer Engine, GPU) or torchao (its float8 training GEMMs: "
        "tensorwise and rowwise; real FP8 on a GPU, torchao's emulation on CPU)",
    )
    fp8_kv_cache: bool = option(False, "FP8 (E4M3) KV cache in the rollout")
    kv_cache_scales: str = option(
        "unit",
        "FP8 KV cache scales: unit (vLLM's default) or calibrated (per layer, amax / 448 of the previous step's "
        "keys and values, as NeMo-RL recalibrates them; built-in engine)",
        neutral=("unit",),
    )
    amax_reduction: str = option(
        "te",
        "emulated tensorwise FP8 under TP: te (as Transformer Engine: current scaling reduces nothing without "
        "sequence parallelism, delayed scaling reduces every amax over TP) or tp_invariant (TP=N computes TP=1)",
        neutral=("te",),
    )
    compute: str = option(
        "bf16", "precision of everything that is not an FP8 GEMM: bf16 autocast, or fp32 (tests)", neutral=("bf16",)
    )

    def __post_init__(self) -> None:
        _one_of(self.mode, PRECISION_MODES, "precision.mode")
        _one_of(self.backend, FP8_BACKENDS, "precision.backend")
        _one_of(self.compute, ("bf16", "fp32"), "precision.compute")
        _one_of(self.kv_cache_scales, ("unit", "calibrated"), "precision.kv_cache_scales")
        _require(
            self.scaling == "current" or self.recipe == "tensorwise",
            "precision.scaling=delayed exists only for precision.recipe=tensorwise",
        )
        _require(
            self.mode != "bf16" or self.recipe == PrecisionConfig.recipe,
            f"precision.recipe={self.recipe} is an FP8 scaling recipe but precision.mode=bf16 uses no FP8: drop the "
            "recipe override or choose precision.mode=fp8_rollout or fp8_full",
        )
        _require(
            self.mode != "bf16" or not self.fp8_kv_cache,
            "precision.fp8_kv_cache=true needs an FP8 precision.mode (fp8_rollout or fp8_full)",
        )

    @property
    def rollout_fp8(self) -> bool:
        return self.mode != "bf16"

    @property
    def trainer_fp8(self) -> bool:
        return self.mode == "fp8_full"


@dataclass(frozen=True)
class ClippingConfig:
    """Clip bounds (standard or Calibrated Clipping) and rollout corrections."""

    policy: str = option("standard", "clip-bound policy (registry: standard, calibrated)")
    interval: int = option(20, "calibrated: recalibrate every K steps (paper: 20)")
    first_step: int | None = option(
        None,
        "calibrated: index of the step (0 = the first) whose shadow gives the first calibration, in force from "
        "the next step; then every K steps (None = K: the first K + 1 steps run at the initial bounds)",
        neutral=(None,),
    )
    init_low: float | None = option(None, "calibrated: lower bound before the first calibration (None = 1 - eps_low)")
    init_high: float | None = option(None, "calibrated: upper bound before the first calibration (None = 1 + eps_high)")
    ema: float = option(0.5, "calibrated: smoothing, bound = ema * old + (1 - ema) * calibrated")
    lower_only: bool = option(False, "calibrated: ablation that calibrates only the lower bound")
    pool_neg_tokens: int = option(
        0,
        "calibrated: a calibration also pools the newest earlier shadow steps until it holds this many "
        "negative-advantage tokens (0 = its own step only, the paper's rule at its batch sizes)",
        neutral=(0,),
    )
    rollout_correction: str = option("none", "none, or a correction (registry: tis_token, tis_seq, mis_*, icepop)")
    tis_cap: float = option(2.0, "TIS truncation C")
    mis_low: float = option(0.5, "MIS / IcePop: keep tokens whose rollout ratio is >= mis_low")
    mis_high: float = option(2.0, "MIS / IcePop: keep tokens whose rollout ratio is <= mis_high")
    synthetic_overclip_std: float = option(
        0.0,
        "ablation (positive control), 0 = off: a negative-advantage token loses its gradient when its log-ratio "
        "plus N(0, std^2) noise falls to log(clip low) or below, as FP8 noise of that size would do",
        neutral=(0.0,),
    )

    def __post_init__(self) -> None:
        _require(self.interval >= 1, f"clipping.interval={self.interval} must be >= 1")
        _require(
            self.first_step is None or self.first_step >= 0,
            f"clipping.first_step={self.first_step} must be >= 0 (0 = the first step), or null for the interval",
        )
        _require(self.synthetic_overclip_std >= 0, "clipping.synthetic_overclip_std must be >= 0")
        _require(0 <= self.ema < 1, f"clipping.ema={self.ema} must be in [0, 1)")
        _require(self.pool_neg_tokens >= 0, f"clipping.pool_neg_tokens={self.pool_neg_tokens} must be >= 0")
        _require(self.tis_cap > 0, f"clipping.tis_cap={self.tis_cap} must be > 0")
        _require(0 < self.mis_low < 1 < self.mis_high, "need 0 < clipping.mis_low < 1 < clipping.mis_high")


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout engine and its sampling."""

    engine: str = option("builtin", "builtin (the trainer's Megatron model, KV cache) or vllm")
    temperature: float = option(1.0, "sampling temperature (> 0)")
    top_p: float = option(1.0, "nucleus mass; 1 = off")
    max_new_tokens: int | None = option(None, "response limit in tokens; None = the task's")

    def __post_init__(self) -> None:
        _require(
            self.temperature > 0,
            "rollout.temperature must be > 0 for RL sampling (log-probs of a greedy policy are degenerate)",
        )
        _require(0 < self.top_p <= 1, f"rollout.top_p={self.top_p} must be in (0, 1]")
        _require(
            self.max_new_tokens is None or self.max_new_tokens >= 1,
            f"rollout.max_new_tokens={self.max_new_tokens} must be >= 1",
        )


@dataclass(frozen=True)
class PolicyConfig:
    """The policy model: a named preset or a Hugging Face checkpoint, and its device."""

    preset: str = option("tiny", "model preset (tiny, qwen3_8b, qwen3_14b, qwen2_5_32b)")
    hf_path: str | None = option(
        None, "Hugging Face checkpoint folder (or hub id): weights, config, tokenizer", neutral=(None,)
    )
    device: str = option("cpu", "cpu or cuda")
    outlier_channels: int = option(0, "ablation: activation outlier channels injected after the warm start")
    outlier_scale: float = option(1.0, "their magnitude factor (function-preserving; fp8rl.models.outliers)")

    def __post_init__(self) -> None:
        _one_of(self.device, DEVICES, "model.device")
        _require(
            0 <= self.outlier_channels <= 128,
            f"model.outlier_channels={self.outlier_channels} must be in 0..128 (0 = off)",
        )
        _require(
            not self.outlier_channels or self.outlier_scale > 1.0,
            f"model.outlier_scale={self.outlier_scale} with model.outlier_channels={self.outlier_channels}: "
            "outliers need a factor above 1 (e.g. model.outlier_scale=32), or set model.outlier_channels=0",
        )


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout (fp8rl.models.parallel): None = the model preset's layout; set a field to override it."""

    tensor_parallel: int | None = option(None, "TP size (within a node)", neutral=(None,))
    pipeline_parallel: int | None = option(None, "PP size", neutral=(None,))
    nodes: int | None = option(None, "nodes per job (DP = nodes x GPUs / (TP x PP))", neutral=(None,))
    gpus_per_node: int | None = option(None, "GPUs (= ranks) per node", neutral=(None,))
    max_seq_len: int | None = option(None, "trainer sequence length", neutral=(None,))
    micro_batch_size: int | None = option(None, "sequences per micro-batch and rank", neutral=(None,))
    rollout_placement: str | None = option(
        None, "colocated (vLLM shares the trainer GPUs) or separate", neutral=(None,)
    )
    rollout_tensor_parallel: int | None = option(None, "vLLM's TP size", neutral=(None,))
    rollout_gpus: int | None = option(None, "separate placement: GPUs per job reserved for vLLM", neutral=(None,))
    rollout_memory_fraction: float | None = option(
        None, "colocated vLLM's share of each GPU (its gpu_memory_utilization)", neutral=(None,)
    )
    rollout_sleep: bool | None = option(
        None, "colocated vLLM sleeps (frees its share) while the trainer computes", neutral=(None,)
    )
    distributed_optimizer: bool | None = option(None, "shard the optimizer state over DP (Megatron)", neutral=(None,))
    activation_recompute: bool | None = option(None, "full activation recompute (Megatron)", neutral=(None,))
    gpu_memory_gb: float | None = option(None, "per GPU, for the memory check (H100 80, H200 141)", neutral=(None,))

    def __post_init__(self) -> None:
        if self.rollout_placement is not None:
            _one_of(self.rollout_placement, PLACEMENTS, "parallel.rollout_placement")
        sizes = ("tensor_parallel", "pipeline_parallel", "nodes", "gpus_per_node", "micro_batch_size")
        for name in sizes:
            value = getattr(self, name)
            _require(value is None or value >= 1, f"parallel.{name}={value} must be >= 1")

    def overrides(self) -> dict[str, Any]:
        """The fields set (not None): what changes the preset layout."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class TaskConfig:
    """The verifiable-reward task: the tiny arithmetic task, or a math data set with a verifier reward."""

    name: str = option("arithmetic", "task (registry: arithmetic, math)")
    operations: str = option("+", "arithmetic: operations")
    num_digits: int = option(3, "arithmetic: operand digits")
    num_train: int = option(20000, "arithmetic: training problems")
    num_eval: int = option(256, "arithmetic: held-out problems")
    seed: int = option(0, "fixes the problem sets")
    dataset: str | None = option(None, "math: training data set (dapo_math_17k, deepscaler)", neutral=(None,))
    path: str | None = option(
        None, "math: local file or folder of the training data (None = the hub id)", neutral=(None,)
    )
    split: str | None = option(None, "math: data set split (None = the data set's default)", neutral=(None,))
    eval_sets: tuple[str, ...] = option(
        (), "math: evaluation benchmarks (aime24, aime25, amc23, math500)", neutral=((), [])
    )
    eval_paths: dict[str, str] = option(
        {}, "math: benchmark -> local file or folder (default: the hub id)", neutral=({},)
    )
    chat_template: bool = option(
        True, "math: prompt with the tokenizer's chat template (false = raw prompt)", neutral=(True,)
    )
    max_response_tokens: int | None = option(
        None, "math: response limit in tokens (None = the task's default)", neutral=(None,)
    )
    overlong_prompts: str = option(
        "refuse",
        "math: prompts too long for the trainer's sequence with the response limit: refuse (before anything is "
        "built; the count and longest named) or filter (dropped, the count logged)",
        neutral=("refuse",),
    )
    min_operands: int = option(4, "chain: fewest operands of a sum (its response lists the running sums)", neutral=(4,))
    max_operands: int = option(9, "chain: most operands of a sum", neutral=(9,))
    junk_tokens: int = option(
        16, "chain: vocabulary tokens that no prompt or answer uses (mass can leak there)", neutral=(16,)
    )

    def __post_init__(self) -> None:
        _require(self.num_train >= 1 and self.num_eval >= 1, "task.num_train and task.num_eval must be >= 1")
        _require(
            2 <= self.min_operands <= self.max_operands,
            f"need 2 <= task.min_operands <= task.max_operands, got {self.min_operands}, {self.max_operands}",
        )
        _require(0 <= self.junk_tokens <= 26, f"task.junk_tokens={self.junk_tokens} must be in 0..26 (letters)")
        _require(1 <= self.num_digits <= 9, f"task.num_digits={self.num_digits} must be in 1..9")
        object.__setattr__(self, "eval_sets", tuple(self.eval_sets))


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation during training: greedy accuracy (tiny task) or Avg@k / Pass@k per benchmark."""

    every: int = option(10, "evaluate every N steps (and at the end); 0 = only at the end")
    size: int = option(256, "problems per evaluation (per benchmark)")
    samples: int = option(1, "samples per problem (k of Avg@k / Pass@k); 1 = one greedy answer", neutral=(1,))
    temperature: float = option(0.6, "sampling temperature when samples > 1", neutral=(0.6,))
    top_p: float = option(0.95, "nucleus mass when samples > 1", neutral=(0.95,))
    bf16: bool = option(
        False, "also evaluate in BF16 (eval/bf16/...) to separate training damage from FP8 noise", neutral=(False,)
    )

    def __post_init__(self) -> None:
        _require(self.every >= 0, f"eval.every={self.every} must be >= 0")
        _require(self.size >= 1 and self.samples >= 1, "eval.size and eval.samples must be >= 1")
        _require(self.temperature > 0 and 0 < self.top_p <= 1, "need eval.temperature > 0 and 0 < eval.top_p <= 1")


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start of the tiny task's policy (cached by config hash); not used for checkpoints."""

    steps: int = option(400, "SFT steps (0 = none)")
    batch_size: int = option(256, "SFT batch")
    lr: float = option(1e-3, "SFT learning rate (AdamW, constant)")
    weight_decay: float = option(0.0, "SFT AdamW weight decay", neutral=(0.0,))
    grad_clip: float = option(1.0, "SFT max global grad norm", neutral=(1.0,))
    precision: str = option("bf16", "SFT compute precision: fp32 or bf16 autocast", neutral=("bf16",))
    seed: int = option(0, "SFT seed (model init and batches)")
    eval_batch_size: int = option(512, "prompts per greedy-decoding batch in the warm start's evaluation", hashed=False)
    cache_dir: str = option(".cache/warmstart", "where warm starts are cached", hashed=False)
    stop_accuracy: float | None = option(
        None,
        "stop early once greedy held-out accuracy reaches this (a partly right start); None = run all steps",
        neutral=(None,),
    )
    check_every: int = option(20, "steps between the accuracy checks of stop_accuracy", neutral=(20,))
    shipped: bool = option(
        True,
        "use the warm start shipped in fp8rl/assets/warmstart when its key matches (the same weights on every CPU); "
        "false = train it on this machine",
        hashed=False,
    )

    def __post_init__(self) -> None:
        _require(self.steps >= 0, f"warmstart.steps={self.steps} must be >= 0")
        _require(
            self.stop_accuracy is None or 0 < self.stop_accuracy <= 1,
            f"warmstart.stop_accuracy={self.stop_accuracy} must be in (0, 1] or None",
        )
        _require(self.check_every >= 1, f"warmstart.check_every={self.check_every} must be >= 1")
        _one_of(self.precision, ("fp32", "bf16"), "warmstart.precision")


@dataclass(frozen=True)
class TrainerConfig:
    """The RL loop."""

    steps: int = option(100, "RL steps")
    seed: int = option(0, "seeds prompts, sampling and everything else")
    checkpoint_every: int = option(10, "checkpoint every N steps; 0 = only at the end")
    keep_checkpoints: int = option(2, "most recent checkpoints kept")
    out_dir: str | None = option(
        None, "checkpoints and run files; None = outputs/runs/<run name>-<config hash>", hashed=False
    )
    resume: bool = option(
        True, "continue from the newest checkpoint in out_dir (false: move it aside, start fresh)", hashed=False
    )
    max_bad_steps: int = option(3, "stop after this many non-finite steps in a row")
    export_every: int = option(
        0, "write a Hugging Face checkpoint (run folder's hf/) every N steps; 0 = never", neutral=(0,)
    )
    shadow_every: int = option(0, "fp8_full: BF16 shadow diagnostics every N steps; 0 = calibration steps only")
    log_ratio_histograms: bool = option(True, "log BF16-shadow vs FP8 ratio histograms on shadow steps")
    threads: int = option(0, "torch intra-op threads; 0 = torch's default", hashed=False)

    def __post_init__(self) -> None:
        _require(self.steps >= 1, "trainer.steps must be >= 1")
        _require(self.checkpoint_every >= 0, f"trainer.checkpoint_every={self.checkpoint_every} must be >= 0")
        _require(self.keep_checkpoints >= 1, f"trainer.keep_checkpoints={self.keep_checkpoints} must be >= 1")
        _require(self.max_bad_steps >= 0, f"trainer.max_bad_steps={self.max_bad_steps} must be >= 0")
        _require(self.shadow_every >= 0, "trainer.shadow_every must be >= 0")
        _require(self.threads >= 0, "trainer.threads must be >= 0")


@dataclass(frozen=True)
class TrackingConfig:
    """MLflow tracking."""

    enabled: bool = option(True, "false = no MLflow (tests)", hashed=False)
    tracking_uri: str | None = option(
        None, "None = $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working dir", hashed=False
    )
    experiment: str = option("fp8rl", "MLflow experiment", hashed=False)
    run_name: str | None = option(None, "MLflow run name (default: derived from the config)", hashed=False)
    parent_run_id: str | None = option(None, "nest this run under a sweep's parent run", hashed=False)
    tags: dict[str, str] = option({}, "extra tags (sweep axes)", hashed=False)
    connect_timeout_s: float = option(10.0, "how long the store may take to answer before the run starts", hashed=False)
    offline: bool = option(
        False, "store unreachable: train anyway, buffer locally, upload when it returns", hashed=False
    )

    def __post_init__(self) -> None:
        _require(self.connect_timeout_s > 0, "tracking.connect_timeout_s must be > 0")


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs."""

    algo: AlgoConfig = field(default_factory=AlgoConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    clipping: ClippingConfig = field(default_factory=ClippingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    model: PolicyConfig = field(default_factory=PolicyConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        check_combinations(self)


def check_combinations(cfg: RunConfig) -> None:
    """Rules that span sections (each section checks its own fields when it is built)."""
    a, c, p = cfg.algo, cfg.clipping, cfg.precision
    low = c.init_low if c.init_low is not None else 1 - a.eps_low
    high = c.init_high if c.init_high is not None else 1 + a.eps_high
    bounds = f"clipping.init_low={low}, init_high={high}"
    _require(0 < low < 1 < high, f"clip bounds must satisfy 0 < low < 1 < high, got {bounds}")
    updates = a.num_minibatches * a.ppo_epochs
    if c.policy == "calibrated":
        _require(
            p.mode == "fp8_full",
            "clipping.policy=calibrated aligns FP8 trainer ratios with BF16 ones: it needs precision.mode=fp8_full",
        )
        _require(
            updates >= 2,
            "clipping.policy=calibrated compares ratios after an update: set algo.num_minibatches >= 2 "
            "or algo.ppo_epochs >= 2",
        )
    _require(
        not cfg.trainer.shadow_every or updates >= 2,
        "trainer.shadow_every compares ratios after an update: set algo.num_minibatches >= 2",
    )
    _require(
        cfg.model.device == "cuda" or p.backend != "te",
        "precision.backend=te (Transformer Engine) runs on a CUDA GPU: set model.device=cuda, or use "
        "precision.backend=emulated on CPU",
    )
    _require(
        not (p.fp8_kv_cache and p.kv_cache_scales == "calibrated" and cfg.rollout.engine == "vllm"),
        "precision.kv_cache_scales=calibrated is the built-in engine's (vLLM takes k_scale / v_scale from the "
        "checkpoint, which fp8rl does not write yet): use rollout.engine=builtin, or precision.kv_cache_scales=unit",
    )
    _require(
        p.backend != "torchao" or p.amax_reduction == "te",
        "precision.amax_reduction=tp_invariant is the emulator's: torchao scales each rank's shard itself; use "
        "precision.backend=emulated for it",
    )
    if cfg.task.name == "math":
        _require(cfg.task.dataset is not None, "task.name=math needs task.dataset (dapo_math_17k or deepscaler)")
        _require(
            cfg.model.hf_path is not None,
            "task.name=math prompts with the model's own tokenizer: set model.hf_path=<checkpoint folder or hub id>",
        )


# ---------------------------------------------------------------------------------------------------- dicts
def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested dict of the config (for hashing, logging and YAML)."""
    return dataclasses.asdict(cfg)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def section_types() -> dict[str, type]:
    """Section name -> its config class."""
    hints = get_type_hints(RunConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig)}


def from_dict(d: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from a nested dict (e.g. OmegaConf.to_container of the Hydra config); unknown keys raise."""
    sections = section_types()
    kwargs = {}
    for name, value in d.items():
        if name not in sections:
            raise ConfigError(f"unknown config section {name!r}; valid sections: {sorted(sections)}")
        kwargs[name] = _section_from_dict(sections[name], name, value or {})
    return RunConfig(**kwargs)


def _section_from_dict(cls: type, name: str, values: Mapping[str, Any]) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"unknown field(s) {sorted(unknown)} in section {name!r}; valid: {sorted(known)}")
    hints = get_type_hints(cls)
    coerced = {k: tuple(v) if _is_tuple(hints[k]) and isinstance(v, list) else v for k, v in values.items()}
    return cls(**coerced)


def _is_tuple(hint: Any) -> bool:
    return get_origin(hint) is tuple or any(get_origin(a) is tuple for a in get_args(hint))


def with_overrides(cfg: RunConfig, changes: Mapping[str, Any]) -> RunConfig:
    """A copy of `cfg` with dotted-path changes, e.g. ``{"trainer.steps": 2, "algo.lr": 1e-4}`` (checked)."""
    sections: dict[str, dict[str, Any]] = {}
    for dotted, value in changes.items():
        section, _, name = dotted.partition(".")
        if section not in section_types() or not name:
            raise ConfigError(f"{dotted!r} is not <section>.<field>; sections: {sorted(section_types())}")
        sections.setdefault(section, {})[name] = value
    replaced = {}
    for section, values in sections.items():
        current = getattr(cfg, section)
        known = {f.name for f in dataclasses.fields(current)}
        unknown = set(values) - known
        if unknown:
            raise ConfigError(f"unknown field(s) {sorted(unknown)} in section {section!r}; valid: {sorted(known)}")
        replaced[section] = dataclasses.replace(current, **values)
    return dataclasses.replace(cfg, **replaced)
