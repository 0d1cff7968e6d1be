"""The math data sets of the paper's workload: where they live, their published schemas, and loading them.

Schemas, as published on the Hugging Face hub (checked through dataset cards, the files' listings and public
code that reads them; no data was downloaded, and no row is copied here). Per data set: hub id, default split,
the file(s) on the hub, the columns a Problem is made of (and the others):

- dapo_math_17k: BytedTsinghua-SIA/DAPO-Math-17k, train, data/dapo-math-17k.parquet; prompt (list of {content,
  role}: the user message, instruction included) and reward_model ({ground_truth, style}); also data_source,
  ability, extra_info ({index}).
- deepscaler: agentica-org/DeepScaleR-Preview-Dataset, train, deepscaler.json (one JSON array); problem and
  answer (strings; a few rows have no answer); also solution.
- aime24: HuggingFaceH4/aime_2024, train, data/train-*.parquet; problem and answer (string); also id (int64),
  solution, url, year (string).
- aime25: math-ai/aime25, test, test.jsonl; problem and answer; also id.
- amc23: math-ai/amc23, test, test-00000-of-00001.parquet; question and answer (a number); also id, url.
- math500: HuggingFaceH4/MATH-500, test, test.jsonl; problem and answer (LaTeX string); also solution, subject,
  level (int64), unique_id.

How each was checked: DAPO-Math-17k's ``dataset_info`` (data_source: string, prompt: list of {content, role},
ability: string, reward_model: {ground_truth: string, style: string}, extra_info: {index: string}) from the
cards of copies of it (LuyiCui/DAPO-Math-17k, koajoel/DAPO-Math-17k-dedup), the file path from AISBench's
deployment guide, and the prompt text (an instruction ending "... The last line of your response should be of
the form Answer: $Answer ...", then the problem, then "Remember to put your answer on its own line after
\"Answer:\".") from public code that strips it. The original repository is listed at 1M-10M rows for about
17k distinct problems (a split copy of it has 1,791,400 + 300 rows): rows repeat, hence the de-duplication
below. DeepScaleR: the repository's file listing (one deepscaler.json), public code that reads it with
``json.load``, and copies' cards (problem, answer, solution: string; 40,315 rows). aime24 and math500: the
dataset cards' ``dataset_info``. aime25 and amc23: several independent public loaders
(``load_dataset("math-ai/aime25", split="test")`` reading ``problem``/``answer``/``id``;
``load_dataset("math-ai/amc23", split="test")`` reading ``question``/``answer``/``id``/``url``), which all
convert ``answer`` with ``str()``; amc23's answer dtype was not visible (a derived copy has float64), so
numeric answers are accepted and integral floats written as ints.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from fp8rl.tasks.base import Problem

DATA_EXTENSIONS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
HUB_CHECK_TIMEOUT_S = 3.0
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
SPLIT_NAMES = ("train", "test", "validation", "valid", "dev", "eval")


class DatasetError(ValueError):
    """A data set that cannot be loaded as asked; the message says what to change."""


@dataclass(frozen=True)
class DataSource:
    """One registered data set: hub id, default split, the columns a row needs and how it becomes a Problem."""

    name: str
    hub_id: str
    default_split: str
    columns: tuple[str, ...]  # required columns
    schema: str  # the published schema, for error messages
    to_problem: Callable[[Mapping[str, Any]], Problem]


def answer_text(value: Any) -> str:
    """A ground truth as text: strings stripped, integral floats as ints (27.0 -> "27"), None -> ""."""
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def user_message(messages: Any) -> str:
    """Content of the last ``user`` message of a chat-format prompt (list of {role, content})."""
    contents = [message["content"] for message in messages or [] if message.get("role") == "user"]
    return contents[-1] if contents else ""


def _dapo_problem(row: Mapping[str, Any]) -> Problem:
    ground_truth = (row["reward_model"] or {}).get("ground_truth")
    return Problem(prompt=user_message(row["prompt"]), answer=answer_text(ground_truth))


def _column_problem(problem_column: str) -> Callable[[Mapping[str, Any]], Problem]:
    def to_problem(row: Mapping[str, Any]) -> Problem:
        return Problem(prompt=str(row[problem_column] or "").strip(), answer=answer_text(row["answer"]))

    return to_problem


_DAPO_SCHEMA = (
    "data_source: string, prompt: list<struct<content: string, role: string>>, ability: string, "
    "reward_model: struct<ground_truth: string, style: string>, extra_info: struct<index: string>"
)
DATASETS: dict[str, DataSource] = {
    source.name: source
    for source in (
        DataSource(
            "dapo_math_17k",
            "BytedTsinghua-SIA/DAPO-Math-17k",
            "train",
            ("prompt", "reward_model"),
            _DAPO_SCHEMA,
            _dapo_problem,
        ),
        DataSource(
            "deepscaler",
            "agentica-org/DeepScaleR-Preview-Dataset",
            "train",
            ("problem", "answer"),
            "problem: string, answer: string, solution: string",
            _column_problem("problem"),
        ),
        DataSource(
            "aime24",
            "HuggingFaceH4/aime_2024",
            "train",
            ("problem", "answer"),
            "id: int64, problem: string, solution: string, answer: string, url: string, year: string",
            _column_problem("problem"),
        ),
        DataSource(
            "aime25",
            "math-ai/aime25",
            "test",
            ("problem", "answer"),
            "problem: string, answer: string, id: string",
            _column_problem("problem"),
        ),
        DataSource(
            "amc23",
            "math-ai/amc23",
            "test",
            ("question", "answer"),
            "id: int64, question: string, answer: float64, url: string",
            _column_problem("question"),
        ),
        DataSource(
            "math500",
            "HuggingFaceH4/MATH-500",
            "test",
            ("problem", "answer"),
            "problem: string, solution: string, answer: string, subject: string, level: int64, unique_id: string",
            _column_problem("problem"),
        ),
    )
}


def get_source(dataset: str) -> DataSource:
    """The registered data set ``dataset``; an unknown name raises and lists the valid ones."""
    if dataset not in DATASETS:
        raise DatasetError(f"unknown math data set {dataset!r}; valid: {sorted(DATASETS)}")
    return DATASETS[dataset]


# ---------------------------------------------------------------------------------------------
# Local files: which files, and their columns (read cheaply: parquet footers, first JSON records)


def _split_of(relative: Path) -> str | None:
    """The split a data file belongs to by its name or folder (``data/train-00000.parquet`` -> "train")."""
    words = set(re.split(r"[-_./\\]", relative.as_posix().lower()))
    return next((split for split in SPLIT_NAMES if split in words), None)


def data_files(folder: Path, split: str) -> list[Path]:
    """Data files of ``split`` under ``folder`` (hidden folders skipped); files named after no split count as the
    only split, as the hub does (``deepscaler.json``)."""
    files = sorted(
        path
        for path in folder.rglob("*")
        if path.suffix in DATA_EXTENSIONS
        and path.is_file()
        and not any(part.startswith(".") for part in path.relative_to(folder).parts)
    )
    if not files:
        raise DatasetError(
            f"no data files ({', '.join(DATA_EXTENSIONS)}) under {folder}; pass the folder that "
            "holds them, or a file, via task.path=..."
        )
    by_split: dict[str | None, list[Path]] = {}
    for path in files:
        by_split.setdefault(_split_of(path.relative_to(folder)), []).append(path)
    if split in by_split:
        return by_split[split]
    if list(by_split) == [None]:
        return files
    found = sorted(name for name in by_split if name is not None)
    raise DatasetError(
        f"no files of split {split!r} under {folder} (found splits: {found}); pass one of them as "
        "the split (task.split=...) or point task.path=... at the file"
    )


def _first_json_record(path: Path) -> dict[str, Any]:
    """The first record of a JSON-lines file or of a JSON array, without reading the whole file."""
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8") as handle:
        text = ""
        while True:
            chunk = handle.read(1 << 20)
            text += chunk
            body = text.lstrip().removeprefix("[").lstrip()
            try:
                record, _ = decoder.raw_decode(body)
                break
            except json.JSONDecodeError as error:
                if not chunk:
                    raise DatasetError(f"{path} is not JSON lines or a JSON array of objects: {error}") from None
    if not isinstance(record, dict):
        raise DatasetError(f"{path}: records must be JSON objects, found {type(record).__name__}")
    return record


def file_columns(path: Path) -> list[str]:
    """Column names of a parquet or JSON(-lines) data file."""
    if DATA_EXTENSIONS[path.suffix] == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    return list(_first_json_record(path))


def check_columns(source: DataSource, columns: list[str], where: str) -> None:
    """Raise naming the first required column of ``source`` missing from ``columns``."""
    missing = [column for column in source.columns if column not in columns]
    if missing:
        raise DatasetError(
            f"{where} has no column {missing[0]!r} required by data set {source.name!r} (it has {columns}); "
            f"expected the schema of {source.hub_id}: {source.schema}. Point task.path=... at a file of that "
            f"data set, or pick the data set that matches the file (task.dataset=...)"
        )


# ---------------------------------------------------------------------------------------------
# The hub


def _hub_offline() -> bool:
    return any(
        os.environ.get(var, "").lower() in ("1", "true", "yes", "on")
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _reachable(url: str, timeout_s: float) -> bool:
    """Whether a TCP connection to ``url``'s host opens within ``timeout_s`` (DNS included, which a socket timeout
    alone would not bound, hence the thread)."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    outcome: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((parsed.hostname or "", port), timeout=timeout_s).close()
            outcome.append(True)
        except OSError:
            outcome.append(False)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(outcome and outcome[0])


