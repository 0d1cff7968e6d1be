"""Bad input is refused before anything heavy exists: exit status 2, a message that says what to change, no run
folder, no MLflow run, in seconds. Each probe is one a user typed (issue 16), run as the user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.services import free_port

PROBES = [
    (["precision=bf16", "clipping=calibrated"], "needs precision.mode=fp8_full"),
    (["algo.advantage=grpoo"], "algo.advantage='grpoo' is not valid"),
    (["algo.policy_loss=xyz"], "algo.policy_loss='xyz' is not valid"),
    (["algo.kl_type=k9"], "algo.kl_type='k9' is not valid"),
    (["task.name=nope"], "task.name='nope' is not valid"),
    (["algo.num_minibatches=0"], "algo.num_minibatches=0 must be >= 1"),
    (["algo.prompts_per_step=0"], "algo.prompts_per_step=0 must be >= 1"),
    (["model.preset=qwen9"], "model.preset='qwen9' is not valid"),
    (["warmstart.cache_dir=/no/such/folder"], "warmstart.cache_dir=/no/such/folder does not exist"),
    (["precision.amax_reduction=some"], "precision.amax_reduction='some' is not valid"),
    (["algo.prompts_per_step=6", "algo.num_minibatches=4"], "prompts_per_step"),
    (["precision=fp8_full", "recipe=rowwise", "precision.backend=te", "model.device=cuda"], "rowwise"),
]


def run_cli(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fp8rl.train", *overrides, f"trainer.out_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(("overrides", "message"), PROBES)
def test_a_bad_config_exits_2_with_advice_before_building_anything(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    started = time.monotonic()
    proc = run_cli(tmp_path, *overrides)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "mlflow.db").exists()
    assert time.monotonic() - started < 60


def test_a_dead_tracking_server_is_refused_within_seconds_with_advice(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    proc = run_cli(tmp_path, "tracking.connect_timeout_s=3", env={"MLFLOW_TRACKING_URI": dead})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "tracking.offline=true" in proc.stderr  # the way to train anyway
    assert not list((tmp_path / "run").glob("checkpoints/*"))


# ---------------------------------------------------------------------------------------------
# Bad data (issue 28): a math run (scale=mini) over a broken data file is refused the same way, naming the file,
# the row and the option to change. Before, each was a traceback (exit 1) after the MLflow run existed (marked
# FAILED), and an all-empty benchmark was refused only after the model was built.


@pytest.fixture(scope="module")
def mini_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fp8rl.tasks.math import write_mini_assets

    return write_mini_assets(tmp_path_factory.mktemp("mini"), seed=0)["model"].parent


def _lines(rows: list[dict]) -> str:
    import json

    return "".join(json.dumps(row) + "\n" for row in rows)


ROWS = [{"problem": f"What is {n} + {n}?", "answer": str(2 * n)} for n in range(1, 9)]
BAD_DATA = {  # name -> (the option, the file's name and bytes, the message's pattern after the file's path)
    "empty_training_file": ("task.path", "train.jsonl", b"", r" is empty \(0 bytes\).*task.path=\.\.\."),
    "truncated_jsonl": ("task.path", "train.jsonl", _lines(ROWS).encode()[:-20], r", line 8: not a JSON record"),
    "non_utf8_benchmark": (
        "task.eval_paths.math500",
        "test.jsonl",
        _lines(ROWS[:2]).encode() + '{"problem": "\u00bd + \u00bd?", "answer": "1"}\n'.encode("latin-1"),
        r", line 3: byte 0xbd at column 14 is not UTF-8",
    ),
    "all_empty_benchmark": (
        "task.eval_paths.math500",
        "test.jsonl",
        _lines([{**row, "answer": None} for row in ROWS]).encode(),
        r" holds no problems; fix task.eval_paths.math500",
    ),
    "overlong_prompt": (
        "task.path",
        "train.jsonl",
        _lines([*ROWS[:3], {"problem": "Add these: " + " 1 +" * 3000 + " 1", "answer": "3001"}]).encode(),
        r", line 4\).*task.overlong_prompts=filter",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BAD_DATA))
def test_bad_data_exits_2_naming_the_file_and_row_before_the_mlflow_run(tmp_path: Path, mini_folder: Path, name):
    option, file_name, contents, pattern = BAD_DATA[name]
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "mini").symlink_to(mini_folder)  # where scale=mini looks
    path = tmp_path / file_name
    path.write_bytes(contents)
    started = time.monotonic()
    env = {"HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    proc = run_cli(tmp_path, "scale=mini", "task=deepscaler", f"{option}={path}", env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    (refusal,) = [line for line in proc.stderr.splitlines() if line.startswith("config error: ")]
    assert re.search(re.escape(str(path)) + pattern, refusal), refusal
    assert not (tmp_path / "run").exists() and not (tmp_path / "mlflow.db").exists()
    assert time.monotonic() - started < 60
