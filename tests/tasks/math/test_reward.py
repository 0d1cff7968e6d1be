"""The math-verify reward: answer extraction, equivalent forms, wrong answers that look right, pathological
expressions bounded in time, and the worker pool that kills stuck verifications."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8rl.tasks.math.reward import VerifierPool, extract_final_answer, last_boxed, math_reward, math_rewards

# (response, ground truth, expected reward)
CASES = [
    ("\\boxed{\\frac{1}{2}}", "0.5", 1),
    ("Answer: 0.5", "\\frac{1}{2}", 1),
    ("Answer: 1/2", "\\frac{1}{2}", 1),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac12", 1),
    ("\\boxed{\\tfrac{3}{4}}", "0.75", 1),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1),
    ("\\boxed{\\dfrac{7}{2}}", "3.5", 1),
    ("\\boxed{\\frac{1}{3}}", "0.3333", 0),
    ("\\boxed{0.33}", "\\frac{1}{3}", 0),
    ("\\boxed{2^{1/2}}", "\\sqrt{2}", 1),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1),
    ("\\boxed{2}", "\\sqrt{4}", 1),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}", 1),
    ("\\boxed{\\left(\\frac{1}{2}, 3\\right)}", "(\\frac12, 3)", 1),
    ("\\boxed{5}", "5", 1),
    ("Answer: 5", "5", 1),
    ("Answer: $5$", "5", 1),
    ("Answer: \\(5\\)", "5", 1),
    ("Answer: 5.", "5", 1),
    ("**Answer:** 42", "42", 1),
    ("The final answer is $\\boxed{42}$. I hope it is correct.", "42", 1),
    ("First \\boxed{3}, then corrected: \\boxed{4}", "4", 1),
    ("First \\boxed{3}, then corrected: \\boxed{4}", "3", 0),
    ("So \\boxed{4}.\nAnswer: 5", "5", 1),
    ("Answer: \\boxed{7}", "7", 1),
    ("\\boxed{-3}", "-3", 1),
    ("\\boxed{3}", "-3", 0),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1),
    ("\\boxed{\\pi}", "\\pi", 1),
    ("\\boxed{3.14}", "\\pi", 0),
    ("\\boxed{\\frac{\\pi}{2}}", "\\frac{1}{2}\\pi", 1),
    ("\\boxed{(1, 2]}", "(1,2]", 1),
    ("\\boxed{[1, 2)}", "(1,2]", 0),
    ("\\boxed{(-\\infty, 0)}", "(-\\infty,0)", 1),
    ("\\boxed{1,000}", "1000", 1),
    ("Answer: 1000", "1,000", 1),
    ("\\boxed{1{,}000}", "1000", 1),
    ("\\boxed{5 \\text{ cm}}", "5", 1),
    ("Answer: 12 cm", "12", 1),
    ("\\boxed{x = 5}", "5", 1),
    ("\\boxed{30^\\circ}", "30", 1),
    ("", "5", 0),
    ("I think it is 5.", "5", 0),
    ("After simplifying we get \\boxed{12} as required, done.", "12", 1),
    ("\\boxed{1.0000001}", "1", 0),
    ("\\boxed{43}", "42", 0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1),
    ("\\boxed{}", "5", 0),
    ("\\boxed{5", "5", 0),
    ("Answer:", "5", 0),
    ("\\boxed{0.5}", "$\\frac{1}{2}$", 1),
    ("\\fbox{9}", "9", 1),
    ("\\boxed{B}", "B", 1),
    ("\\boxed{C}", "B", 0),
    ("\\boxed{100}", "27.0", 0),
    ("\\boxed{27}", "27.0", 1),
    ("\\boxed{1,000}", "1,000", 1),
]
POWER_TOWER = "\\boxed{2^{2^{2^{2^{2^{2^{2}}}}}}}"
NESTED_FRACTION = "\\boxed{" + "\\frac{1}{" * 200 + "2" + "}" * 200 + "}"


@pytest.mark.parametrize(("response", "truth", "expected"), CASES)
def test_reward_cases(response, truth, expected):
    assert math_reward(response, truth) == expected


def test_there_are_enough_cases_of_both_outcomes():
    assert len(CASES) >= 40
    assert sum(expected for _, _, expected in CASES) >= 20 and sum(1 - e for _, _, e in CASES) >= 15


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),  # nested braces
        ("\\boxed{1} and \\boxed{2}", "2"),  # the last box
        ("\\boxed{4}\nAnswer: 5", "5"),  # the later of box and answer line
        ("Answer: 5\nso \\boxed{6}", "6"),
        ("Answer: $\\dfrac{3}{4}$.", "\\dfrac{3}{4}"),  # math delimiters and the period dropped
        ("Final Answer: The final answer is $7$. I hope it is correct.", "7"),
        ("\\boxed{2} then a cut-off \\boxed{3", "2"),  # an unclosed box is not an answer
        ("no answer here, just 5", None),
        ("Answer:   \n", None),
        ("", None),
    ],
)
def test_extract_final_answer(response, answer):
    assert extract_final_answer(response) == answer


def test_last_boxed_reports_where_it_starts():
    assert last_boxed("ab \\boxed{x{y}} c") == (3, "x{y}")


@pytest.mark.parametrize("response", [POWER_TOWER, NESTED_FRACTION], ids=["power_tower", "nested_frac_200"])
def test_pathological_expressions_score_zero_within_the_timeout(response):
    start = time.monotonic()
    assert math_reward(response, "7", timeout_s=3.0) == 0.0
    assert time.monotonic() - start < 3.0 + 2.0  # the timeout plus a worker restart at most


def test_a_pathological_item_does_not_hold_up_the_batch():
    responses = ["Answer: 12", POWER_TOWER, "\\boxed{\\frac{1}{2}}", NESTED_FRACTION, "\\boxed{9}"]
    truths = ["12", "5", "0.5", "7", "8"]
    start = time.monotonic()
    assert math_rewards(responses, truths, timeout_s=2.0) == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert time.monotonic() - start < 2 * 2.0 + 2.0


def test_a_stuck_worker_is_killed_and_replaced():
    pool = VerifierPool(workers=1, op_timeout_s=None)  # no math-verify alarms: only the hard deadline can stop it
    try:
        start = time.monotonic()
        assert pool.score([("2^{2^{2^{2^{2^{2^{2}}}}}}", "5"), ("\\frac{6}{4}", "1.5")], timeout_s=1.0) == [0.0, 1.0]
        assert pool.killed == 1
        assert time.monotonic() - start < 1.0 + 30.0  # kill after 1 s, then one interpreter start (seconds)
    finally:
        pool.close()


def test_rewards_from_a_worker_thread():
    """math-verify's own timeouts need the main thread; the pool makes the reward callable from any thread."""
    results: list[list[float]] = []
    thread = threading.Thread(target=lambda: results.append(math_rewards(["\\boxed{3}", "Answer: 4"], ["3", "3"])))
    thread.start()
    thread.join(timeout=60)
    assert results == [[1.0, 0.0]]