def _no_hub_error(source: DataSource, reason: str) -> DatasetError:
    return DatasetError(
        f"cannot load data set {source.name!r} from the hub ({source.hub_id}): {reason}. Pass a local copy via "
        f"task.path=<file or folder> (e.g. made where there is internet with `huggingface-cli download "
        f"--repo-type dataset {source.hub_id} --local-dir DIR`)"
    )


def check_hub(source: DataSource) -> None:
    """Raise quickly if the hub cannot be reached (offline mode set, or no connection within a few seconds)."""
    if _hub_offline():
        raise _no_hub_error(source, "hub access is disabled (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set)")
    endpoint = os.environ.get("HF_ENDPOINT", DEFAULT_HUB_ENDPOINT)
    if not _reachable(endpoint, HUB_CHECK_TIMEOUT_S):
        raise _no_hub_error(source, f"{endpoint} is not reachable within {HUB_CHECK_TIMEOUT_S:.0f} s (no network?)")


# ---------------------------------------------------------------------------------------------
# Loading


def _local_files(source: DataSource, path: str, split: str) -> list[Path]:
    """The data files behind ``path`` (a file, or a folder and a split), their columns checked."""
    location = Path(path).expanduser()
    if not location.exists():
        raise DatasetError(
            f"data set {source.name!r}: {location} does not exist; set task.path=... to an existing "
            f"file or folder ({', '.join(DATA_EXTENSIONS)}), or leave it unset to use {source.hub_id}"
        )
    if location.is_file():
        if location.suffix not in DATA_EXTENSIONS:
            raise DatasetError(
                f"{location}: unsupported file type {location.suffix!r}; use one of {sorted(DATA_EXTENSIONS)}"
            )
        files = [location]
    else:
        files = data_files(location, split)
    for file in files:
        check_columns(source, file_columns(file), str(file))
    if len({DATA_EXTENSIONS[file.suffix] for file in files}) > 1:
        raise DatasetError(f"{location} mixes parquet and JSON files for split {split!r}; keep one format")
    return files


