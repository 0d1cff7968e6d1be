"""One typed config per run: dataclasses registered with Hydra's ConfigStore, validated once at launch.

The YAML groups in `sweeps/` only override what differs from these defaults. `validate(cfg)` is the
single place where impossible combinations fail, with a message that says what to change; it runs
before any model, engine or tracker is built.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

PRECISION_MODES = ("bf16", "fp8_rollout", "fp8_full")
RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")
FP8_FORMATS = ("e4m3", "hybrid")
FP8_BACKENDS = ("emulated", "te")
CLIP_POLICIES = ("standard", "calibrated")
ROLLOUT_CORRECTIONS = ("none", "tis_token", "tis_seq", "mis_token", "mis_seq")
ROLLOUT_ENGINES = ("builtin", "vllm")
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
DEVICES = ("cpu", "cuda")


@dataclass
class AlgoConfig:
    """The RL objective (GRPO and DAPO are presets of these fields)."""

    name: str = "grpo"  # label of the preset ("grpo", "dapo")
    advantage: str = "grpo"  # advantage estimator registry key ("grpo", "rloo")
    norm_adv_by_std: bool = True  # GRPO's std normalization; False = Dr.GRPO
    policy_loss: str = "ppo_clip"  # policy-loss registry key ("ppo_clip", "dual_clip")
    eps_low: float = 0.2  # standard lower clip bound is 1 - eps_low
    eps_high: float = 0.2  # standard upper clip bound is 1 + eps_high (DAPO clip-higher: 0.28)
    dual_clip_c: float = 3.0  # dual-clip constant (used by "dual_clip")
    loss_agg: str = "seq-mean-token-mean"  # loss aggregation mode (DAPO: "token-mean")
    kl_coef: float = 0.0  # weight of the KL penalty to the reference (warm-start) policy; 0 = off
    kl_type: str = "low_var_kl"  # "k1", "k2" or "low_var_kl" (k3)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal
    resample_rounds: int | None = None  # DAPO: extra rollout rounds that refill the batch with kept groups; None = 0
    overlong_buffer: int = 0  # DAPO overlong shaping buffer length in tokens; 0 = off
    overlong_factor: float = 1.0  # DAPO overlong penalty factor
    group_size: int = 8  # G responses per prompt
    prompts_per_step: int = 32  # prompts per RL step (batch = prompts_per_step * group_size)
    num_minibatches: int = 4  # PPO mini-batch updates per step (>= 2 for calibrated clipping)
    ppo_epochs: int = 1  # passes over the step's batch
    lr: float = 1e-5  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global grad norm
    entropy_coef: float = 0.0  # entropy bonus weight (0 = off, as in the paper)


@dataclass
class PrecisionConfig:
    """Where FP8 enters the pipeline."""

    mode: str = "bf16"  # "bf16", "fp8_rollout" (rollout FP8, trainer BF16), "fp8_full" (rollout + trainer FP8)
    recipe: str = "tensorwise"  # FP8 scaling granularity: tensorwise, rowwise, blockwise, mxfp8
    fmt: str = "e4m3"  # "e4m3" everywhere or "hybrid" (E5M2 gradients)
    scaling: str = "current"  # tensorwise only: "current" or "delayed"
    backend: str = "emulated"  # "emulated" (fp8rl.quant, any device) or "te" (Transformer Engine, GPU)
    fp8_kv_cache: bool = False  # FP8 (E4M3, unit-scale) KV cache in the rollout; built-in engine: emulated


@dataclass
class ClippingConfig:
    """Clip bounds and rollout corrections."""

    policy: str = "standard"  # "standard" or "calibrated" (Calibrated Clipping)
    interval: int = 20  # calibrated: recalibrate every K steps
    init_low: float | None = None  # calibrated: bounds before the first calibration (None = 1 - eps_low)
    init_high: float | None = None  # calibrated: (None = 1 + eps_high)
    ema: float = 0.0  # calibrated: smoothing of bound updates, new = ema * old + (1 - ema) * calibrated
    lower_only: bool = False  # calibrated: ablation that calibrates only the lower bound
    rollout_correction: str = "none"  # "none", "tis_token", "tis_seq", "mis_token", "mis_seq"
    tis_cap: float = 2.0  # TIS truncation C
    mis_low: float = 0.5  # MIS / IcePop: keep tokens with rollout ratio in [mis_low, mis_high]
    mis_high: float = 2.0


@dataclass
class RolloutConfig:
    """The rollout engine and sampling."""

    engine: str = "builtin"  # "builtin" (same Megatron model, KV cache) or "vllm"
    temperature: float = 1.0  # sampling temperature
    top_p: float = 1.0  # nucleus mass; 1 = off
    max_new_tokens: int | None = None  # None = the task's response limit


@dataclass
class ModelSection:
    """Which model preset (see fp8rl.models.config) and its device."""

    preset: str = "tiny"  # "tiny", "qwen3_8b", "qwen3_14b", "qwen2_5_32b"
    device: str = "cpu"  # "cpu" or "cuda"
    outlier_channels: int = 0  # ablation: activation outlier channels injected after the warm start (0 = off)
    outlier_scale: float = 1.0  # their magnitude factor (function-preserving; see fp8rl.models.outliers)


@dataclass
class ParallelSection:
    """GPU layout (fp8rl.models.parallel): None = the model preset's layout; set a field to override it."""

    tensor_parallel: int | None = None  # TP size (within a node)
    pipeline_parallel: int | None = None  # PP size
    nodes: int | None = None  # nodes per job (DP = nodes x GPUs / (TP x PP))
    gpus_per_node: int | None = None  # GPUs (= ranks) per node
    max_seq_len: int | None = None  # trainer sequence length
    micro_batch_size: int | None = None  # sequences per micro-batch and rank
    rollout_placement: str | None = None  # "colocated" (vLLM shares the trainer GPUs) or "separate"
    rollout_tensor_parallel: int | None = None
    rollout_gpus: int | None = None  # separate placement: GPUs per job reserved for vLLM
    distributed_optimizer: bool | None = None
    activation_recompute: bool | None = None
    gpu_memory_gb: float | None = None  # per GPU, for the memory check (H100 80, H200 141)


