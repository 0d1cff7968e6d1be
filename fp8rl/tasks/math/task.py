"""Math reasoning with verifier rewards over a real Hugging Face tokenizer: the paper's workload as a Task.

Prompts. DAPO-Math-17K's user message already carries its instruction (answer on a last line ``Answer: ...``)
and is used as given; every other data set (DeepScaleR and the eval sets) gets verl's instruction appended
after a space: ``<problem> Let's think step by step and output the final answer within \\boxed{}.``. With
``chat_template`` the text is one user message rendered by the tokenizer's chat template with the generation
prompt (Qwen: ``<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``); without it (base models) the
text is tokenized as is, with the tokenizer's own BOS if it adds one.

Responses. A response is the sampled ids up to ``max_response_tokens``; it ends at its first end-of-sequence id
(``tokenizer.eos_ids``: every id the tokenizer, ``config.json`` and ``generation_config.json`` name). Reward:
1.0 iff it ended in time, holds no invalid token, and its final answer (``\\boxed{}`` or ``Answer:``) equals the
ground truth under math-verify (:mod:`fp8rl.tasks.math.reward`), else 0.0. ``garble_reason``: "invalid_token"
(an id >= the tokenizer's length, i.e. a padding row of the model's vocabulary, or a special token other than
EOS), then "no_eos", then "unparseable" (no final answer can be extracted), else None.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fp8rl.config import ConfigError, TaskConfig
from fp8rl.tasks.base import Problem, register_task
from fp8rl.tasks.math.reward import extract_final_answer, math_rewards
from fp8rl.tasks.math.sources import DatasetError, get_source, load_problem_rows

VERL_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
PROMPTS_AS_GIVEN = frozenset({"dapo_math_17k"})  # data sets whose prompt already says how to answer
DEFAULT_EVAL_SETS = ("aime24", "aime25", "amc23", "math500")


DEFAULT_MAX_RESPONSE_TOKENS = 1024  # task.max_response_tokens=None (the paper: 8K-16K on GPUs)
REWARD_TIMEOUT_S = 5.0  # wall-clock bound per verified response


OVERLONG_PROMPT_POLICIES = ("refuse", "filter")


def check_math_config(cfg: TaskConfig) -> None:
    """The math task's own config check (registry names are checked by fp8rl.choices)."""
    if cfg.dataset is None:
        raise ValueError("task.name=math needs task.dataset (dapo_math_17k or deepscaler)")
    for name in [cfg.dataset, *cfg.eval_sets]:
        get_source(name)  # raises with the valid names
    if cfg.overlong_prompts not in OVERLONG_PROMPT_POLICIES:
        valid = list(OVERLONG_PROMPT_POLICIES)
        raise ValueError(f"task.overlong_prompts={cfg.overlong_prompts!r}; choose one of {valid}")
    if cfg.max_response_tokens is not None and cfg.max_response_tokens < 1:
        raise ValueError(f"task.max_response_tokens={cfg.max_response_tokens}; use at least 1")


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _ids(value: Any) -> list[int]:
    """A config's ``eos_token_id`` (int, list of ints or None) as a list."""
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _json_field(folder: Path, file_name: str, key: str) -> Any:
    path = folder / file_name
    return json.loads(path.read_text()).get(key) if path.exists() else None


class HFTokenizer:
    """A ``transformers`` tokenizer seen through the task protocol.

    ``vocab_size``: every token id the tokenizer knows, added and special tokens included (``len(tokenizer)``;
    the model's embedding may have more, padding rows). ``eos_ids``: the ids that end a response, in the order
    tokenizer, config.json, generation_config.json. ``pad_id``: the pad token, else the first EOS id.
    ``special_ids``: ids of special tokens (EOS included). ``hf``: the wrapped tokenizer.
    """

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int]) -> None:
        if not eos_ids:
            raise ConfigError(
                "the tokenizer has no end-of-sequence token; set eos_token in tokenizer_config.json "
                "or eos_token_id in generation_config.json"
            )
        self.hf = tokenizer
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self.vocab_size: int = len(tokenizer)
        self.pad_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        added_special = [i for i, token in tokenizer.added_tokens_decoder.items() if token.special]
        self.special_ids: frozenset[int] = frozenset([*tokenizer.all_special_ids, *added_special, *self.eos_ids])

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> HFTokenizer:
        """Load ``AutoTokenizer`` from a local folder; EOS ids from the tokenizer and the folder's configs."""
        folder = Path(folder).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(
                f"tokenizer folder {folder} does not exist; set model.hf_path=<local Hugging "
                "Face model folder with tokenizer files>"
            )
        from transformers import AutoTokenizer  # heavy import, only when a task is built

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        eos_ids = [
            *_ids(tokenizer.eos_token_id),
            *_ids(_json_field(folder, "config.json", "eos_token_id")),
            *_ids(_json_field(folder, "generation_config.json", "eos_token_id")),
        ]
        return cls(tokenizer, eos_ids)

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer defines a chat template."""
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens added."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens dropped unless ``skip_special_tokens`` is False."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


# ---------------------------------------------------------------------------------------------
# The task


def with_instruction(dataset: str, problem: Problem) -> Problem:
    """The problem as the model sees it: DAPO prompts as given, others with verl's instruction appended."""
    if dataset in PROMPTS_AS_GIVEN:
        return problem
    return Problem(prompt=f"{problem.prompt} {VERL_INSTRUCTION}", answer=problem.answer)