def table_rows(table: Any, columns: list[str], batch_size: int = 4096) -> Iterator[dict[str, Any]]:
    """Rows of a ``datasets.Dataset`` restricted to ``columns``, read in batches (no full copy in Python)."""
    for batch in table.select_columns(columns).iter(batch_size=batch_size):
        for values in zip(*(batch[column] for column in columns), strict=True):
            yield dict(zip(columns, values, strict=True))


def to_problems(
    source: DataSource, rows: Iterable[Mapping[str, Any]], where: str, deduplicate: bool = True
) -> list[Problem]:
    """Problems of ``rows`` in order; rows without a problem or an answer are dropped (with a warning), repeated
    (prompt, answer) pairs too unless ``deduplicate`` is False (DAPO-Math-17K repeats each problem ~100 times)."""
    kept: dict[Problem, None] | list[Problem] = {} if deduplicate else []
    incomplete = 0
    for row in rows:
        problem = source.to_problem(row)
        if not (problem.prompt and problem.answer):
            incomplete += 1
        elif isinstance(kept, dict):
            kept.setdefault(problem)
        else:
            kept.append(problem)
    if incomplete:
        warnings.warn(f"{where}: dropped {incomplete} rows without a problem or an answer", stacklevel=3)
    return list(kept)


def load_problems(
    dataset: str,
    path: str | None = None,
    split: str | None = None,
    *,
    deduplicate: bool = True,
    cache_dir: str | None = None,
) -> list[Problem]:
    """Problems of a registered data set, from a local file / folder (parquet, jsonl, json) or from the hub.

    ``path``: a data file (any split name is ignored: a file is one split) or a folder such as a downloaded hub
    repository (files are picked by ``split``, default the data set's own), or None for the hub id. ``.prompt`` is
    the problem text (DAPO-Math-17K: its user message, instruction included), ``.answer`` the ground truth text.
    ``cache_dir``: where ``datasets`` keeps its Arrow cache (default: its own). Everything that can be checked
    without reading the data (name, path, split, columns, hub reachability) is checked first.
    """
    source = get_source(dataset)
    split = split or source.default_split
    if path is None:
        check_hub(source)
        where, builder, files = source.hub_id, source.hub_id, None
    else:
        files = _local_files(source, path, split)
        where, builder = str(path), DATA_EXTENSIONS[files[0].suffix]
    import datasets  # heavy import, after the cheap checks

    if files is None:
        table = datasets.load_dataset(builder, split=split, cache_dir=cache_dir)
        check_columns(source, table.column_names, f"{source.hub_id} split {split!r}")
    else:
        try:
            table = datasets.load_dataset(
                builder, data_files=[str(file) for file in files], split="train", cache_dir=cache_dir
            )
        except datasets.exceptions.DatasetGenerationError as err:  # e.g. pyarrow on a file without rows
            cause = err.__cause__ or err
            raise ValueError(
                f"{dataset}: cannot read {where} ({type(cause).__name__}: {cause}); a data file needs rows in the "
                f"data set's schema (columns {list(source.columns)})"
            ) from err
    return to_problems(source, table_rows(table, list(source.columns)), where, deduplicate)
