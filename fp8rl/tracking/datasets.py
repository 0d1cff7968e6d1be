"""The run's data sets as MLflow dataset inputs (``log_inputs``): name, source, digest, schema and size.

Each split the run uses (the training problems, each evaluation set) becomes a pandas data set of its
(prompt, answer) rows, so MLflow's digest is a hash of exactly the problems the run saw. Rows are not
uploaded; MLflow stores the name, source, digest, schema and profile (row count), and the run page lists
them under "Datasets" with their context (``training`` / ``evaluation``).

Sources: the generated tasks (arithmetic, chain) are code sources naming the generator and its settings;
a math data set is a Hugging Face hub id, or the local file or folder ``task.path`` /
``task.eval_paths`` points at.
"""

from __future__ import annotations

from typing import Any

from fp8rl.config import TaskConfig
from fp8rl.tasks.base import Problem

GENERATOR_SETTINGS = {  # generated task -> the TaskConfig fields that fix its problems
    "arithmetic": ("operations", "num_digits", "seed"),
    "chain": ("num_digits", "min_operands", "max_operands", "junk_tokens", "seed"),
}


def _source(cfg: TaskConfig, name: str, path: str | None) -> Any:
    """Where the split `name` comes from, as an MLflow dataset source."""
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

    if cfg.name in GENERATOR_SETTINGS:
        generator = " ".join(f"{field}={getattr(cfg, field)}" for field in GENERATOR_SETTINGS[cfg.name])
        return CodeDatasetSource(tags={"mlflow.source.name": f"fp8rl.tasks.{cfg.name}", "generator": generator})
    if path is not None:
        return resolve_dataset_source(path)
    from fp8rl.tasks.math.sources import get_source

    source = get_source(name)
    return HuggingFaceDatasetSource(path=source.hub_id, split=cfg.split if name == cfg.dataset else None)


def problems_dataset(problems: list[Problem], name: str, source: Any) -> Any:
    """An MLflow pandas data set of (prompt, answer) rows; its digest hashes the rows."""
    import mlflow.data
    import pandas as pd

    frame = pd.DataFrame({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
    return mlflow.data.from_pandas(frame, source=source, name=name, targets="answer")


def task_datasets(cfg: TaskConfig, train: list[Problem], eval_sets: dict[str, list[Problem]]) -> list[dict[str, str]]:
    """One record per split (MLflow's dataset fields as text, plus ``context``), ready for `Tracker.log_datasets`."""
    train_name = cfg.dataset or cfg.name
    splits = [(f"{train_name}-train", train_name, cfg.path, train, "training")]
    for name, problems in eval_sets.items():
        label = f"{cfg.name}-{name}" if cfg.name in GENERATOR_SETTINGS else name
        splits.append((label, name, cfg.eval_paths.get(name), problems, "evaluation"))
    records = []
    for label, name, path, problems, context in splits:
        dataset = problems_dataset(problems, label, _source(cfg, name, path))
        records.append({**dataset.to_dict(), "context": context})
    return records