def load_task_problems(
    dataset: str, path: str | None, split: str | None = None, setting: str = "task.path"
) -> list[Problem]:
    """:func:`load_problems` of a data set with the instruction the task adds."""
    return [problem for problem, _ in load_task_problem_rows(dataset, path, split, setting)]


def load_task_problem_rows(
    dataset: str, path: str | None, split: str | None = None, setting: str = "task.path"
) -> list[tuple[Problem, str]]:
    """:func:`load_problem_rows` (problem, where its row is) with the instruction the task adds."""
    rows = load_problem_rows(dataset, path, split, setting=setting)
    return [(with_instruction(dataset, problem), where) for problem, where in rows]


def refuse_empty_sets(
    cfg: TaskConfig, train: Sequence[Problem], eval_sets: dict[str, list[Problem]], reason: str = ""
) -> None:
    """A data set without problems is refused before anything trains (an empty training set would fail at the
    first step; an empty benchmark would report an accuracy of NaN and exit 0). ``reason``: why it is empty, when
    something other than the files emptied it (the over-long prompt filter)."""
    if not train:
        where = cfg.path or f"the hub's {cfg.dataset}"
        why = f" {reason}" if reason else ""
        raise DatasetError(
            f"task.dataset={cfg.dataset}: {where} holds no problems{why} (split {cfg.split or 'default'}, "
            f"task.num_train={cfg.num_train}); point task.path at a file or folder with problems, or raise "
            "task.num_train"
        )
    for name, problems in eval_sets.items():
        if not problems:
            why = f" {reason}" if reason else ""
            raise DatasetError(
                f"task.eval_sets: {name} from {cfg.eval_paths.get(name, 'the hub')} holds no problems{why}; fix "
                f"task.eval_paths.{name} or drop {name} from task.eval_sets"
            )


