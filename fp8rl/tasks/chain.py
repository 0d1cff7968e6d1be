"""Multi-operand sums answered with a running-sum chain: the CPU-scale task with room for the paper's collapse.

Prompt ``"<bos>3+9+4+8="``, reference response ``"12,16,24<eos>"``: the running sum after each addition, comma
separated; the last number is the answer. Operands have exactly ``task.num_digits`` digits (0-9 for one digit),
a problem has ``task.min_operands`` .. ``task.max_operands`` of them (uniformly), so responses are
variable-length reasoning (one-digit operands, 4-9 of them: 6-24 response tokens with <eos>). The vocabulary
carries ``task.junk_tokens`` letters that no prompt or answer ever uses, so probability mass can leak to tokens
that are never right.

Reward 1 only for a parseable response (digits and commas forming ``n(,n)*`` before <eos>) whose last number
is the sum; the intermediate sums are not graded (the warm start teaches them). ``task.junk_grading=strip`` (the
junk organism, results/studies/2026-12-06-junk-organism.md) removes junk letters before parsing, as a verifier
reads past garbage, so a right answer with junk in it earns 1; its responses get ``JUNK_SLACK`` more tokens.
``response_metrics`` gives the junk rates (``rollout/junk_token_rate``: share of response tokens that are junk letters;
``rollout/junk_response_rate``: share of responses with at least one).
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Sequence
from itertools import accumulate

from fp8rl.config import TaskConfig
from fp8rl.tasks.base import HELDOUT, Problem, register_task
from fp8rl.tasks.tokenizer import CharTask, CharTokenizer, build_char_tokenizer

DIGITS = "0123456789"
ANSWER_CHARS = DIGITS + ","
CHAIN_PATTERN = re.compile(r"[0-9]+(,[0-9]+)*")
RESPONSE_SLACK = 2  # response limit = longest possible chain + <eos> + slack
JUNK_SLACK = 8  # junk_grading=strip: room for junk letters beside a whole chain


def junk_alphabet(count: int) -> str:
    """The first `count` lowercase letters: tokens no prompt or answer contains."""
    return string.ascii_lowercase[:count]


def check_chain_config(cfg: TaskConfig) -> None:
    """Raise ValueError (saying what to change) when `cfg` asks for more distinct problems than plausible."""
    operands = 10 if cfg.num_digits == 1 else 9 * 10 ** (cfg.num_digits - 1)
    universe = sum(operands**n for n in range(cfg.min_operands, cfg.max_operands + 1))
    if cfg.num_train + cfg.num_eval > universe // 2:
        raise ValueError(
            f"{cfg.num_train} train + {cfg.num_eval} eval problems (task.num_train, task.num_eval) need more than half "
            f"of the {universe} sums with task.num_digits={cfg.num_digits}, {cfg.min_operands}-{cfg.max_operands} "
            "operands: ask for fewer problems or more digits / operands"
        )


def chain_answer(operands: Sequence[int]) -> str:
    """The running sums after each addition, e.g. (12, 34, 56) -> "46,102"."""
    return ",".join(str(s) for s in list(accumulate(operands))[1:])


def draw_problems(cfg: TaskConfig) -> list[Problem]:
    """``num_eval + num_train`` distinct problems in draw order (eval first), fixed by ``cfg.seed``."""
    rng = random.Random(cfg.seed)
    low, high = 10 ** (cfg.num_digits - 1) if cfg.num_digits > 1 else 0, 10**cfg.num_digits - 1
    seen: dict[str, Problem] = {}
    while len(seen) < cfg.num_eval + cfg.num_train:
        operands = [rng.randint(low, high) for _ in range(rng.randint(cfg.min_operands, cfg.max_operands))]
        prompt = "+".join(map(str, operands)) + "="
        seen.setdefault(prompt, Problem(prompt=prompt, answer=chain_answer(operands)))
    return list(seen.values())


def longest_chain(cfg: TaskConfig) -> int:
    """Characters of the longest possible chain: each running sum of k operands has at most
    num_digits + len(str(k)) - 1 + 1 digits; commas between them."""
    widths = [len(str(k * (10**cfg.num_digits - 1))) for k in range(2, cfg.max_operands + 1)]
    return sum(widths) + len(widths) - 1


class ChainTask(CharTask):
    """Running-sum chains of multi-operand sums, their character tokenizer (with junk letters), reward and
    garble detector (module docstring)."""

    name = "chain"
    answer_pattern = CHAIN_PATTERN

    def __init__(self, cfg: TaskConfig) -> None:
        check_chain_config(cfg)
        self.cfg = cfg
        self.junk = junk_alphabet(cfg.junk_tokens)
        self.tokenizer: CharTokenizer = build_char_tokenizer(DIGITS + "+,=" + self.junk)
        problems = draw_problems(cfg)
        self.eval_problems: list[Problem] = problems[: cfg.num_eval]
        self.train_problems: list[Problem] = problems[cfg.num_eval :]
        self.eval_sets: dict[str, list[Problem]] = {HELDOUT: self.eval_problems}
        slack = RESPONSE_SLACK + (JUNK_SLACK if cfg.junk_grading == "strip" else 0)
        self.max_response_tokens: int = longest_chain(cfg) + 1 + slack
        self._answer_ids = frozenset(self.tokenizer.encode(ANSWER_CHARS, add_bos=False))
        self._junk_ids = frozenset(self.tokenizer.encode(self.junk, add_bos=False)) if self.junk else frozenset()

    @property
    def junk_ids(self) -> frozenset[int]:
        """The junk letters' token ids (never right)."""
        return self._junk_ids

    @property
    def token_classes(self) -> dict[str, frozenset[int]]:
        """The response tokens by class, for FP8's clipping error per class (`fp8rl.tasks.base.token_classes`):
        junk letters, digits, the separator (comma), <eos>, and every other token of the vocabulary (the prompt's
        '+' and '=', the other special tokens), so the classes partition whatever a response samples; empty
        without junk letters."""
        if not self._junk_ids:
            return {}
        classes = {
            "junk": self._junk_ids,
            "digit": frozenset(self.tokenizer.encode(DIGITS, add_bos=False)),
            "separator": frozenset(self.tokenizer.encode(",", add_bos=False)),
            "eos": frozenset(self.tokenizer.eos_ids),
        }
        named = frozenset().union(*classes.values())
        return {**classes, "other": frozenset(range(self.tokenizer.vocab_size)) - named}

    def reward(self, problem: Problem, response_ids: Sequence[int]) -> float:
        """1.0 iff <eos> came in time, the body (junk stripped first under junk_grading=strip) parses as a chain
        and its last number is the sum."""
        body, has_eos = self.split_at_eos(response_ids)
        if self.cfg.junk_grading == "strip":
            body = [token for token in body if token not in self._junk_ids]
        if not has_eos or any(token not in self._answer_ids for token in body):
            return 0.0
        text = self.tokenizer.decode(body)
        if not CHAIN_PATTERN.fullmatch(text):
            return 0.0
        return 1.0 if int(text.rsplit(",", 1)[-1]) == int(problem.answer.rsplit(",", 1)[-1]) else 0.0

    def response_metrics(self, responses: Sequence[Sequence[int]]) -> dict[str, float]:
        """Junk rates of a batch of responses (token ids, <eos> included where sampled)."""
        tokens = [int(t) for r in responses for t in r]
        junk_tokens = sum(t in self._junk_ids for t in tokens)
        junk_responses = sum(any(int(t) in self._junk_ids for t in r) for r in responses)
        return {
            "rollout/junk_token_rate": junk_tokens / max(len(tokens), 1),
            "rollout/junk_response_rate": junk_responses / max(len(responses), 1),
        }


@register_task("chain", check=check_chain_config)
def build_chain_task(cfg: TaskConfig, model_path: str | None = None) -> ChainTask:
    """Registry factory for :class:`ChainTask` (it brings its own tokenizer: `model_path` is unused)."""
    return ChainTask(cfg)
