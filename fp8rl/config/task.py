"""The task, its evaluation, and the tiny task's supervised warm start."""

from __future__ import annotations

from dataclasses import dataclass

from fp8rl.config.fields import _one_of, _require, option

JUNK_GRADINGS = ("reject", "strip")  # task.junk_grading (chain)


@dataclass(frozen=True)
class TaskConfig:
    """The verifiable-reward task: the tiny arithmetic task, or a math data set with a verifier reward."""

    name: str = option("arithmetic", "task (registry: arithmetic, math)")
    operations: str = option("+", "arithmetic: operations")
    num_digits: int = option(3, "arithmetic: operand digits")
    num_train: int = option(20000, "arithmetic: training problems")
    num_eval: int = option(256, "arithmetic: held-out problems")
    seed: int = option(0, "fixes the problem sets")
    dataset: str | None = option(None, "math: training data set (dapo_math_17k, deepscaler)", neutral=(None,))
    path: str | None = option(
        None, "math: local file or folder of the training data (None = the hub id)", neutral=(None,)
    )
    split: str | None = option(None, "math: data set split (None = the data set's default)", neutral=(None,))
    eval_sets: tuple[str, ...] = option(
        (), "math: evaluation benchmarks (aime24, aime25, amc23, math500)", neutral=((), [])
    )
    eval_paths: dict[str, str] = option(
        {}, "math: benchmark -> local file or folder (default: the hub id)", neutral=({},)
    )
    chat_template: bool = option(
        True, "math: prompt with the tokenizer's chat template (false = raw prompt)", neutral=(True,)
    )
    max_response_tokens: int | None = option(
        None, "math: response limit in tokens (None = the task's default)", neutral=(None,)
    )
    overlong_prompts: str = option(
        "refuse",
        "math: prompts too long for the trainer's sequence with the response limit: refuse (before anything is "
        "built; the count and longest named) or filter (dropped, the count logged)",
        neutral=("refuse",),
    )
    min_operands: int = option(4, "chain: fewest operands of a sum (its response lists the running sums)", neutral=(4,))
    max_operands: int = option(9, "chain: most operands of a sum", neutral=(9,))
    junk_tokens: int = option(
        16, "chain: vocabulary tokens that no prompt or answer uses (mass can leak there)", neutral=(16,)
    )
    junk_grading: str = option(
        "reject",
        "chain: reject (a response holding a junk letter earns 0) or strip (junk letters are removed before the "
        "answer is graded, as a verifier reads past garbage: the junk organism)",
        neutral=("reject",),
    )

    def __post_init__(self) -> None:
        _require(self.num_train >= 1 and self.num_eval >= 1, "task.num_train and task.num_eval must be >= 1")
        _require(
            2 <= self.min_operands <= self.max_operands,
            f"need 2 <= task.min_operands <= task.max_operands, got {self.min_operands}, {self.max_operands}",
        )
        _require(0 <= self.junk_tokens <= 26, f"task.junk_tokens={self.junk_tokens} must be in 0..26 (letters)")
        _one_of(self.junk_grading, JUNK_GRADINGS, "task.junk_grading")
        _require(1 <= self.num_digits <= 9, f"task.num_digits={self.num_digits} must be in 1..9")
        object.__setattr__(self, "eval_sets", tuple(self.eval_sets))


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation during training: greedy accuracy (tiny task) or Avg@k / Pass@k per benchmark."""

    every: int = option(10, "evaluate every N steps (and at the end); 0 = only at the end")
    size: int = option(256, "problems per evaluation (per benchmark)")
    samples: int = option(1, "samples per problem (k of Avg@k / Pass@k); 1 = one greedy answer", neutral=(1,))
    temperature: float = option(0.6, "sampling temperature when samples > 1", neutral=(0.6,))
    top_p: float = option(0.95, "nucleus mass when samples > 1", neutral=(0.95,))
    bf16: bool = option(
        False, "also evaluate in BF16 (eval/bf16/...) to separate training damage from FP8 noise", neutral=(False,)
    )

    def __post_init__(self) -> None:
        _require(self.every >= 0, f"eval.every={self.every} must be >= 0")
        _require(self.size >= 1 and self.samples >= 1, "eval.size and eval.samples must be >= 1")
        _require(self.temperature > 0 and 0 < self.top_p <= 1, "need eval.temperature > 0 and 0 < eval.top_p <= 1")


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start of the tiny task's policy (cached by config hash); not used for checkpoints."""

    steps: int = option(400, "SFT steps (0 = none)")
    batch_size: int = option(256, "SFT batch")
    lr: float = option(1e-3, "SFT learning rate (AdamW, constant)")
    weight_decay: float = option(0.0, "SFT AdamW weight decay", neutral=(0.0,))
    grad_clip: float = option(1.0, "SFT max global grad norm", neutral=(1.0,))
    precision: str = option("bf16", "SFT compute precision: fp32 or bf16 autocast", neutral=("bf16",))
    seed: int = option(0, "SFT seed (model init and batches)")
    eval_batch_size: int = option(512, "prompts per greedy-decoding batch in the warm start's evaluation", hashed=False)
    cache_dir: str = option(".cache/warmstart", "where warm starts are cached", hashed=False)
    stop_accuracy: float | None = option(
        None,
        "stop early once greedy held-out accuracy reaches this (a partly right start); None = run all steps",
        neutral=(None,),
    )
    check_every: int = option(20, "steps between the accuracy checks of stop_accuracy", neutral=(20,))
    junk_rate: float = option(
        0.0,
        "share of target tokens preceded by a random junk token of the task (chain: a letter), drawn afresh every "
        "step: a start that samples a tail of garbage (the junk organism's labelled assumption); 0 = clean data",
        neutral=(0.0,),
    )
    shipped: bool = option(
        True,
        "use the warm start shipped in fp8rl/assets/warmstart when its key matches (the same weights on every CPU); "
        "false = train it on this machine",
        hashed=False,
    )

    def __post_init__(self) -> None:
        _require(self.steps >= 0, f"warmstart.steps={self.steps} must be >= 0")
        _require(
            self.stop_accuracy is None or 0 < self.stop_accuracy <= 1,
            f"warmstart.stop_accuracy={self.stop_accuracy} must be in (0, 1] or None",
        )
        _require(0 <= self.junk_rate < 1, f"warmstart.junk_rate={self.junk_rate} must be in [0, 1)")
        _require(self.check_every >= 1, f"warmstart.check_every={self.check_every} must be >= 1")
        _one_of(self.precision, ("fp32", "bf16"), "warmstart.precision")
