"""MathTask over the mini assets' Hugging Face tokenizer: problem sets, prompts (chat template and raw), EOS ids,
garble reasons and rewards; its config's checks."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from fp8rl.config import ConfigError, TaskConfig
from fp8rl.tasks.base import Problem, build_task, check_task_config
from fp8rl.tasks.math import MathTask
from fp8rl.tasks.math.task import VERL_INSTRUCTION

EVAL_SETS = ("aime24", "aime25", "amc23", "math500")


def config(assets, **overrides) -> TaskConfig:
    """The run's task section for the mini assets' data files (the tokenizer comes from model.hf_path)."""
    eval_sets = overrides.pop("eval_sets", EVAL_SETS)
    settings = {
        "name": "math",
        "dataset": "dapo_math_17k",
        "path": str(assets["dapo_math_17k"]),
        "eval_sets": tuple(eval_sets),
        "eval_paths": {name: str(assets[name]) for name in eval_sets},
        "max_response_tokens": 48,
        **overrides,
    }
    return TaskConfig(**settings)


def math_task(assets, tokenizer: str | None = None, **overrides) -> MathTask:
    return MathTask(config(assets, **overrides), tokenizer or str(assets["model"]))


@pytest.fixture(scope="module")
def task(mini_assets) -> MathTask:
    return math_task(mini_assets)


def token_id(task: MathTask, token: str) -> int:
    return task.tokenizer.hf.convert_tokens_to_ids(token)


def response(task: MathTask, text: str, end: str | None = "<|im_end|>") -> list[int]:
    return task.tokenizer.encode(text) + ([token_id(task, end)] if end else [])


def test_problem_sets_come_from_the_configured_files(task):
    assert len(task.train_problems) == 256  # 512 rows on disk: each DAPO problem is there twice
    assert all(p.prompt.startswith("Solve the following math problem step by step.") for p in task.train_problems)
    assert {name: len(problems) for name, problems in task.eval_sets.items()} == {
        "aime24": 30,
        "aime25": 30,
        "amc23": 40,
        "math500": 100,
    }
    assert all(p.prompt.endswith(f" {VERL_INSTRUCTION}") for problems in task.eval_sets.values() for p in problems)
    assert not any(p.prompt.endswith(VERL_INSTRUCTION) for p in task.train_problems)  # DAPO prompts as given


def test_train_order_is_seeded_and_num_train_limits(task, mini_assets):
    limited = math_task(mini_assets, num_train=10, eval_sets=())
    assert limited.train_problems == task.train_problems[:10] and limited.eval_sets == {}
    reseeded = math_task(mini_assets, seed=1, eval_sets=())
    assert reseeded.train_problems != task.train_problems
    assert set(reseeded.train_problems) == set(task.train_problems)


def test_deepscaler_prompts_get_the_verl_instruction(mini_assets):
    deepscaler = math_task(mini_assets, dataset="deepscaler", path=str(mini_assets["deepscaler"]), eval_sets=())
    assert all(p.prompt.endswith(f" {VERL_INSTRUCTION}") for p in deepscaler.train_problems)


def test_chat_prompt_is_one_user_turn_with_the_generation_prompt(task):
    problem = task.eval_sets["aime24"][0]
    text = task.tokenizer.decode(task.prompt_ids(problem), skip_special_tokens=False)
    assert text == f"<|im_start|>user\n{problem.prompt}<|im_end|>\n<|im_start|>assistant\n"


def test_raw_prompt_is_the_text_alone(mini_assets):
    raw = math_task(mini_assets, chat_template=False, eval_sets=())
    problem = raw.train_problems[0]
    ids = raw.prompt_ids(problem)
    assert raw.tokenizer.decode(ids, skip_special_tokens=False) == problem.prompt
    assert not set(ids) & raw.tokenizer.special_ids


def test_tokenizer_without_a_chat_template_is_refused_when_one_is_asked_for(mini_assets, tmp_path):
    folder = shutil.copytree(mini_assets["model"], tmp_path / "model")
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    del tokenizer_config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with pytest.raises(ValueError, match="has no chat template; set task.chat_template=false"):
        math_task(mini_assets, tokenizer=str(folder))
    assert math_task(mini_assets, tokenizer=str(folder), chat_template=False, eval_sets=()).train_problems


def test_eos_ids_are_every_id_the_tokenizer_and_configs_name(task):
    im_end, endoftext = token_id(task, "<|im_end|>"), token_id(task, "<|endoftext|>")
    assert task.tokenizer.eos_ids == (im_end, endoftext)  # tokenizer's eos_token first, then config.json's
    assert task.tokenizer.pad_id == endoftext
    assert task.tokenizer.vocab_size == len(task.tokenizer.hf) == endoftext + 3  # the specials come last
    assert task.tokenizer.special_ids == {endoftext, token_id(task, "<|im_start|>"), im_end}


def test_garble_reasons(task):
    good = response(task, "We add. Answer: 42")
    assert task.garble_reason(good) is None
    assert task.garble_reason(good + [5, 6, 7]) is None  # what follows EOS does not count
    assert task.garble_reason(response(task, "We add. Answer: 42", end="<|endoftext|>")) is None
    assert task.garble_reason(response(task, "We add. Answer: 42", end=None)) == "no_eos"
    assert task.garble_reason(response(task, "1 " * 60 + "Answer: 3")) == "no_eos"  # EOS beyond the limit
    assert task.garble_reason(response(task, "I am not sure.")) == "unparseable"
    padding_row = task.tokenizer.vocab_size  # the model's vocabulary is padded beyond the tokenizer's
    assert task.garble_reason([padding_row, *good]) == "invalid_token"
    assert task.garble_reason([token_id(task, "<|im_start|>"), *good]) == "invalid_token"
    assert task.garble_reason([padding_row] * 100) == "invalid_token"  # before no_eos


def test_rewards(task):
    problem = Problem(prompt="What is $6 \\cdot 7$?", answer="42")
    responses = [
        response(task, "Six sevens. Answer: 42"),
        response(task, "Six sevens are $\\boxed{42}$.", end="<|endoftext|>"),
        response(task, "Six sevens. Answer: 43"),
        response(task, "Six sevens. Answer: 42", end=None),  # no EOS: 0 even if right
        [task.tokenizer.vocab_size, *response(task, "Answer: 42")],  # invalid token
        response(task, "Answer: 42") + response(task, "Answer: 7"),  # after the first EOS nothing counts
    ]
    assert task.rewards([problem] * len(responses), responses) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="1 problems but 2 responses"):
        task.rewards([problem], responses[:2])


def test_registry_builds_the_task(mini_assets):
    assert isinstance(build_task(config(mini_assets, eval_sets=()), str(mini_assets["model"])), MathTask)


def test_config_checks_say_what_to_change(mini_assets):
    with pytest.raises(ValueError, match="unknown math data set 'gsm8k'; valid: .*dapo_math_17k"):
        check_task_config(TaskConfig(name="math", dataset="gsm8k"))
    with pytest.raises(ValueError, match="unknown math data set 'aime2024'"):
        check_task_config(TaskConfig(name="math", dataset="deepscaler", eval_sets=("aime2024",)))
    with pytest.raises(ValueError, match="max_response_tokens=0"):
        check_task_config(TaskConfig(name="math", dataset="deepscaler", max_response_tokens=0))
    with pytest.raises(ValueError, match="needs task.dataset"):
        check_task_config(TaskConfig(name="math"))
    with pytest.raises(ValueError, match="set model.hf_path="):
        MathTask(config(mini_assets, eval_sets=()))
    with pytest.raises(FileNotFoundError, match="does not exist; set model.hf_path="):
        MathTask(config(mini_assets, eval_sets=()), "/nonexistent/model")


def _empty_copy(folder: Path, tmp_path: Path, name: str) -> Path:
    """The data folder `folder` with every parquet file's rows dropped (the schema kept)."""
    import pandas as pd

    out = tmp_path / name
    for source in folder.rglob("*.parquet"):
        target = out / source.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        pd.read_parquet(source).iloc[:0].to_parquet(target)
    return out