@dataclass
class TaskSection:
    """The verifiable-reward task."""

    name: str = "arithmetic"  # task registry key
    operations: str = "+"  # arithmetic operations
    num_digits: int = 3  # operand digits
    num_train: int = 20000  # training prompts
    num_eval: int = 256  # held-out eval prompts
    seed: int = 0  # fixes the problem sets


@dataclass
class WarmStartSection:
    """Supervised warm start (cached by config hash)."""

    steps: int = 400  # SFT steps (tiny + 3-digit addition: about 59% greedy accuracy)
    batch_size: int = 256  # SFT batch
    lr: float = 1e-3  # SFT learning rate
    seed: int = 0  # SFT seed
    cache_dir: str = ".cache/warmstart"  # where warm starts are cached


@dataclass
class TrainerConfig:
    """The RL loop."""

    steps: int = 100  # RL steps
    seed: int = 0  # seeds prompts, sampling and everything else
    eval_every: int = 10  # greedy eval every N steps (and at the end); 0 = only at the end
    eval_size: int = 256  # eval prompts used
    checkpoint_every: int = 10  # checkpoint every N steps; 0 = only at the end
    keep_checkpoints: int = 2  # most recent checkpoints kept
    out_dir: str = "outputs/run"  # checkpoints and run files
    max_bad_steps: int = 3  # stop after this many non-finite steps in a row
    shadow_every: int = 0  # fp8_full: BF16 shadow diagnostics (over-clip rates) every N steps; 0 = calibration only
    log_ratio_histograms: bool = True  # log BF16-shadow vs FP8 ratio histograms as artifacts
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    keep_freed_memory: bool = False  # glibc: keep freed buffers for reuse (fp8rl.malloc); speed only


@dataclass
class TrackingConfig:
    """MLflow tracking."""

    enabled: bool = True  # False = no MLflow (tests)
    tracking_uri: str | None = None  # None = $MLFLOW_TRACKING_URI or sqlite:///mlflow.db in the working dir
    experiment: str = "fp8rl"  # MLflow experiment
    run_name: str | None = None  # MLflow run name (default: derived from the config)
    parent_run_id: str | None = None  # nest this run under a sweep's parent run
    tags: dict[str, str] = field(default_factory=dict)  # extra tags (sweep axes)


