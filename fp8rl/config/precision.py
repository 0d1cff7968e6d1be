"""Where FP8 enters the pipeline, and how it scales."""

from __future__ import annotations

from dataclasses import dataclass

from fp8rl.config.fields import FP8_BACKENDS, PRECISION_MODES, _one_of, _require, option


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
        "calibrated",
        "FP8 KV cache scales: calibrated (per layer, amax / 448 of the previous step's keys and values, as NeMo-RL "
        "recalibrates them) or unit (vLLM's default when a checkpoint carries no scales); only with fp8_kv_cache",
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
