"""Multi-digit arithmetic with exact-match rewards: a local, deterministic verifiable-reward task.

Configured by the run's `TaskConfig` (operations, num_digits, num_train, num_eval, seed).
Prompt ``"<bos>123+456="``, reference response ``"579<eos>"``. Operands are drawn uniformly among
the numbers with exactly ``num_digits`` digits (10..99 for 2; 0..9 for 1), or with ``fixed_width``
off from 0 .. 10^num_digits - 1, always written without leading zeros. The eval set is drawn first, then the
train set from the remaining problems, so the two are disjoint; both depend only on the config.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from fp8rl.config import TaskConfig
from fp8rl.tasks.base import HELDOUT, Problem, register_task
from fp8rl.tasks.tokenizer import CharTask, CharTokenizer, build_char_tokenizer

DIGITS = "0123456789"
OPERATIONS = "+-*"
ALPHABET = DIGITS + OPERATIONS + "="
ANSWER_CHARS = DIGITS + "-"
ANSWER_PATTERN = re.compile(r"-?[0-9]+")
_ENUMERATE_BELOW = 100_000  # universes up to this size are enumerated and shuffled, larger ones sampled


@dataclass(frozen=True)
class ProblemSpace:
    """Which arithmetic problems exist: the task config's operations and digits, and the operand width rule."""

    operations: str = "+"  # any of "+", "-", "*", e.g. "+-"; each problem picks one uniformly
    num_digits: int = 3  # digits per operand
    fixed_width: bool = True  # operands have exactly num_digits digits; False: any of 0 .. 10^num_digits - 1

    @classmethod
    def of(cls, cfg: TaskConfig, fixed_width: bool = True) -> ProblemSpace:
        return cls(cfg.operations, cfg.num_digits, fixed_width)


def check_arithmetic_config(cfg: TaskConfig, fixed_width: bool = True) -> None:
    """Raise ValueError (saying what to change) when `cfg` asks for problems that do not exist."""
    if not cfg.operations or any(op not in OPERATIONS for op in cfg.operations):
        raise ValueError(f"task.operations={cfg.operations!r}; use a non-empty subset of {OPERATIONS!r}")
    universe = problem_universe_size(ProblemSpace.of(cfg, fixed_width))
    if cfg.num_train + cfg.num_eval > universe:
        raise ValueError(
            f"{cfg.num_train} train + {cfg.num_eval} eval problems requested (task.num_train, task.num_eval), but "
            f"only {universe} distinct problems exist for task.operations={cfg.operations!r}, "
            f"task.num_digits={cfg.num_digits}"
        )


def operand_range(space: ProblemSpace) -> range:
    """The operands a problem can have."""
    low = 10 ** (space.num_digits - 1) if space.fixed_width and space.num_digits > 1 else 0
    return range(low, 10**space.num_digits)


def problem_universe_size(space: ProblemSpace) -> int:
    """Number of distinct (a, op, b) problems."""
    return len(set(space.operations)) * len(operand_range(space)) ** 2


def solve(a: int, op: str, b: int) -> int:
    """The exact result of ``a op b``."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def make_problem(a: int, op: str, b: int) -> Problem:
    """Prompt "a op b =" and its answer."""
    return Problem(prompt=f"{a}{op}{b}=", answer=str(solve(a, op, b)))


def _problem_key(index: int, space: ProblemSpace) -> tuple[int, str, int]:
    operations = sorted(set(space.operations))
    operands = operand_range(space)
    op_index, rest = divmod(index, len(operands) ** 2)
    a, b = divmod(rest, len(operands))
    return operands[a], operations[op_index], operands[b]


def draw_problem_indices(cfg: TaskConfig, space: ProblemSpace) -> list[int]:
    """``num_eval + num_train`` distinct problem indices in draw order (eval first), fixed by ``cfg.seed``."""
    rng = random.Random(cfg.seed)
    universe = problem_universe_size(space)
    wanted = cfg.num_eval + cfg.num_train
    if universe <= _ENUMERATE_BELOW:
        indices = list(range(universe))
        rng.shuffle(indices)
        return indices[:wanted]
    drawn: dict[int, None] = {}
    while len(drawn) < wanted:
        drawn.setdefault(rng.randrange(universe))
    return list(drawn)


def longest_answer_length(cfg: ProblemSpace) -> int:
    """Characters of the longest possible answer."""
    lengths = {"+": cfg.num_digits + 1, "-": cfg.num_digits + 1, "*": 2 * cfg.num_digits}
    return max(lengths[op] for op in cfg.operations)


class ArithmeticTask(CharTask):
    """Arithmetic problems, their character tokenizer, exact-match reward and garble detector.

    ``fixed_width`` and ``response_slack`` (response limit = longest possible answer + <eos> + slack) are
    properties of the problem family, not run options.
    """

    name = "arithmetic"
    answer_pattern = ANSWER_PATTERN

    def __init__(self, cfg: TaskConfig, *, fixed_width: bool = True, response_slack: int = 2) -> None:
        check_arithmetic_config(cfg, fixed_width)
        self.cfg = cfg
        space = ProblemSpace.of(cfg, fixed_width)
        self.tokenizer: CharTokenizer = build_char_tokenizer(ALPHABET)
        problems = [make_problem(*_problem_key(index, space)) for index in draw_problem_indices(cfg, space)]
        self.eval_problems: list[Problem] = problems[: cfg.num_eval]
        self.train_problems: list[Problem] = problems[cfg.num_eval :]
        self.eval_sets: dict[str, list[Problem]] = {HELDOUT: self.eval_problems}
        self.max_response_tokens: int = longest_answer_length(space) + 1 + response_slack
        self._answer_ids = frozenset(self.tokenizer.encode(ANSWER_CHARS, add_bos=False))

    def reward(self, problem: Problem, response_ids: Sequence[int]) -> float:
        """1.0 iff <eos> came in time and every token before it spells exactly the answer (canonical form)."""
        body, has_eos = self.split_at_eos(response_ids)
        if not has_eos or any(token not in self._answer_ids for token in body):
            return 0.0
        return 1.0 if self.tokenizer.decode(body) == problem.answer else 0.0


@register_task("arithmetic", check=check_arithmetic_config)
def build_arithmetic_task(cfg: TaskConfig, model_path: str | None = None) -> ArithmeticTask:
    """Registry factory for :class:`ArithmeticTask` (it brings its own tokenizer: `model_path` is unused)."""
    return ArithmeticTask(cfg)