def test_a_data_file_without_rows_is_refused_with_its_path_and_schema(mini_assets, tmp_path):
    """A parquet file with the schema but no rows: the file, the columns and the option to change (the training
    set's and a benchmark's own), a ConfigError (the command exits 2)."""
    empty = _empty_copy(mini_assets["dapo_math_17k"], tmp_path, "dapo")
    with pytest.raises(ConfigError, match=r"dapo/data/dapo-math-17k.parquet holds no rows; .*\['prompt', 'reward_"):
        math_task(mini_assets, path=str(empty), eval_sets=())
    empty = _empty_copy(mini_assets["aime24"], tmp_path, "aime24")
    with pytest.raises(ConfigError, match=r"data/train-00000-of-00001.parquet holds no rows.*eval_paths.aime24="):
        math_task(mini_assets, eval_sets=("aime24",), eval_paths={"aime24": str(empty)})


def test_empty_problem_sets_are_refused_instead_of_failing_later_or_scoring_nan(mini_assets):
    from fp8rl.tasks.math.task import refuse_empty_sets

    cfg = config(mini_assets, eval_sets=("aime24",))
    with pytest.raises(ValueError, match=r"task.dataset=dapo_math_17k: .* holds no problems.*task.path"):
        refuse_empty_sets(cfg, [], {})
    with pytest.raises(ValueError, match=r"task.eval_sets: aime24 from .* holds no problems"):
        refuse_empty_sets(cfg, ["a problem"], {"aime24": []})


