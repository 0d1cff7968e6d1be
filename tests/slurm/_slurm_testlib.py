"""Helpers shared by the Slurm tests (conftest.py and the test modules import them relatively)."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]
PROFILES_DIR = REPO / "slurm" / "profiles"
UP_SH = REPO / "slurm" / "local" / "up.sh"
DOWN_SH = REPO / "slurm" / "local" / "down.sh"
# Slurm's own start-up is < 10 s; a first run also installs Debian packages (~30 s).
UP_TIMEOUT_S = 300


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def load_profile(profile: str, /, **overrides: Any) -> dict[str, Any]:
    """Profile ``profile`` merged onto hydra-submitit-launcher's ``SlurmQueueConf``, resolved.

    The merge is what Hydra does for ``hydra/launcher=<profile>`` (the profile's defaults list extends
    ``submitit_slurm``); unknown keys or wrong types raise here, as they would in Hydra.
    ``overrides`` replace values, e.g. ``name=`` and ``submitit_folder=``, which otherwise interpolate
    ``${hydra...}`` and only resolve inside a Hydra run.
    """
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf

    raw = OmegaConf.load(PROFILES_DIR / f"{profile}.yaml")
    defaults = raw.pop("defaults", [])
    assert "submitit_slurm" in list(defaults), f"{profile}.yaml must extend submitit_slurm in its defaults list"
    cfg = OmegaConf.merge(OmegaConf.structured(SlurmQueueConf), raw, overrides)
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def executor_from_params(params: dict[str, Any]):
    """Mirror of ``BaseSubmititLauncher.launch`` (hydra_submitit_launcher/submitit_launcher.py 1.2.0)."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    params = {k: v for k, v in params.items() if k != "_target_"}
    init_keys = {"submitit_folder", "max_num_timeout"}
    executor = submitit.AutoExecutor(
        cluster="slurm", folder=params["submitit_folder"], slurm_max_num_timeout=params["max_num_timeout"]
    )
    base = {f.name for f in dataclasses.fields(BaseQueueConf)}
    executor.update_parameters(
        **{(k if k in base else f"slurm_{k}"): v for k, v in params.items() if k not in init_keys}
    )
    return executor


def result_within(job: Any, seconds: float) -> Any:
    """``job.result()``, but fail instead of blocking for more than ``seconds``.

    submitit polls ``sacct``; if it cannot see the job's state, ``result()`` of a job that died or was
    cancelled blocks forever. Exceptions raised by ``result()`` are re-raised here.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = job.result()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name=f"result-{job.job_id}")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"job {job.job_id}: result() still blocking after {seconds:.0f}s (state {job.state})")
    if "error" in box:
        raise box["error"]
    return box["result"]
