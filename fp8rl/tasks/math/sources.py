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

Checked at load. Local files are read here, not by ``datasets`` (pyarrow for parquet, the standard library for
JSON), every row of every file: an empty file, a file without rows, a line that is not JSON (a truncated last line
says so), bytes that are not UTF-8, a file that is not parquet, a record that is not an object, a row missing a
required field or holding the wrong type (a problem that is not a string, an answer that is neither a string nor a
number, a DAPO prompt that is not a list of messages) raise `DatasetError`, a `ConfigError` whose one line names
the file and the row (``<file>, line N`` in JSON lines, ``<file>, row N`` in parquet and JSON arrays) and says what
to change. A null or empty problem or answer is not an error: the row is dropped with a warning naming the first.
"""

from __future__ import annotations

import codecs
import json
import math
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

from fp8rl.config import ConfigError
from fp8rl.tasks.base import Problem

DATA_EXTENSIONS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
HUB_CHECK_TIMEOUT_S = 3.0
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
SPLIT_NAMES = ("train", "test", "validation", "valid", "dev", "eval")


class DatasetError(ConfigError):
    """A data set that cannot be loaded as asked (a `ConfigError`: the command exits 2 with the message, no
    traceback); one line that names the file (and the row) and says what to change."""


@dataclass(frozen=True)
class DataSource:
    """One registered data set: hub id, default split, the columns a row needs and how it becomes a Problem."""

    name: str
    hub_id: str
    default_split: str
    columns: tuple[str, ...]  # required columns
    schema: str  # the published schema, for error messages
    to_problem: Callable[[Mapping[str, Any]], Problem]


class RowError(ValueError):
    """One row that does not fit its data set's schema; the loader adds the file and the row."""


def _a(value: Any) -> str:
    """The type of ``value`` with its article: "an int", "a dict"."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _preview(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _field(row: Mapping[str, Any], name: str) -> Any:
    if name not in row:
        raise RowError(f"has no field {name!r}")
    return row[name]


def _text_field(row: Mapping[str, Any], name: str) -> str:
    """A problem statement: a string (None: none, the row is dropped as incomplete)."""
    value = _field(row, name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RowError(f"field {name!r} is {_a(value)} ({_preview(value)}), not a string")
    return value.strip()


def _answer_field(value: Any, name: str) -> str:
    """A ground truth: a string or a number (None or NaN: none, the row is dropped as incomplete)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise RowError(f"field {name!r} is {_a(value)} ({_preview(value)}), not a string or a number")
    return answer_text(value)


def answer_text(value: Any) -> str:
    """A ground truth as text: strings stripped, integral floats as ints (27.0 -> "27"), None -> ""."""
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def user_message(messages: Any) -> str:
    """Content of the last ``user`` message of a chat-format prompt (list of {role, content})."""
    if messages is None:
        return ""
    well_formed = isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str | None)
        for m in messages
    )
    if not well_formed:
        raise RowError(f"field 'prompt' is {_preview(messages)}, not a list of {{role, content}} messages (strings)")
    contents = [message["content"] or "" for message in messages if message["role"] == "user"]
    return contents[-1] if contents else ""


def _dapo_problem(row: Mapping[str, Any]) -> Problem:
    reward_model = _field(row, "reward_model")
    if reward_model is not None and not isinstance(reward_model, dict):
        raise RowError(f"field 'reward_model' is {_preview(reward_model)}, not a {{ground_truth, style}} record")
    if reward_model is not None and "ground_truth" not in reward_model:
        raise RowError("field 'reward_model' has no 'ground_truth'")
    ground_truth = None if reward_model is None else reward_model["ground_truth"]
    return Problem(
        prompt=user_message(_field(row, "prompt")), answer=_answer_field(ground_truth, "reward_model.ground_truth")
    )


def _column_problem(problem_column: str) -> Callable[[Mapping[str, Any]], Problem]:
    def to_problem(row: Mapping[str, Any]) -> Problem:
        return Problem(prompt=_text_field(row, problem_column), answer=_answer_field(_field(row, "answer"), "answer"))

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
# Local files: which files, and their rows, checked as they are read (file and row named in every refusal)


def _split_of(relative: Path) -> str | None:
    """The split a data file belongs to by its name or folder (``data/train-00000.parquet`` -> "train")."""
    words = set(re.split(r"[-_./\\]", relative.as_posix().lower()))
    return next((split for split in SPLIT_NAMES if split in words), None)


def data_files(folder: Path, split: str, setting: str = "task.path") -> list[Path]:
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
            f"holds them, or a file, via {setting}=..."
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
        f"the split (task.split=...) or point {setting}=... at the file"
    )