def test_prompts_too_long_for_the_sequence_are_refused_with_the_count_and_the_longest(mini_assets):
    task = math_task(mini_assets, eval_sets=("aime24",), max_response_tokens=16)
    lengths = sorted(len(task.prompt_ids(p)) for p in task.train_problems)
    max_seq_len = lengths[len(lengths) // 2] + 16  # half the training prompts fit
    with pytest.raises(ValueError, match=r"prompts longer than \d+ tokens .*train \d+.*the longest has \d+.*filter"):
        task.fit_prompts(max_seq_len)


def test_filtered_prompts_are_dropped_and_counted(mini_assets):
    task = math_task(mini_assets, eval_sets=("aime24",), max_response_tokens=16, overlong_prompts="filter")
    before = len(task.train_problems)
    lengths = sorted(len(task.prompt_ids(p)) for p in task.train_problems)
    limit = lengths[len(lengths) // 2]
    dropped = task.fit_prompts(limit + 16)
    assert dropped["train"] == sum(n > limit for n in lengths) > 0
    assert len(task.train_problems) == before - dropped["train"]
    assert all(len(task.prompt_ids(p)) <= limit for p in task.train_problems)
    with pytest.raises(ValueError, match="no room for a prompt"):
        task.fit_prompts(16)


def test_an_unknown_overlong_prompt_policy_is_refused(mini_assets):
    with pytest.raises(ValueError, match=r"task.overlong_prompts='truncate'.*refuse"):
        math_task(mini_assets, overlong_prompts="truncate")


def _deepscaler_file(mini_assets, tmp_path: Path, long_line: int) -> Path:
    """The mini DeepScaleR problems as JSON lines, the one on `long_line` made 2,000 words longer."""
    rows = json.loads(Path(mini_assets["deepscaler"], "deepscaler.json").read_text())[:20]
    rows[long_line - 1] = {**rows[long_line - 1], "problem": rows[long_line - 1]["problem"] + " and then" * 2000}
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_the_overlong_refusal_names_the_file_and_line_of_the_longest_prompt(mini_assets, tmp_path):
    """Before, the refusal gave counts only, as a ValueError (a traceback, the MLflow run already FAILED)."""
    path = _deepscaler_file(mini_assets, tmp_path, long_line=7)
    task = math_task(mini_assets, dataset="deepscaler", path=str(path), eval_sets=("aime25",), max_response_tokens=16)
    with pytest.raises(ConfigError) as error:
        task.fit_prompts(1024)
    assert re.search(rf"train 1 \(the longest has \d{{4}} tokens: {re.escape(str(path))}, line 7\)", str(error.value))
    assert "task.overlong_prompts=filter" in str(error.value)


def test_a_filter_that_empties_a_set_says_so(mini_assets):
    task = math_task(mini_assets, eval_sets=("aime24",), max_response_tokens=16, overlong_prompts="filter")
    shortest = min(len(task.prompt_ids(p)) for p in task.eval_sets["aime24"] + task.train_problems)
    with pytest.raises(ConfigError, match=r"holds no problems left after dropping prompts longer than \d+ tokens"):
        task.fit_prompts(shortest - 1 + 16)


def test_empty_sets_are_refused_as_config_errors(mini_assets, tmp_path):
    """An all-empty training set (every answer missing) and an all-empty benchmark: refused when the task is built,
    as a ConfigError the command turns into exit 2 (the job builds the task before the MLflow run)."""
    rows = json.loads(Path(mini_assets["deepscaler"], "deepscaler.json").read_text())[:5]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({**row, "answer": ""}) + "\n" for row in rows))
    with pytest.warns(UserWarning, match="dropped 5 rows"), pytest.raises(ConfigError, match="holds no problems"):
        math_task(mini_assets, dataset="deepscaler", path=str(train), eval_sets=())
    bench = tmp_path / "test.jsonl"
    bench.write_text(json.dumps({"problem": "p", "answer": None}) + "\n")
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match=r"math500 from .*test.jsonl holds no problems"):
        math_task(mini_assets, eval_sets=("math500",), eval_paths={"math500": str(bench)})
