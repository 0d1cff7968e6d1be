import pytest
import torch

from fp8rl.config import TaskConfig
from fp8rl.tasks import (
    GARBLE_REASONS,
    HELDOUT,
    ArithmeticTask,
    batch_rewards,
    build_task,
    check_task_config,
    garble_metrics,
    register_task,
    task_names,
)
from fp8rl.tasks.arithmetic import ProblemSpace, problem_universe_size


@pytest.fixture(scope="module")
def task():
    return build_task(TaskConfig(num_train=2000, num_eval=200))


def response(task, text, eos=True):
    return task.tokenizer.encode(text, add_bos=False) + ([task.tokenizer.eos_id] if eos else [])


def test_problem_sets_are_deterministic_disjoint_and_correct(task):
    again = build_task(TaskConfig(num_train=2000, num_eval=200))
    assert again.train_problems == task.train_problems and again.eval_problems == task.eval_problems
    assert task.eval_sets == {HELDOUT: task.eval_problems}
    assert len(set(task.train_problems)) == 2000 and len(set(task.eval_problems)) == 200
    assert not set(task.train_problems) & set(task.eval_problems)
    for problem in task.eval_problems:
        a, b = problem.prompt.rstrip("=").split("+")
        assert 100 <= int(a) < 1000 and 100 <= int(b) < 1000 and int(problem.answer) == int(a) + int(b)


def test_operand_widths():
    cfg = TaskConfig(num_digits=2, num_train=100, num_eval=10)
    fixed, free = ProblemSpace.of(cfg), ProblemSpace.of(cfg, fixed_width=False)
    assert problem_universe_size(fixed) == 90**2 and problem_universe_size(free) == 100**2
    problems = ArithmeticTask(cfg, fixed_width=False).train_problems
    operands = [int(x) for p in problems for x in p.prompt.rstrip("=").split("+")]
    assert min(operands) < 10 <= max(operands)


def test_other_seed_gives_other_problems(task):
    other = build_task(TaskConfig(num_train=2000, num_eval=200, seed=1))
    assert other.eval_problems != task.eval_problems


def test_small_universes_are_enumerated_and_split():
    cfg = TaskConfig(operations="+-", num_digits=1, num_train=150, num_eval=50)
    task = ArithmeticTask(cfg)
    assert problem_universe_size(ProblemSpace.of(cfg)) == 200
    assert len(set(task.train_problems) | set(task.eval_problems)) == 200


@pytest.mark.parametrize(("op", "check"), [("-", lambda a, b: a - b), ("*", lambda a, b: a * b)])
def test_subtraction_and_multiplication(op, check):
    task = ArithmeticTask(TaskConfig(operations=op, num_digits=2, num_train=100, num_eval=20))
    for problem in task.eval_problems:
        a, b = problem.prompt.rstrip("=").split(op, 1)
        assert int(problem.answer) == check(int(a), int(b))


def test_response_limit_covers_the_longest_answer():
    assert ArithmeticTask(TaskConfig(num_train=10, num_eval=10)).max_response_tokens == 4 + 1 + 2
    multiplication = TaskConfig(operations="*", num_digits=3, num_train=10, num_eval=10)
    assert ArithmeticTask(multiplication, response_slack=0).max_response_tokens == 6 + 1


def test_prompt_and_target_ids(task):
    problem = task.eval_problems[0]
    assert task.tokenizer.decode(task.prompt_ids(problem), skip_special_tokens=False) == "<bos>" + problem.prompt
    assert task.target_ids(problem) == response(task, problem.answer)


def test_reward_is_exact_match_before_eos(task):
    problem = task.eval_problems[0]
    right = response(task, problem.answer)
    assert task.reward(problem, right) == 1.0
    assert task.reward(problem, right + [task.tokenizer.pad_id] * 3) == 1.0  # pads after <eos> are ignored
    assert task.reward(problem, torch.tensor(right)) == 1.0
    assert task.reward(problem, response(task, problem.answer, eos=False)) == 0.0
    assert task.reward(problem, response(task, "0" + problem.answer)) == 0.0  # not canonical
    assert task.reward(problem, response(task, str(int(problem.answer) + 1))) == 0.0
    with_pad_inside = right[:1] + [task.tokenizer.pad_id] + right[1:]
    assert task.reward(problem, with_pad_inside) == 0.0
    assert task.reward(problem, right[:1] + [60] + right[1:]) == 0.0  # a padded-vocabulary id


def test_reward_needs_eos_within_the_length_limit(task):
    problem = task.eval_problems[0]
    late = response(task, problem.answer.rjust(task.max_response_tokens, "0"))
    assert task.reward(problem, late) == 0.0
    assert task.garble_reason(late) == "no_eos"


@pytest.mark.parametrize(
    ("text", "eos", "reason"),
    [
        ("123", True, None),
        ("-7", True, None),
        ("12+3", True, "invalid_token"),
        ("12=", False, "invalid_token"),
        ("123", False, "no_eos"),
        ("", True, "unparseable"),
        ("-", True, "unparseable"),
        ("1-2", True, "unparseable"),
    ],
)
def test_garble_reasons(task, text, eos, reason):
    assert task.garble_reason(response(task, text, eos)) == reason


def test_special_tokens_before_eos_are_invalid(task):
    assert task.garble_reason([task.tokenizer.bos_id, task.tokenizer.eos_id]) == "invalid_token"


def test_batch_rewards_and_garble_metrics(task):
    problems = task.eval_problems[:3]
    responses = [response(task, problems[0].answer), response(task, "1+"), response(task, "5", eos=False)]
    assert batch_rewards(task, problems, responses).tolist() == [1.0, 0.0, 0.0]
    assert task.rewards(problems, responses) == [1.0, 0.0, 0.0]
    metrics = garble_metrics([task.garble_reason(r) for r in responses] + [None])
    assert metrics["rollout/garbled_rate"] == 0.5
    assert metrics["rollout/garbled_invalid_token"] == metrics["rollout/garbled_no_eos"] == 0.25
    assert metrics["rollout/garbled_unparseable"] == 0.0
    assert set(metrics) == {"rollout/garbled_rate", *(f"rollout/garbled_{r}" for r in GARBLE_REASONS)}
    with pytest.raises(ValueError):
        batch_rewards(task, problems, responses[:2])


def test_registry_errors():
    assert "arithmetic" in task_names()
    with pytest.raises(KeyError, match="arithmetic"):
        build_task(TaskConfig(name="sudoku"))
    with pytest.raises(ValueError, match="already registered"):
        register_task("arithmetic")(lambda cfg, path: None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"operations": "/"}, "task.operations"),
        ({"operations": ""}, "task.operations"),
        ({"num_digits": 1, "num_train": 100}, "only 100 distinct problems"),
    ],
)
def test_invalid_configs_fail_with_a_message(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_task_config(TaskConfig(**overrides))
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(TaskConfig(**overrides))


@pytest.mark.parametrize("overrides", [{"num_digits": 0}, {"num_eval": 0}])
def test_out_of_range_fields_fail_when_the_config_is_built(overrides):
    with pytest.raises(ValueError):
        TaskConfig(**overrides)
