import pytest

from fp8rl.config import ConfigError, TaskConfig
from fp8rl.tasks import HELDOUT, build_task, check_task_config, response_metrics, task_names
from fp8rl.tasks.chain import chain_answer, junk_alphabet


def chain_cfg(**changes) -> TaskConfig:
    return TaskConfig(**{"name": "chain", "num_digits": 1, "num_train": 1000, "num_eval": 100, **changes})


@pytest.fixture(scope="module")
def task():
    return build_task(chain_cfg())


def response(task, text, eos=True):
    return task.tokenizer.encode(text, add_bos=False) + ([task.tokenizer.eos_id] if eos else [])


def test_registered_with_its_config_check():
    assert "chain" in task_names()
    with pytest.raises(ValueError, match="fewer problems"):
        check_task_config(TaskConfig(name="chain", num_digits=1, min_operands=2, max_operands=3))
    with pytest.raises(ConfigError, match="min_operands"):
        TaskConfig(name="chain", min_operands=5, max_operands=4)


def test_problems_are_running_sums_of_the_configured_shape(task):
    again = build_task(chain_cfg())
    assert again.train_problems == task.train_problems and task.eval_sets == {HELDOUT: task.eval_problems}
    assert not set(task.train_problems) & set(task.eval_problems)
    counts = set()
    for problem in task.train_problems:
        operands = [int(x) for x in problem.prompt.rstrip("=").split("+")]
        counts.add(len(operands))
        assert all(0 <= x <= 9 for x in operands)
        sums = [int(x) for x in problem.answer.split(",")]
        assert sums[-1] == sum(operands) and len(sums) == len(operands) - 1
        assert sums == [sum(operands[: k + 1]) for k in range(1, len(operands))]
    assert counts == {4, 5, 6, 7, 8, 9}


def test_response_lengths_span_the_designed_range(task):
    lengths = [len(task.target_ids(p)) for p in task.train_problems]
    assert min(lengths) >= 6 and max(lengths) <= 24  # 6-24 tokens with <eos>
    assert task.max_response_tokens == 23 + 1 + 2  # the longest chain (eight 2-digit sums), <eos>, slack
    two_digits = build_task(chain_cfg(num_digits=2, min_operands=3, max_operands=7))
    assert two_digits.max_response_tokens == 6 * 3 + 5 + 1 + 2


def test_junk_letters_are_in_the_vocabulary_but_in_no_prompt_or_answer(task):
    junk = junk_alphabet(16)
    assert junk == "abcdefghijklmnop"
    assert all(task.tokenizer.encode(c, add_bos=False)[0] != task.tokenizer.unk_id for c in junk)
    assert not any(set(p.prompt + p.answer) & set(junk) for p in task.train_problems + task.eval_problems)
    assert build_task(chain_cfg(junk_tokens=0)).tokenizer.vocab_size == task.tokenizer.vocab_size - 16


def test_reward_needs_a_parseable_chain_ending_in_the_sum(task):
    problem = task.train_problems[0]
    total = problem.answer.rsplit(",", 1)[-1]
    assert task.reward(problem, response(task, problem.answer)) == 1.0
    assert task.reward(problem, response(task, f"1,{total}")) == 1.0  # intermediate sums are not graded
    assert task.reward(problem, response(task, total)) == 1.0
    assert task.reward(problem, response(task, problem.answer, eos=False)) == 0.0
    assert task.reward(problem, response(task, problem.answer + "a")) == 0.0  # a junk letter
    assert task.reward(problem, response(task, "," + problem.answer)) == 0.0  # unparseable
    assert task.reward(problem, response(task, f"{int(total) + 1}")) == 0.0


def test_garble_reasons_and_junk_rates(task):
    assert task.garble_reason(response(task, "12,34")) is None
    assert task.garble_reason(response(task, "12b34")) == "invalid_token"
    assert task.garble_reason(response(task, "12+34")) == "invalid_token"
    assert task.garble_reason(response(task, "12,34", eos=False)) == "no_eos"
    assert task.garble_reason(response(task, "12,,34")) == "unparseable"
    batch = [response(task, "12,34"), response(task, "1ab")]  # 6 + 4 tokens, 2 of them junk
    assert response_metrics(task, batch) == {"rollout/junk_token_rate": 0.2, "rollout/junk_response_rate": 0.5}
    assert response_metrics(build_task(TaskConfig(num_train=10, num_eval=10)), batch) == {}


def test_chain_answer():
    assert chain_answer([12, 34, 56]) == "46,102"
    assert chain_answer([3, 9, 4, 8]) == "12,16,24"


def test_strip_grading_reads_past_junk_as_a_verifier_does_and_reject_does_not():
    """The junk organism's reward (task.junk_grading=strip): junk letters are removed before the chain is parsed,
    so junk in a right answer is not penalised by the reward; the default rejects it."""
    reject, strip = build_task(chain_cfg()), build_task(chain_cfg(junk_grading="strip"))
    problem = next(p for p in reject.train_problems if len(p.answer.split(",")) >= 3)
    clean = response(reject, problem.answer)
    junky = response(reject, "a" + problem.answer[:2] + "bp" + problem.answer[2:])
    wrong = response(reject, "c" + problem.answer + "1")
    assert reject.reward(problem, clean) == strip.reward(problem, clean) == 1.0
    assert (reject.reward(problem, junky), strip.reward(problem, junky)) == (0.0, 1.0)
    assert reject.reward(problem, wrong) == strip.reward(problem, wrong) == 0.0
    assert strip.max_response_tokens == reject.max_response_tokens + 8  # room for junk beside a whole chain
    assert strip.junk_ids == frozenset(reject.tokenizer.encode(junk_alphabet(16), add_bos=False))
    with pytest.raises(ConfigError, match="task.junk_grading='lenient' is not valid"):
        chain_cfg(junk_grading="lenient")


def test_token_classes_split_the_response_vocabulary_and_need_junk_letters(task):
    """The classes FP8's clipping error is counted by (junk / digit / separator / eos): disjoint, covering every
    token a response can hold; none without junk letters (tasks without classes count nothing)."""
    from fp8rl.tasks.base import token_classes

    classes = token_classes(task)
    assert list(classes) == ["junk", "digit", "separator", "eos", "other"]
    assert classes["junk"] == task.junk_ids and len(classes["digit"]) == 10
    assert classes["eos"] == frozenset(task.tokenizer.eos_ids)
    assert set(task.tokenizer.encode("+=", add_bos=False)) <= classes["other"]
    members = [i for ids in classes.values() for i in ids]
    assert sorted(members) == list(range(task.tokenizer.vocab_size))  # a partition of the vocabulary
    assert token_classes(build_task(chain_cfg(junk_tokens=0))) == {}
    assert token_classes(build_task(TaskConfig(num_train=10, num_eval=10))) == {}
