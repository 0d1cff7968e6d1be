"""Loading each registered math data set from files written here in its published schema (parquet and JSON lines,
as a file and as a hub-style folder), and the errors that say what to change."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fp8rl.tasks.base import Problem
from fp8rl.tasks.math import DATASETS, DatasetError, load_problems

# Made-up problems (statement, answer) in the forms the data sets use: integers, LaTeX fractions, negatives.
MADE_UP = [
    ("Nadia has 17 shells and finds 25 more. How many shells does she have?", "42"),
    ("Compute $\\frac{1}{2} + \\frac{1}{4}$.", "\\frac{3}{4}"),
    ("Solve for $x$: $2x + 9 = 3$.", "-3"),
]
DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def dapo_row(index: int, problem: str, answer: str) -> dict[str, Any]:
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_INSTRUCTION.format(problem), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": f"made-up-{index}"},
    }


def numeric(answer: str) -> float:
    """amc23 publishes answers as numbers."""
    return {"42": 42.0, "\\frac{3}{4}": 0.75, "-3": -3.0}[answer]


ROW_BUILDERS = {
    "dapo_math_17k": dapo_row,
    "deepscaler": lambda i, p, a: {"problem": p, "answer": a, "solution": f"Worked out: $\\boxed{{{a}}}$"},
    "aime24": lambda i, p, a: {
        "id": 60 + i,
        "problem": p,
        "solution": "...",
        "answer": a,
        "url": f"https://example.invalid/{i}",
        "year": "2024",
    },
    "aime25": lambda i, p, a: {"problem": p, "answer": a, "id": str(i)},
    "amc23": lambda i, p, a: {"id": i, "question": p, "answer": numeric(a), "url": f"https://example.invalid/{i}"},
    "math500": lambda i, p, a: {
        "problem": p,
        "solution": "...",
        "answer": a,
        "subject": "Algebra",
        "level": 2,
        "unique_id": f"test/algebra/{i}.json",
    },
}


def expected_problems(dataset: str) -> list[Problem]:
    if dataset == "dapo_math_17k":
        return [Problem(DAPO_INSTRUCTION.format(p), a) for p, a in MADE_UP]
    if dataset == "amc23":
        return [Problem(p, a) for p, a in zip([p for p, _ in MADE_UP], ["42", "0.75", "-3"], strict=True)]
    return [Problem(p, a) for p, a in MADE_UP]


def rows_of(dataset: str) -> list[dict[str, Any]]:
    return [ROW_BUILDERS[dataset](i, p, a) for i, (p, a) in enumerate(MADE_UP)]


def write_rows(rows: list[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        path.write_text(json.dumps(rows))
    return path


def test_registry_holds_the_papers_data_sets_with_their_hub_ids():
    assert {name: source.hub_id for name, source in DATASETS.items()} == {
        "dapo_math_17k": "BytedTsinghua-SIA/DAPO-Math-17k",
        "deepscaler": "agentica-org/DeepScaleR-Preview-Dataset",
        "aime24": "HuggingFaceH4/aime_2024",
        "aime25": "math-ai/aime25",
        "amc23": "math-ai/amc23",
        "math500": "HuggingFaceH4/MATH-500",
    }


@pytest.mark.parametrize("layout", ["file", "folder"])
@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
@pytest.mark.parametrize("dataset", sorted(ROW_BUILDERS))
def test_each_schema_loads_from_parquet_and_jsonl_files_and_folders(dataset, suffix, layout, tmp_path):
    split = DATASETS[dataset].default_split
    data_file = write_rows(rows_of(dataset), tmp_path / "repo" / "data" / f"{split}-00000-of-00001{suffix}")
    path = data_file if layout == "file" else tmp_path / "repo"
    assert load_problems(dataset, str(path)) == expected_problems(dataset)


def test_deepscaler_json_array_file_as_published(tmp_path):
    write_rows(rows_of("deepscaler"), tmp_path / "deepscaler.json")
    assert load_problems("deepscaler", str(tmp_path)) == expected_problems("deepscaler")


def test_a_folder_picks_the_split_by_file_name(tmp_path):
    write_rows(rows_of("math500")[:1], tmp_path / "train.jsonl")
    write_rows(rows_of("math500")[1:], tmp_path / "test.jsonl")
    assert load_problems("math500", str(tmp_path)) == expected_problems("math500")[1:]  # default split: test
    assert load_problems("math500", str(tmp_path), split="train") == expected_problems("math500")[:1]


def test_repeated_rows_are_deduplicated_and_rows_without_an_answer_dropped(tmp_path):
    rows = rows_of("dapo_math_17k") * 3  # DAPO-Math-17K repeats each problem about 100 times
    assert load_problems("dapo_math_17k", str(write_rows(rows, tmp_path / "a.parquet"))) == expected_problems(
        "dapo_math_17k"
    )
    kept = load_problems("dapo_math_17k", str(tmp_path / "a.parquet"), deduplicate=False)
    assert len(kept) == 9
    rows = [*rows_of("deepscaler"), {"problem": "A problem someone forgot to answer.", "answer": None, "solution": ""}]
    with pytest.warns(UserWarning, match="dropped 1 rows"):
        assert load_problems("deepscaler", str(write_rows(rows, tmp_path / "b.jsonl"))) == expected_problems(
            "deepscaler"
        )


# ---------------------------------------------------------------------------------------------
# Errors: each says what to change


def test_unknown_data_set_lists_the_valid_ones():
    with pytest.raises(DatasetError, match="unknown math data set 'gsm8k'") as error:
        load_problems("gsm8k", "/nonexistent")
    assert all(name in str(error.value) for name in DATASETS)


def test_missing_path_names_it_and_the_setting(tmp_path):
    with pytest.raises(DatasetError, match="does not exist; set task.path=") as error:
        load_problems("aime24", str(tmp_path / "nowhere.parquet"))
    assert "nowhere.parquet" in str(error.value)


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".json"])
def test_missing_column_names_it_and_the_expected_schema(suffix, tmp_path):
    rows = [{"question": p, "answer": a} for p, a in MADE_UP]  # amc23's column name, not aime25's
    path = write_rows(rows, tmp_path / f"test{suffix}")
    with pytest.raises(DatasetError, match="no column 'problem' required by data set 'aime25'") as error:
        load_problems("aime25", str(path))
    assert "math-ai/aime25" in str(error.value) and "problem: string, answer: string" in str(error.value)


def test_dapo_file_without_reward_model_is_refused(tmp_path):
    rows = [{k: v for k, v in row.items() if k != "reward_model"} for row in rows_of("dapo_math_17k")]
    with pytest.raises(DatasetError, match="no column 'reward_model'.*reward_model: struct<ground_truth"):
        load_problems("dapo_math_17k", str(write_rows(rows, tmp_path / "d.parquet")))


def test_folder_without_the_split_lists_the_splits_it_has(tmp_path):
    write_rows(rows_of("aime25"), tmp_path / "test.jsonl")
    with pytest.raises(DatasetError, match=r"no files of split 'train'.*found splits: \['test'\].*task.split="):
        load_problems("aime25", str(tmp_path), split="train")


def test_folder_without_data_files_and_unsupported_file_type(tmp_path):
    (tmp_path / "README.md").write_text("no data here")
    with pytest.raises(DatasetError, match="no data files"):
        load_problems("math500", str(tmp_path))
    with pytest.raises(DatasetError, match="unsupported file type '.md'"):
        load_problems("math500", str(tmp_path / "README.md"))


def test_hub_in_offline_mode_fails_at_once_and_says_to_pass_a_local_path():
    start = time.monotonic()
    with pytest.raises(DatasetError, match="HF_HUB_OFFLINE.*task.path=") as error:
        load_problems("aime24")
    assert time.monotonic() - start < 1.0
    assert "huggingface-cli download --repo-type dataset HuggingFaceH4/aime_2024" in str(error.value)


def test_unreachable_hub_fails_within_seconds(monkeypatch):
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens, refused at once
    start = time.monotonic()
    with pytest.raises(DatasetError, match="not reachable.*task.path="):
        load_problems("math500")
    assert time.monotonic() - start < 5.0


# ---------------------------------------------------------------------------------------------
# Malformed files (issue 28): refused at load as a ConfigError (the command exits 2, no traceback) whose one line
# names the file, the row (the line of a JSON-lines file) and what to change. Before, each was a traceback of
# datasets / pyarrow / the row conversion without the row, or was loaded silently.


def _bytes(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def _parquet_bytes(rows: list[dict[str, Any]], tmp_path: Path) -> bytes:
    return write_rows(rows, tmp_path / "scratch" / "rows.parquet").read_bytes()


def _with(rows: list[dict[str, Any]], index: int, **changes: Any) -> list[dict[str, Any]]:
    rows = [dict(row) for row in rows]
    rows[index].update(changes)
    return rows


def _without(rows: list[dict[str, Any]], index: int, field: str) -> list[dict[str, Any]]:
    rows = [dict(row) for row in rows]
    del rows[index][field]
    return rows


DEEPSCALER = rows_of("deepscaler")
MALFORMED = {  # name -> (data set, file name, contents, the message's pattern after the file's path)
    "empty_file": ("deepscaler", "train.jsonl", lambda t: b"", r" is empty \(0 bytes\); .*\['problem', 'answer'\]"),
    "blank_lines_only": ("aime25", "test.jsonl", lambda t: b"\n  \n\n", r" holds no rows; .*task.path=\.\.\."),
    "truncated_jsonl_line": (
        "deepscaler",
        "train.jsonl",
        lambda t: _bytes(DEEPSCALER)[:-25],
        r", line 3: not a JSON record \(Unterminated string .*\) \(the file ends inside it: truncated\?\)",
    ),
    "broken_jsonl_line_in_the_middle": (
        "deepscaler",
        "train.jsonl",
        lambda t: _bytes(DEEPSCALER[:1]) + b'{"problem": "x", "answer": 1,,}\n' + _bytes(DEEPSCALER[1:]),
        r", line 2: not a JSON record \(Expecting property name .*\); .*fix or delete that line",
    ),
    "non_utf8_bytes": (
        "deepscaler",
        "train.jsonl",
        lambda t: _bytes(DEEPSCALER[:2]) + '{"problem": "Caf\u00e9 prices?", "answer": "3"}\n'.encode("latin-1"),
        r", line 3: byte 0xe9 at column 17 is not UTF-8; save the file as UTF-8",
    ),
    "non_utf8_bytes_in_a_json_array": (
        "deepscaler",
        "deepscaler.json",
        lambda t: json.dumps(DEEPSCALER, indent=1).encode().replace(b"Nadia", "N\u00e4dia".encode("latin-1")),
        r", line 3: byte 0xe4 at column \d+ is not UTF-8",
    ),
    "truncated_json_array": (
        "deepscaler",
        "deepscaler.json",
        lambda t: json.dumps(DEEPSCALER).encode()[:-30],
        r", line 1, column \d+: not valid JSON \(.*\) \(the file ends inside the array: truncated\?\)",
    ),
    "a_record_that_is_not_an_object": (
        "math500",
        "test.jsonl",
        lambda t: _bytes(rows_of("math500")) + b"[1, 2]\n",
        r", line 4: a record is a JSON object, found a list \(\[1, 2\]\)",
    ),
    "row_missing_the_answer": (
        "deepscaler",
        "train.jsonl",
        lambda t: _bytes(_without(DEEPSCALER, 1, "answer")),
        r", line 2: has no field 'answer'; a row of deepscaler follows the schema of agentica-org/DeepScaleR.*fix or",
    ),
    "row_missing_the_problem": (
        "aime25",
        "test.jsonl",
        lambda t: _bytes(_without(rows_of("aime25"), 2, "problem")),
        r", line 3: has no field 'problem'; .*math-ai/aime25 \(problem: string, answer: string",
    ),
    "problem_of_the_wrong_type": (
        "deepscaler",
        "train.jsonl",
        lambda t: _bytes(_with(DEEPSCALER, 1, problem={"text": "x"})),
        r", line 2: field 'problem' is a dict \(\{'text': 'x'\}\), not a string",
    ),
    "answer_of_the_wrong_type": (
        "math500",
        "test.jsonl",
        lambda t: _bytes(_with(rows_of("math500"), 0, answer=["4", "5"])),
        r", line 1: field 'answer' is a list \(\['4', '5'\]\), not a string or a number",
    ),
    "boolean_answer": (
        "deepscaler",
        "deepscaler.json",
        lambda t: json.dumps(_with(DEEPSCALER, 2, answer=True)).encode(),
        r", row 3: field 'answer' is a bool \(True\), not a string or a number",
    ),
    "dapo_prompt_that_is_a_string": (
        "dapo_math_17k",
        "train.parquet",
        lambda t: _parquet_bytes([{**row, "prompt": "just text"} for row in rows_of("dapo_math_17k")], t),
        r", row 1: field 'prompt' is 'just text', not a list of \{role, content\} messages",
    ),
    "dapo_reward_model_without_ground_truth": (
        "dapo_math_17k",
        "train.jsonl",
        lambda t: _bytes(_with(rows_of("dapo_math_17k"), 1, reward_model={"style": "rule"})),
        r", line 2: field 'reward_model' has no 'ground_truth'",
    ),
    "parquet_of_the_wrong_type": (
        "aime24",
        "train.parquet",
        lambda t: _parquet_bytes([{"problem": 7, "answer": "1"}], t),
        r", row 1: field 'problem' is an int \(7\), not a string",
    ),
    "a_csv_named_parquet": (
        "aime24",
        "train.parquet",
        lambda t: b"problem,answer\n1+1,2\n",
        r" is not a parquet file, or a truncated one \(.*magic bytes.*\); write it again",
    ),
    "truncated_parquet": (
        "aime24",
        "train.parquet",
        lambda t: (lambda b: b[: len(b) // 2])(_parquet_bytes(rows_of("aime24"), t)),
        r" is not a parquet file, or a truncated one",
    ),
    "empty_parquet": ("amc23", "test.parquet", lambda t: b"", r" is empty \(0 bytes\)"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_file_is_refused_naming_the_file_and_the_row(name: str, tmp_path: Path) -> None:
    from fp8rl.config import ConfigError

    dataset, file_name, contents, pattern = MALFORMED[name]
    path = tmp_path / file_name
    path.write_bytes(contents(tmp_path))
    with pytest.raises(ConfigError) as error:
        load_problems(dataset, str(path))
    message = str(error.value)
    assert isinstance(error.value, DatasetError) and "\n" not in message
    assert re.match(re.escape(str(path)) + pattern, message), message


def test_a_benchmarks_refusal_names_its_own_option(tmp_path: Path) -> None:
    path = tmp_path / "test.jsonl"
    path.write_bytes(b"")
    with pytest.raises(DatasetError, match=r"empty \(0 bytes\).*point task.eval_paths.math500=\.\.\. at another"):
        load_problems("math500", str(path), setting="task.eval_paths.math500")


def test_the_dropped_rows_warning_names_the_first(tmp_path: Path) -> None:
    rows = _with(DEEPSCALER, 1, answer=None)
    with pytest.warns(UserWarning, match=r"dropped 1 rows without a problem or an answer \(the first: .*, line 2\)"):
        assert len(load_problems("deepscaler", str(write_rows(rows, tmp_path / "train.jsonl")))) == 2


def test_json_lines_with_blank_lines_a_bom_and_numbers_load(tmp_path: Path) -> None:
    """What datasets' JSON reader accepted still loads: blank lines, a UTF-8 byte-order mark, numeric answers,
    JSON lines named .json, NaN answers dropped as missing."""
    path = tmp_path / "test.json"
    rows = [{"question": p, "answer": numeric(a)} for p, a in MADE_UP]
    nan_answer = b'{"question": "q", "answer": NaN}'
    path.write_bytes(b"\xef\xbb\xbf" + _bytes(rows[:1]) + b"\n\n" + _bytes(rows[1:]) + nan_answer)
    with pytest.warns(UserWarning, match="dropped 1 rows"):
        assert load_problems("amc23", str(path)) == expected_problems("amc23")