@dataclass
class RunConfig:
    """Everything one run needs."""

    algo: AlgoConfig = field(default_factory=AlgoConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    clipping: ClippingConfig = field(default_factory=ClippingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    task: TaskSection = field(default_factory=TaskSection)
    warmstart: WarmStartSection = field(default_factory=WarmStartSection)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


class ConfigError(ValueError):
    """A config that cannot run; the message says what to change."""


def _one_of(value: Any, valid: tuple, where: str) -> None:
    if value not in valid:
        raise ConfigError(f"{where}={value!r} is not valid; choose one of {list(valid)}")


def validate(cfg: RunConfig, cuda_available: bool = False) -> RunConfig:
    """Check every field and combination; raise ConfigError naming the override to change."""
    a, p, c, r = cfg.algo, cfg.precision, cfg.clipping, cfg.rollout
    _one_of(p.mode, PRECISION_MODES, "precision.mode")
    _one_of(p.recipe, RECIPES, "precision.recipe")
    _one_of(p.fmt, FP8_FORMATS, "precision.fmt")
    _one_of(p.backend, FP8_BACKENDS, "precision.backend")
    _one_of(p.scaling, ("current", "delayed"), "precision.scaling")
    _one_of(c.policy, CLIP_POLICIES, "clipping.policy")
    _one_of(c.rollout_correction, ROLLOUT_CORRECTIONS, "clipping.rollout_correction")
    _one_of(r.engine, ROLLOUT_ENGINES, "rollout.engine")
    _one_of(a.loss_agg, LOSS_AGGREGATIONS, "algo.loss_agg")
    _one_of(cfg.model.device, DEVICES, "model.device")
    if p.scaling == "delayed" and p.recipe != "tensorwise":
        raise ConfigError("precision.scaling=delayed exists only for precision.recipe=tensorwise")
    if p.mode == "bf16" and p.recipe != PrecisionConfig.recipe:
        raise ConfigError(
            f"precision.recipe={p.recipe} is an FP8 scaling recipe but precision.mode=bf16 uses no FP8: drop the "
            "recipe override or choose precision.mode=fp8_rollout or fp8_full"
        )
    if a.resample_rounds is not None and (a.resample_rounds < 0 or not a.dynamic_sampling):
        raise ConfigError(
            f"algo.resample_rounds={a.resample_rounds}: refilling needs algo.dynamic_sampling=true and a count >= 0"
        )
    if a.group_size < 2:
        raise ConfigError(f"algo.group_size={a.group_size}: group advantages need at least 2 samples per prompt")
    batch = a.prompts_per_step * a.group_size
    if batch % a.num_minibatches:
        raise ConfigError(
            f"batch {batch} (algo.prompts_per_step * algo.group_size) is not divisible by "
            f"algo.num_minibatches={a.num_minibatches}; change one of them"
        )
    if (batch // a.num_minibatches) % a.group_size:
        raise ConfigError(
            f"a mini-batch of {batch // a.num_minibatches} sequences splits groups of {a.group_size}; make "
            "algo.prompts_per_step divisible by algo.num_minibatches"
        )
    if not 0 < a.eps_low < 1 or a.eps_high <= 0:
        raise ConfigError(f"need 0 < algo.eps_low < 1 and algo.eps_high > 0, got {a.eps_low}, {a.eps_high}")
    low = c.init_low if c.init_low is not None else 1 - a.eps_low
    high = c.init_high if c.init_high is not None else 1 + a.eps_high
    if not 0 < low < 1 < high:
        raise ConfigError(f"clip bounds must satisfy 0 < low < 1 < high, got clipping.init_low={low}, init_high={high}")
    if c.policy == "calibrated":
        if a.num_minibatches * a.ppo_epochs < 2:
            raise ConfigError(
                "clipping.policy=calibrated compares ratios after an update: set algo.num_minibatches >= 2 "
                "or algo.ppo_epochs >= 2"
            )
        if c.interval < 1:
            raise ConfigError(f"clipping.interval={c.interval} must be >= 1")
        if not 0 <= c.ema < 1:
            raise ConfigError(f"clipping.ema={c.ema} must be in [0, 1)")
        if p.mode != "fp8_full":
            raise ConfigError(
                "clipping.policy=calibrated aligns FP8 trainer ratios with BF16 ones: it needs precision.mode=fp8_full"
            )
    if c.rollout_correction.startswith("tis") and c.tis_cap <= 0:
        raise ConfigError(f"clipping.tis_cap={c.tis_cap} must be > 0")
    if c.rollout_correction.startswith("mis") and not 0 < c.mis_low < 1 < c.mis_high:
        raise ConfigError("need 0 < clipping.mis_low < 1 < clipping.mis_high")
    if p.mode == "bf16" and cfg.precision.fp8_kv_cache:
        raise ConfigError("precision.fp8_kv_cache=true needs an FP8 precision.mode (fp8_rollout or fp8_full)")
    if r.engine == "vllm":
        from fp8rl.rollout.vllm_engine import VllmSupportError, check_vllm_support

        try:
            check_vllm_support(None if p.mode == "bf16" else p.recipe, p.fp8_kv_cache, cfg.model.device)
        except VllmSupportError as err:
            raise ConfigError(f"rollout.engine=vllm: {err}") from err
    if p.backend == "te" and not cuda_available:
        raise ConfigError(
            "precision.backend=te (Transformer Engine) needs a CUDA GPU and none was found; "
            "use precision.backend=emulated on CPU"
        )
    if cfg.model.outlier_channels < 0 or cfg.model.outlier_channels > 128:
        raise ConfigError(f"model.outlier_channels={cfg.model.outlier_channels} must be in 0..128 (0 = off)")
    if cfg.model.outlier_channels and cfg.model.outlier_scale <= 1.0:
        raise ConfigError(
            f"model.outlier_scale={cfg.model.outlier_scale} with model.outlier_channels={cfg.model.outlier_channels}: "
            "outliers need a factor above 1 (e.g. model.outlier_scale=32), or set model.outlier_channels=0"
        )
    if cfg.model.device == "cuda" and not cuda_available:
        raise ConfigError("model.device=cuda but no CUDA device was found; use model.device=cpu")
    if cfg.model.device == "cpu" and cfg.model.preset != "tiny":
        raise ConfigError(f"model.preset={cfg.model.preset} is a GPU-scale model; on this CPU use model.preset=tiny")
    if cfg.model.device == "cuda" or any(v is not None for v in dataclasses.asdict(cfg.parallel).values()):
        _check_parallel(cfg)
    if r.temperature <= 0:
        raise ConfigError(
            "rollout.temperature must be > 0 for RL sampling (log-probs of a greedy policy are degenerate)"
        )
    if a.lr <= 0:
        raise ConfigError(f"algo.lr={a.lr} must be > 0")
    if cfg.trainer.shadow_every < 0:
        raise ConfigError("trainer.shadow_every must be >= 0")
    if cfg.trainer.shadow_every and (a.num_minibatches * a.ppo_epochs < 2):
        raise ConfigError("trainer.shadow_every compares ratios after an update: set algo.num_minibatches >= 2")
    if cfg.trainer.steps < 1:
        raise ConfigError("trainer.steps must be >= 1")
    return cfg


def parallel_layout(cfg: RunConfig):
    """The run's GPU layout: the model preset's (fp8rl.models.parallel) with `cfg.parallel` overrides."""
    from fp8rl.models.parallel import preset_layout

    return preset_layout(cfg.model.preset, **dataclasses.asdict(cfg.parallel))


def _check_parallel(cfg: RunConfig) -> None:
    from fp8rl.models.config import get_model_config
    from fp8rl.models.parallel import ParallelLayoutError, check_layout

    try:
        check_layout(parallel_layout(cfg), get_model_config(cfg.model.preset))
    except ParallelLayoutError as err:
        raise ConfigError(str(err)) from err


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested dict of the config (for hashing, logging and YAML)."""
    return dataclasses.asdict(cfg)


# Fields that change where or how a run is stored, not what it computes: left out of the config hash.
_HASH_EXCLUDED = ("tracking", "trainer.out_dir", "trainer.threads", "trainer.keep_freed_memory", "warmstart.cache_dir")
# Sections and fields added after runs were published: they enter the hash only where set (not None), so
# that adding them does not change the identity of finished runs (MLflow reuse in `fp8rl sweep`).
_HASH_ONLY_WHEN_SET = ("parallel", "algo.resample_rounds")


def config_hash(cfg: RunConfig) -> str:
    """Identity of what a run computes (sweep idempotence): a hash of the resolved config.

    Lives here, not in the trainer, so that the launcher can plan a sweep without importing torch.
    """
    flat = flatten(to_dict(cfg))
    kept = {k: v for k, v in flat.items() if not any(k == e or k.startswith(e + ".") for e in _HASH_EXCLUDED)}
    kept = {k: v for k, v in kept.items() if v is not None or not _added_later(k)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _added_later(key: str) -> bool:
    return any(key == s or key.startswith(s + ".") for s in _HASH_ONLY_WHEN_SET)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def from_dict(d: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from a nested dict (e.g. OmegaConf.to_container of the Hydra config)."""
    sections = {f.name: f.type for f in dataclasses.fields(RunConfig)}
    kwargs = {}
    for name, value in d.items():
        if name not in sections:
            raise ConfigError(f"unknown config section {name!r}; valid sections: {sorted(sections)}")
        section_cls = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)}[name]().__class__
        known = {f.name for f in dataclasses.fields(section_cls)}
        unknown = set(value) - known
        if unknown:
            raise ConfigError(f"unknown field(s) {sorted(unknown)} in section {name!r}; valid: {sorted(known)}")
        kwargs[name] = section_cls(**value)
    return RunConfig(**kwargs)
