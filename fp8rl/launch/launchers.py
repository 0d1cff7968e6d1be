"""Where sweep points run: submitit's local executor, Slurm (a cluster profile from ``slurm/profiles``),
or inline (in this process, for tests and debugging).

A Slurm profile is a ``hydra/launcher`` config extending hydra-submitit-launcher's ``submitit_slurm``
(``SlurmQueueConf``); `make_executor` turns it into a submitit executor exactly the way the plugin's
``BaseSubmititLauncher.launch`` does, so ``fp8rl sweep --launcher slurm --profile X`` and
``python -m fp8rl.train -m hydra/launcher=slurm_X`` submit the same sbatch script.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8rl.config import ConfigError, RunConfig

PROFILES_DIR = Path(__file__).resolve().parents[2] / "slurm" / "profiles"
LAUNCHERS = ("local", "slurm", "inline")
DEFAULT_SLURM_PROFILE = "local"
LOCAL_TIMEOUT_MIN = 24 * 60  # local jobs: no scheduler limit to respect


@dataclass
class Launcher:
    """A resolved launcher: its kind and the submitit parameters it submits with."""

    kind: str  # "local", "slurm" or "inline"
    params: dict[str, Any] = field(default_factory=dict)  # SlurmQueueConf / LocalQueueConf fields
    profile: str | None = None  # Slurm profile name or path
    max_parallel: int = 1  # local: jobs running at once (Slurm: the scheduler decides)

    @property
    def has_gpu(self) -> bool:
        """Whether jobs get a GPU (Slurm: the profile asks for one; local/inline: this machine has one)."""
        if self.kind != "slurm":
            return _local_cuda()
        p = self.params
        extra = {str(k).lower(): str(v).lower() for k, v in (p.get("additional_parameters") or {}).items()}
        return bool(
            p.get("gpus_per_node")
            or p.get("gpus_per_task")
            or "gpu" in str(p.get("gres") or "").lower()
            or any(k.startswith(("gpus", "gres")) and "0" != v for k, v in extra.items())
        )

    @property
    def cpus_per_task(self) -> int | None:
        return self.params.get("cpus_per_task")

    def describe(self) -> str:
        return f"slurm (profile {self.profile})" if self.kind == "slurm" else self.kind


def _local_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def profile_path(profile: str) -> Path:
    """A profile name (``slurm/profiles/<name>.yaml``) or a path to a profile file."""
    path = Path(profile)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    candidate = PROFILES_DIR / f"{profile}.yaml"
    if not candidate.exists():
        names = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown Slurm profile {profile!r}; valid: {names} (or a path to a profile .yaml)")
    return candidate


def load_profile(profile: str, **overrides: Any) -> dict[str, Any]:
    """A cluster profile merged onto ``SlurmQueueConf`` (what ``hydra/launcher=<profile>`` composes), resolved."""
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
    from omegaconf import OmegaConf

    raw = OmegaConf.load(profile_path(profile))
    defaults = list(raw.pop("defaults", []))
    if "submitit_slurm" not in defaults:
        raise ConfigError(f"Slurm profile {profile!r} must extend submitit_slurm in its defaults list")
    merged = OmegaConf.merge(OmegaConf.structured(SlurmQueueConf), raw, overrides)
    params = OmegaConf.to_container(merged, resolve=True)
    params.pop("_target_", None)
    return params  # type: ignore[return-value]


def resolve_launcher(
    kind: str, profile: str | None = None, overrides: dict[str, Any] | None = None, max_parallel: int | None = None
) -> Launcher:
    """``kind`` in LAUNCHERS; ``overrides`` replace profile fields (e.g. ``{"timeout_min": 30}``)."""
    overrides = dict(overrides or {})
    placeholders = {"name": "fp8rl", "submitit_folder": "<per launch>"}
    if kind == "slurm":
        name = profile or DEFAULT_SLURM_PROFILE
        return Launcher("slurm", load_profile(name, **{**placeholders, **overrides}), profile=name)
    if kind == "local":
        from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf

        params = {f.name: getattr(LocalQueueConf(), f.name) for f in dataclasses.fields(LocalQueueConf)}
        params.pop("_target_", None)
        params.update(placeholders, timeout_min=LOCAL_TIMEOUT_MIN, **overrides)
        parallel = max_parallel or max(1, (os.cpu_count() or 2) // 2)
        return Launcher("local", params, max_parallel=parallel)
    if kind == "inline":
        return Launcher("inline", dict(overrides))
    raise ConfigError(f"launcher={kind!r} is not valid; choose one of {list(LAUNCHERS)}")


def make_executor(launcher: Launcher, folder: Path, job_name: str):
    """A submitit executor for `launcher` (mirrors hydra-submitit-launcher 1.2.0's ``launch``)."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    if launcher.kind == "inline":
        raise ValueError("the inline launcher runs jobs in this process; it has no executor")
    params = {**launcher.params, "name": job_name}
    cluster = launcher.kind
    init = {"folder": str(folder / "%j")}
    if "max_num_timeout" in params:
        init[f"{cluster}_max_num_timeout"] = params.pop("max_num_timeout")
    params.pop("submitit_folder", None)
    if cluster == "slurm":
        params.pop("array_parallelism", None)  # the runner submits one job per point (see sweep.py)
    executor = submitit.AutoExecutor(cluster=cluster, **init)
    base = {f.name for f in dataclasses.fields(BaseQueueConf)}
    executor.update_parameters(**{(k if k in base else f"{cluster}_{k}"): v for k, v in params.items()})
    return executor


def gpu_requirements(cfg: RunConfig) -> list[str]:
    """The settings of `cfg` that only run on a CUDA GPU."""
    needs = []
    if cfg.model.device == "cuda":
        needs.append("model.device=cuda")
    if cfg.precision.backend == "te":
        needs.append("precision.backend=te (Transformer Engine)")
    if cfg.rollout.engine == "vllm":
        needs += _vllm_cpu_gaps(cfg)
    return needs


def _vllm_cpu_gaps(cfg: RunConfig) -> list[str]:
    """What of the vLLM rollout's FP8 settings vLLM's CPU build cannot run."""
    from fp8rl.rollout.vllm_engine import VllmSupportError, check_vllm_support

    recipe = None if cfg.precision.mode == "bf16" else cfg.precision.recipe
    try:
        check_vllm_support(recipe, cfg.precision.fp8_kv_cache, "cpu")
    except VllmSupportError as err:
        return [f"rollout.engine=vllm with precision.recipe={recipe} ({err})"]
    return []


def check_fits(cfg: RunConfig, launcher: Launcher) -> None:
    """Refuse a GPU-only config on a launcher without GPUs, saying what to change."""
    needs = gpu_requirements(cfg)
    if needs and not launcher.has_gpu:
        raise ConfigError(
            f"{' and '.join(needs)} need a GPU, but launcher {launcher.describe()} has none: use scale=tiny "
            "(CPU), or --launcher slurm with a GPU profile (e.g. --profile example_h100)"
        )
    if launcher.kind == "slurm" and cfg.model.device == "cuda":
        check_slurm_layout(cfg, launcher)
    elif launcher.kind == "slurm":
        check_cpu_ranks(cfg, launcher)


def check_cpu_ranks(cfg: RunConfig, launcher: Launcher) -> None:
    """A CPU job of several Slurm tasks (``--set tasks_per_node=2``: one gloo rank per task) must fit the run's
    layout and batch sizes."""
    from fp8rl.preflight import run_layout

    world = int(launcher.params.get("nodes") or 1) * int(launcher.params.get("tasks_per_node") or 1)
    if world > 1:
        run_layout(cfg, world_size=world)


def check_slurm_layout(cfg: RunConfig, launcher: Launcher) -> None:
    """The job's nodes x GPUs (profile) must be what the run's parallel layout expects, and the layout must
    fit the model and the GPUs (`fp8rl.preflight.run_layout`)."""
    from fp8rl.preflight import layout_for, run_layout

    layout = layout_for(cfg, world_size=1)  # the preset's nodes x GPUs (a GPU run)
    nodes = int(launcher.params.get("nodes") or 1)
    gpus = int(launcher.params.get("gpus_per_node") or 0)
    tasks = int(launcher.params.get("tasks_per_node") or 1)
    if (nodes, gpus) != (layout.nodes, layout.gpus_per_node) or tasks != gpus:
        raise ConfigError(
            f"{cfg.model.preset}'s layout ({layout.describe()}) needs nodes={layout.nodes}, "
            f"gpus_per_node={layout.gpus_per_node}, tasks_per_node={layout.gpus_per_node} (one rank per GPU), but "
            f"profile {launcher.profile} gives nodes={nodes}, gpus_per_node={gpus}, tasks_per_node={tasks}: pass "
            f"--set nodes={layout.nodes} or set parallel.nodes / parallel.gpus_per_node to match the profile"
        )
    run_layout(cfg, world_size=nodes * gpus)