class MathTask:
    """Math problems from the registered data sets, a Hugging Face tokenizer, verifier rewards, garble reasons.

    Configured by the run's `TaskConfig`: ``dataset``/``path``/``split`` (training data), ``eval_sets`` with
    ``eval_paths`` (local files; the hub where none is given), ``chat_template``, ``max_response_tokens``,
    ``num_train`` (at most this many training problems, after a ``seed``-ed shuffle). The tokenizer comes
    from `tokenizer_path` (the policy's checkpoint folder).
    """

    name = "math"

    def __init__(self, cfg: TaskConfig, tokenizer_path: str | None = None, tokenizer: HFTokenizer | None = None):
        check_math_config(cfg)
        self.cfg = cfg
        if tokenizer is None and not tokenizer_path:
            raise ConfigError("the math task uses the model's tokenizer: set model.hf_path=<checkpoint folder>")
        self.tokenizer = tokenizer or HFTokenizer.from_pretrained(tokenizer_path)
        if cfg.chat_template and not self.tokenizer.has_chat_template:
            raise ConfigError(
                f"the tokenizer from {tokenizer_path or 'the given object'} has no chat template; set "
                "task.chat_template=false to use raw prompts (base models), or use a tokenizer with one"
            )
        self.max_response_tokens = cfg.max_response_tokens or DEFAULT_MAX_RESPONSE_TOKENS
        train = load_task_problem_rows(cfg.dataset, cfg.path, cfg.split)
        eval_rows = {
            name: load_task_problem_rows(name, cfg.eval_paths.get(name), setting=f"task.eval_paths.{name}")
            for name in cfg.eval_sets
        }
        self.origins: dict[Problem, str] = {}  # where each problem's (first) row is: "<file>, line N"
        for rows in (train, *eval_rows.values()):
            self.origins.update((problem, where) for problem, where in rows if problem not in self.origins)
        problems = [problem for problem, _ in train]
        random.Random(cfg.seed).shuffle(problems)
        self.train_problems: list[Problem] = problems[: cfg.num_train]
        self.eval_sets: dict[str, list[Problem]] = {
            name: [problem for problem, _ in rows] for name, rows in eval_rows.items()
        }
        refuse_empty_sets(cfg, self.train_problems, self.eval_sets)

    def fit_prompts(self, max_seq_len: int) -> dict[str, int]:
        """Keep the prompts that leave the response limit room in the trainer's sequence of `max_seq_len` tokens:
        ``task.overlong_prompts=refuse`` raises `DatasetError` (the count per set, and the longest prompt's length
        and row), ``filter`` drops them. Returns the count dropped per set ("train", each benchmark)."""
        limit = max_seq_len - self.max_response_tokens
        if limit < 1:
            raise DatasetError(
                f"the trainer's sequence ({max_seq_len} tokens) leaves no room for a prompt after the response limit "
                f"({self.max_response_tokens}): lower task.max_response_tokens or raise parallel.max_seq_len"
            )
        sets = {"train": self.train_problems, **self.eval_sets}
        lengths = {name: [len(self.prompt_ids(p)) for p in problems] for name, problems in sets.items()}
        over = {name: sum(n > limit for n in values) for name, values in lengths.items()}
        if any(over.values()) and self.cfg.overlong_prompts == "refuse":
            counts = []
            for name, n in over.items():
                if n:
                    length, longest = max(zip(lengths[name], sets[name], strict=True), key=lambda pair: pair[0])
                    where = self.origins.get(longest, "its data set")
                    counts.append(f"{name} {n} (the longest has {length} tokens: {where})")
            raise DatasetError(
                f"prompts longer than {limit} tokens (parallel.max_seq_len {max_seq_len} - response limit "
                f"{self.max_response_tokens}): {', '.join(counts)}. Set task.overlong_prompts=filter to drop them, "
                "lower task.max_response_tokens, or raise parallel.max_seq_len"
            )
        self.train_problems = [p for p, n in zip(self.train_problems, lengths["train"], strict=True) if n <= limit]
        self.eval_sets = {
            name: [p for p, n in zip(problems, lengths[name], strict=True) if n <= limit]
            for name, problems in self.eval_sets.items()
        }
        reason = f"left after dropping prompts longer than {limit} tokens (task.overlong_prompts=filter)"
        refuse_empty_sets(self.cfg, self.train_problems, self.eval_sets, reason if any(over.values()) else "")
        return over

    def prompt_ids(self, problem: Problem) -> list[int]:
        """Token ids of the prompt: one user message in the chat template with the generation prompt, or the
        raw text (with the tokenizer's BOS, if it adds one)."""
        if not self.cfg.chat_template:
            return list(self.tokenizer.hf.encode(problem.prompt, add_special_tokens=True))
        messages = [{"role": "user", "content": problem.prompt}]
        text = self.tokenizer.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text)

    def _split_at_eos(self, response_ids: Sequence[int]) -> tuple[list[int], bool]:
        """Tokens before the first EOS within the length limit, and whether that EOS exists."""
        window = [int(token) for token in response_ids[: self.max_response_tokens]]
        eos = set(self.tokenizer.eos_ids)
        for position, token in enumerate(window):
            if token in eos:
                return window[:position], True
        return window, False

    def _has_invalid_token(self, body: Sequence[int]) -> bool:
        vocab, special = self.tokenizer.vocab_size, self.tokenizer.special_ids
        return any(token < 0 or token >= vocab or token in special for token in body)

    def garble_reason(self, response_ids: Sequence[int]) -> str | None:
        """ "invalid_token", "no_eos", "unparseable" (checked in this order), or None if well formed."""
        body, has_eos = self._split_at_eos(response_ids)
        if self._has_invalid_token(body):
            return "invalid_token"
        if not has_eos:
            return "no_eos"
        if extract_final_answer(self.tokenizer.decode(body)) is None:
            return "unparseable"
        return None

    def rewards(self, problems: Sequence[Problem], responses: Sequence[Sequence[int]]) -> list[float]:
        """1.0 / 0.0 per response (see the module docstring), verified in parallel worker processes."""
        if len(problems) != len(responses):
            raise ValueError(f"{len(problems)} problems but {len(responses)} responses")
        scored: list[int] = []
        texts: list[str] = []
        for index, response in enumerate(responses):
            body, has_eos = self._split_at_eos(response)
            if has_eos and not self._has_invalid_token(body):
                scored.append(index)
                texts.append(self.tokenizer.decode(body))
        rewards = [0.0] * len(responses)
        truths = [problems[index].answer for index in scored]
        scores = math_rewards(texts, truths, timeout_s=REWARD_TIMEOUT_S)
        for index, score in zip(scored, scores, strict=True):
            rewards[index] = score
        return rewards


@register_task("math", check=check_math_config)
def build_math_task(cfg: TaskConfig, model_path: str | None = None) -> MathTask:
    """Registry factory for :class:`MathTask` (the tokenizer from the model's checkpoint folder)."""
    return MathTask(cfg, model_path)
