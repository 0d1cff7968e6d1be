"""Fixtures for the Slurm tests (helpers live in _slurm_testlib.py).

* ``slurm_profile(profile, **overrides)`` turns a cluster profile from ``slurm/profiles/`` into the
  resolved ``hydra/launcher`` config it stands for (``SlurmQueueConf`` from hydra-submitit-launcher).
* ``make_executor(folder, profile="local", **overrides)`` builds a ``submitit.AutoExecutor`` from a
  profile exactly the way hydra-submitit-launcher's ``SlurmLauncher.launch`` does.
* ``slurm_cluster`` (session) starts the local one-node cluster with ``slurm/local/up.sh``.

Integration tests only run when a marker expression is given (``-m integration`` or
``-m "integration or not integration"``), so that a plain ``pytest tests`` never installs or starts
daemons. They need root (up.sh installs Debian packages) or an already running cluster.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ._slurm_testlib import UP_SH, UP_TIMEOUT_S, executor_from_params, load_profile


@pytest.fixture(scope="session")
def slurm_profile() -> Callable[..., dict[str, Any]]:
    return load_profile


@pytest.fixture
def make_executor() -> Callable[..., Any]:
    def make(folder: Path, profile: str = "local", **overrides: Any):
        overrides.setdefault("name", "fp8rl-test")
        params = load_profile(profile, submitit_folder=str(Path(folder) / "%j"), **overrides)
        return executor_from_params(params)

    return make


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest) -> dict[str, str]:
    """Start (or check) the local one-node cluster once per session; returns its facts."""
    if not request.config.getoption("markexpr"):
        pytest.skip(
            "Slurm integration test: select it with -m integration (starts a local cluster with slurm/local/up.sh)"
        )
    if os.geteuid() == 0:
        t0 = time.monotonic()
        proc = subprocess.run(
            ["bash", str(UP_SH)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=UP_TIMEOUT_S
        )
        if proc.returncode != 0:
            pytest.fail(f"slurm/local/up.sh failed (rc={proc.returncode}):\n{proc.stdout}", pytrace=False)
        print(f"\n[slurm] up.sh: {time.monotonic() - t0:.1f}s\n{proc.stdout.strip()}")
    elif shutil.which("sinfo") is None or subprocess.run(["sinfo"], capture_output=True).returncode != 0:
        pytest.skip("no running Slurm cluster and not root: run `sudo bash slurm/local/up.sh` first")
    partition = load_profile("local", name="-", submitit_folder="-")["partition"]
    return {"partition": partition, "node": subprocess.check_output(["hostname", "-s"], text=True).strip()}