def test_batch_arguments_are_checked():
    assert math_rewards([], []) == []
    assert math_rewards(["no answer", "\\boxed{1}"], ["1", ""]) == [0.0, 0.0]  # nothing to verify: no pool use
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        math_rewards(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="workers=0"):
        VerifierPool(workers=0)


def _last_boxed_by_rescanning(text: str):
    """The extraction before the one-pass brace matching (quadratic on repeated unclosed openings): the reference
    the new one must equal."""
    import re

    for match in reversed(list(re.finditer(r"\\(?:boxed|fbox)\s*\{", text))):
        depth = 1
        for index in range(match.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[index], 0)
            if depth == 0:
                return match.start(), text[match.end() : index]
    return None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["\\boxed{", "\\fbox {", "{", "}", "x", "1", "\\frac{1}{2}", " "]), max_size=40))
def test_last_boxed_equals_the_rescanning_extraction(pieces) -> None:

    text = "".join(pieces)
    assert last_boxed(text) == _last_boxed_by_rescanning(text)


@pytest.mark.timeout(30)
def test_extraction_is_linear_on_repeated_unclosed_boxes() -> None:
    """100k characters of unclosed ``\\boxed{`` took 94 s with the rescanning extraction (outside the per-answer
    time limit, which guards only the verifier); one pass takes milliseconds."""

    assert extract_final_answer("\\boxed{" * 15000 + "\\boxed{7}") == "7"
    assert extract_final_answer("\\boxed{" * 15000) is None