def check_columns(source: DataSource, columns: list[str], where: str, setting: str = "task.path") -> None:
    """Raise naming the first required column of ``source`` missing from ``columns``."""
    missing = [column for column in source.columns if column not in columns]
    if missing:
        raise DatasetError(
            f"{where} has no column {missing[0]!r} required by data set {source.name!r} (it has {columns}); "
            f"expected the schema of {source.hub_id}: {source.schema}. Point {setting}=... at a file of that "
            f"data set, or pick the data set that matches the file (task.dataset=...)"
        )


def _not_utf8(path: Path, line: int, column: int, byte: int) -> DatasetError:
    return DatasetError(
        f"{path}, line {line}: byte {byte:#04x} at column {column} is not UTF-8; save the file as UTF-8 "
        "(e.g. `iconv -f latin1 -t utf-8`)"
    )


def _json_array_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(location, record) of a file holding one JSON array (DeepScaleR's deepscaler.json); read whole."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        start = data.rfind(b"\n", 0, err.start) + 1
        raise _not_utf8(path, data.count(b"\n", 0, err.start) + 1, err.start - start + 1, data[err.start]) from None
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        truncated = err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated string")
        hint = " (the file ends inside the array: truncated?)" if truncated else ""
        raise DatasetError(
            f"{path}, line {err.lineno}, column {err.colno}: not valid JSON ({err.msg}){hint}; a .json data file "
            "holds one JSON array of records, or one record per line"
        ) from None
    if not isinstance(records, list):
        raise DatasetError(f"{path}: holds a JSON {type(records).__name__}, not an array of records")
    for index, record in enumerate(records, 1):
        yield f"row {index}", record


def _json_lines_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(location, record) of a JSON-lines file, streamed (blank lines skipped)."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            if number == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _not_utf8(path, number, err.start + 1, raw[err.start]) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                hint = " (the file ends inside it: truncated?)" if not raw.endswith(b"\n") else ""
                raise DatasetError(
                    f"{path}, line {number}: not a JSON record ({err.msg}, column {err.colno}){hint}; a JSON-lines "
                    "file holds one JSON object per line: fix or delete that line"
                ) from None
            yield f"line {number}", record


def _starts_an_array(path: Path) -> bool:
    with path.open("rb") as handle:
        head = handle.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
        while not head:
            chunk = handle.read(1 << 16)
            if not chunk:
                return False
            head = chunk.lstrip()
    return head.startswith(b"[")


def _json_rows(path: Path, source: DataSource, setting: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Records of a JSON file (lines or one array), each a JSON object; the first one's keys are the columns."""
    rows = _json_array_rows(path) if _starts_an_array(path) else _json_lines_rows(path)
    for index, (location, record) in enumerate(rows):
        if not isinstance(record, dict):
            raise DatasetError(
                f"{path}, {location}: a record is a JSON object, found {_a(record)} "
                f"({_preview(record)}): fix or delete it"
            )
        if index == 0:
            check_columns(source, list(record), str(path), setting)
        yield location, record


def _parquet_rows(path: Path, source: DataSource, setting: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The required columns of a parquet file's rows, read in batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise DatasetError(
            f"{path} is not a parquet file, or a truncated one ({err}); write it again (pandas' to_parquet, "
            "pyarrow.parquet.write_table), or name JSON lines .jsonl"
        ) from None
    check_columns(source, list(parquet.schema_arrow.names), str(path), setting)
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=4096, columns=list(source.columns)):
            for record in batch.to_pylist():
                row += 1
                yield f"row {row}", record
    except (pa.ArrowException, OSError) as err:
        raise DatasetError(
            f"{path}: cannot read the rows after row {row} ({err}); the file is damaged: write it again"
        ) from None


def file_rows(path: Path, source: DataSource, setting: str = "task.path") -> Iterator[tuple[str, dict[str, Any]]]:
    """("<file>, line N" / "<file>, row N", record) of one data file; an empty file, a file without rows, one that
    is not UTF-8, not JSON or not parquet, or without the data set's columns is refused naming the file and
    the row."""
    needs = f"a data file of {source.name} holds rows with the columns {list(source.columns)}"
    if path.stat().st_size == 0:
        raise DatasetError(f"{path} is empty (0 bytes); {needs}: fix the file or point {setting}=... at another")
    rows = _parquet_rows if DATA_EXTENSIONS[path.suffix] == "parquet" else _json_rows
    count = 0
    for location, record in rows(path, source, setting):
        count += 1
        yield f"{path}, {location}", record
    if not count:
        raise DatasetError(f"{path} holds no rows; {needs}: fix the file or point {setting}=... at another")


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


def _local_files(source: DataSource, path: str, split: str, setting: str = "task.path") -> list[Path]:
    """The data files behind ``path`` (a file, or a folder and a split)."""
    location = Path(path).expanduser()
    if not location.exists():
        raise DatasetError(
            f"data set {source.name!r}: {location} does not exist; set {setting}=... to an existing "
            f"file or folder ({', '.join(DATA_EXTENSIONS)}), or leave it unset to use {source.hub_id}"
        )
    if location.is_file():
        if location.suffix not in DATA_EXTENSIONS:
            raise DatasetError(
                f"{location}: unsupported file type {location.suffix!r}; use one of {sorted(DATA_EXTENSIONS)}"
            )
        files = [location]
    else:
        files = data_files(location, split, setting)
    if len({DATA_EXTENSIONS[file.suffix] for file in files}) > 1:
        raise DatasetError(f"{location} mixes parquet and JSON files for split {split!r}; keep one format")
    return files


def table_rows(table: Any, columns: list[str], batch_size: int = 4096) -> Iterator[dict[str, Any]]:
    """Rows of a ``datasets.Dataset`` restricted to ``columns``, read in batches (no full copy in Python)."""
    for batch in table.select_columns(columns).iter(batch_size=batch_size):
        for values in zip(*(batch[column] for column in columns), strict=True):
            yield dict(zip(columns, values, strict=True))


def to_problems(
    source: DataSource, rows: Iterable[tuple[str, Mapping[str, Any]]], where: str, deduplicate: bool = True
) -> list[tuple[Problem, str]]:
    """(problem, where its row is) of ``rows`` ((location, row) pairs) in order. A row that does not fit the schema
    (a field missing, of the wrong type) is refused naming it; rows without a problem or an answer (null or empty)
    are dropped with a warning, repeated (prompt, answer) pairs too unless ``deduplicate`` is False (DAPO-Math-17K
    repeats each problem ~100 times), the first row of each kept."""
    kept: dict[Problem, str] | list[tuple[Problem, str]] = {} if deduplicate else []
    incomplete: list[str] = []
    for location, row in rows:
        try:
            problem = source.to_problem(row)
        except RowError as err:
            raise DatasetError(
                f"{location}: {err}; a row of {source.name} follows the schema of {source.hub_id} ({source.schema}): "
                "fix or delete that row"
            ) from None
        if not (problem.prompt and problem.answer):
            incomplete.append(location)
        elif isinstance(kept, dict):
            kept.setdefault(problem, location)
        else:
            kept.append((problem, location))
    if incomplete:
        warnings.warn(
            f"{where}: dropped {len(incomplete)} rows without a problem or an answer (the first: {incomplete[0]})",
            stacklevel=3,
        )
    return list(kept.items()) if isinstance(kept, dict) else kept


def load_problem_rows(
    dataset: str,
    path: str | None = None,
    split: str | None = None,
    *,
    deduplicate: bool = True,
    cache_dir: str | None = None,
    setting: str = "task.path",
) -> list[tuple[Problem, str]]:
    """(problem, "<file>, line N" / "<file>, row N" / "<hub id> split S, row N") of a registered data set: see
    :func:`load_problems`. ``setting``: the option that names ``path`` (``task.path``, ``task.eval_paths.<set>``),
    for the messages."""
    source = get_source(dataset)
    split = split or source.default_split
    if path is not None:
        files = _local_files(source, path, split, setting)
        rows = (located for file in files for located in file_rows(file, source, setting))
        return to_problems(source, rows, str(path), deduplicate)
    check_hub(source)
    import datasets  # heavy import, after the cheap checks

    table = datasets.load_dataset(source.hub_id, split=split, cache_dir=cache_dir)
    where = f"{source.hub_id} split {split!r}"
    check_columns(source, table.column_names, where, setting)
    rows = ((f"{where}, row {index}", row) for index, row in enumerate(table_rows(table, list(source.columns)), 1))
    return to_problems(source, rows, where, deduplicate)


def load_problems(
    dataset: str,
    path: str | None = None,
    split: str | None = None,
    *,
    deduplicate: bool = True,
    cache_dir: str | None = None,
    setting: str = "task.path",
) -> list[Problem]:
    """Problems of a registered data set, from a local file / folder (parquet, jsonl, json) or from the hub.

    ``path``: a data file (any split name is ignored: a file is one split) or a folder such as a downloaded hub
    repository (files are picked by ``split``, default the data set's own), or None for the hub id. ``.prompt`` is
    the problem text (DAPO-Math-17K: its user message, instruction included), ``.answer`` the ground truth text.
    ``cache_dir``: where ``datasets`` keeps its Arrow cache for the hub (default: its own). Local files are read
    here (pyarrow for parquet, the standard library for JSON) and checked row by row: any refusal is a
    `DatasetError` naming the file and the row (line of a JSON-lines file) and what to change. The hub's
    reachability is checked before ``datasets`` is imported.
    """
    rows = load_problem_rows(dataset, path, split, deduplicate=deduplicate, cache_dir=cache_dir, setting=setting)
    return [problem for problem, _ in rows]
