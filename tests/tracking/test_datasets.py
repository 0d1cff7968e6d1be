"""The run's data sets reach MLflow as dataset inputs: name, source, a digest of the problems, context."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow.tracking import MlflowClient

from fp8rl.config import TaskConfig
from fp8rl.tasks.base import Problem
from fp8rl.tracking import MlflowTracker, RunSpec
from fp8rl.tracking.datasets import task_datasets

TRAIN = [Problem("1+2=", "3"), Problem("3+4=", "7")]
HELDOUT = {"heldout": [Problem("5+5=", "10")]}


def test_each_split_is_described_with_its_source_size_and_a_digest_of_its_problems() -> None:
    train, heldout = task_datasets(TaskConfig(), TRAIN, HELDOUT)
    assert (train["name"], train["context"], heldout["name"], heldout["context"]) == (
        "arithmetic-train", "training", "arithmetic-heldout", "evaluation")  # fmt: skip
    assert json.loads(train["profile"])["num_rows"] == 2 and train["source_type"] == "code"
    assert "seed=0" in json.loads(train["source"])["tags"]["generator"]
    changed, _ = task_datasets(TaskConfig(), [Problem("1+2=", "3"), Problem("3+4=", "8")], HELDOUT)
    assert changed["digest"] != train["digest"]  # the digest hashes the rows themselves


def test_a_math_data_set_names_its_hub_id_or_local_file(tmp_path: Path) -> None:
    cfg = TaskConfig(name="math", dataset="dapo_math_17k", eval_sets=("aime24",))
    train, aime = task_datasets(cfg, TRAIN, {"aime24": TRAIN})
    assert train["source_type"] == "hugging_face" and "DAPO-Math-17k" in train["source"]
    assert (aime["name"], json.loads(aime["source"])["path"]) == ("aime24", "HuggingFaceH4/aime_2024")
    local = tmp_path / "train.parquet"
    local.write_bytes(b"")
    (train,) = task_datasets(TaskConfig(name="math", dataset="deepscaler", path=str(local)), TRAIN, {})
    assert train["source_type"] == "local" and train["name"] == "deepscaler-train"


def _inputs(uri: str, run_id: str) -> list[tuple[str, str]]:
    run = MlflowClient(uri).get_run(run_id)
    return sorted(
        (i.dataset.name, {t.key: t.value for t in i.tags}["mlflow.data.context"]) for i in run.inputs.dataset_inputs
    )


def test_a_tracked_run_lists_its_data_sets_once_even_when_logged_again(tmp_path: Path, sqlite_uri: str) -> None:
    spec = RunSpec(tracking_uri=sqlite_uri, experiment="unit", run_name="r", system_metrics=False)
    tracker = MlflowTracker(spec, tmp_path, connect_timeout_s=5, offline_ok=False)
    tracker.log_datasets(lambda: task_datasets(TaskConfig(), TRAIN, HELDOUT))
    tracker.log_datasets(lambda: task_datasets(TaskConfig(), TRAIN, HELDOUT))  # a restart before any checkpoint
    tracker.finish()
    assert _inputs(sqlite_uri, tracker.run_id) == [
        ("arithmetic-heldout", "evaluation"),
        ("arithmetic-train", "training"),
    ]


def test_data_sets_described_offline_reach_mlflow_when_the_run_is_uploaded(tmp_path: Path, sqlite_uri: str) -> None:
    from fp8rl.tracking.sync import sync

    offline = RunSpec(tracking_uri="http://127.0.0.1:9", experiment="unit", run_name="r", system_metrics=False)
    tracker = MlflowTracker(offline, tmp_path, connect_timeout_s=1, offline_ok=True)
    tracker.log_datasets(lambda: task_datasets(TaskConfig(), TRAIN, HELDOUT))
    tracker.log_metrics({"rollout/reward": 0.5}, 1)
    tracker.finish()
    run_id = sync(tmp_path, sqlite_uri)
    assert _inputs(sqlite_uri, run_id) == [("arithmetic-heldout", "evaluation"), ("arithmetic-train", "training")]


def test_every_generated_task_names_its_generator_and_settings() -> None:
    from fp8rl.tasks import task_names
    from fp8rl.tracking.datasets import GENERATOR_SETTINGS

    assert set(task_names()) - {"math"} == set(GENERATOR_SETTINGS)  # a new task says where its problems come from
    train, heldout = task_datasets(TaskConfig(name="chain", num_digits=1), TRAIN, HELDOUT)
    assert (train["name"], heldout["name"]) == ("chain-train", "chain-heldout")
    tags = json.loads(train["source"])["tags"]
    assert tags["mlflow.source.name"] == "fp8rl.tasks.chain" and "junk_tokens=16" in tags["generator"]
