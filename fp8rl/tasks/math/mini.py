"""Miniature stand-ins for the math workload: a Qwen-style tokenizer, a tiny random Qwen3 checkpoint, and data
files in each data set's published schema, all generated here (made-up problems with correct answers).

``write_mini_assets(folder)`` (or ``python -m fp8rl.tasks.math.mini --out DIR``) writes::

    DIR/model/                      tokenizer + checkpoint, loadable by AutoTokenizer / AutoModelForCausalLM
        tokenizer.json, tokenizer_config.json (with the chat template), config.json (qwen3),
        model.safetensors (fp32), generation_config.json
    DIR/data/dapo_math_17k/data/dapo-math-17k.parquet      each row twice, as the original repeats rows
    DIR/data/deepscaler/deepscaler.json                    one JSON array
    DIR/data/aime24/data/train-00000-of-00001.parquet
    DIR/data/aime25/test.jsonl
    DIR/data/amc23/test-00000-of-00001.parquet
    DIR/data/math500/test.jsonl

Tokenizer: byte-level BPE trained with ``tokenizers`` on the generated problems and solutions, Qwen2's
pre-tokenizer (digits split one by one), then the special tokens ``<|endoftext|>``, ``<|im_start|>``,
``<|im_end|>`` appended (ids ``len - 3 .. len - 1``). Like Qwen3 chat checkpoints: ``eos_token`` is
``<|im_end|>``, ``pad_token`` ``<|endoftext|>``, config.json's ``eos_token_id`` is ``<|endoftext|>`` (the base
models' EOS) and generation_config.json names both. The model's vocabulary is the tokenizer's padded to a
multiple of 64, so sampled ids can fall on padding rows.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from fp8rl.tasks.math.task import VERL_INSTRUCTION

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2 / Qwen3's pre-tokenizer split (tokenizer.json of the Qwen checkpoints): letters, single digits, punctuation.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DAPO-Math-17K's instruction format around each problem (the data set's own prompt text).
DAPO_PROMPT = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
BPE_VOCAB = 1000  # merges + byte alphabet, before the special tokens
VOCAB_MULTIPLE = 64
NAMES = ("Ana", "Ben", "Chloe", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Keiko", "Liam")
THINGS = ("apples", "marbles", "stamps", "books", "coins", "pencils", "shells", "cards", "tiles", "beads")
SUBJECTS = ("Algebra", "Prealgebra", "Number Theory", "Geometry", "Counting & Probability")


@dataclass(frozen=True)
class MadeUpProblem:
    """A generated problem: statement (LaTeX in ``$...$``), answer (LaTeX), worked solution ending in a box."""

    problem: str
    answer: str
    solution: str
    kind: str


def latex_number(value: Fraction) -> str:
    """An exact rational as an answer: ``7``, ``-3``, ``\\frac{2}{3}``, ``-\\frac{5}{4}``."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _solution(steps: str, answer: str) -> str:
    return f"{steps} The final answer is $\\boxed{{{answer}}}$."


def _collect(rng: random.Random) -> MadeUpProblem:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 400), rng.randint(2, 400)
    problem = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
    return MadeUpProblem(
        problem, str(a + b), _solution(f"{name} has ${a} + {b} = {a + b}$ {thing}.", str(a + b)), "integer"
    )


def _boxes(rng: random.Random) -> MadeUpProblem:
    thing, per_box, boxes = rng.choice(THINGS), rng.randint(2, 40), rng.randint(2, 24)
    total = per_box * boxes
    problem = f"A box holds {per_box} {thing}. How many {thing} are in {boxes} boxes?"
    return MadeUpProblem(
        problem, str(total), _solution(f"${per_box} \\times {boxes} = {total}$.", str(total)), "integer"
    )


def _remainder(rng: random.Random) -> MadeUpProblem:
    n, m = rng.randint(100, 9999), rng.randint(3, 97)
    problem = f"What is the remainder when ${n}$ is divided by ${m}$?"
    steps = f"${n} = {m} \\cdot {n // m} + {n % m}$."
    return MadeUpProblem(problem, str(n % m), _solution(steps, str(n % m)), "integer")


def _rectangle(rng: random.Random) -> MadeUpProblem:
    length, width = rng.randint(2, 31), rng.randint(2, 31)
    area = length * width
    problem = f"A rectangle is {length} cm long and {width} cm wide. What is its area in square centimeters?"
    return MadeUpProblem(
        problem, str(area), _solution(f"The area is ${length} \\cdot {width} = {area}$.", str(area)), "integer"
    )


def _difference(rng: random.Random) -> MadeUpProblem:
    a, b = rng.randint(-200, 200), rng.randint(-200, 200)
    problem = f"Compute ${a} - ({b})$."
    return MadeUpProblem(problem, str(a - b), _solution(f"${a} - ({b}) = {a - b}$.", str(a - b)), "signed")


def _linear(rng: random.Random) -> MadeUpProblem:
    a = rng.choice([n for n in range(-9, 10) if n not in (0, 1)])
    b, c = rng.randint(-30, 30), rng.randint(-30, 30)
    x = Fraction(c - b, a)
    answer = latex_number(x)
    problem = f"Solve for $x$: ${a}x + {b} = {c}$."
    steps = f"Subtract ${b}$ from both sides: ${a}x = {c - b}$, so $x = {answer}$."
    return MadeUpProblem(problem, answer, _solution(steps, answer), "rational")


def _fraction_sum(rng: random.Random) -> MadeUpProblem:
    p, q = rng.randint(1, 9), rng.randint(2, 12)
    r, s = rng.randint(1, 9), rng.randint(2, 12)
    total = Fraction(p, q) + Fraction(r, s)
    answer = latex_number(total)
    problem = f"Compute $\\frac{{{p}}}{{{q}}} + \\frac{{{r}}}{{{s}}}$ as a fraction in lowest terms."
    steps = f"With the common denominator ${q * s}$: $\\frac{{{p * s + r * q}}}{{{q * s}}} = {answer}$."
    return MadeUpProblem(problem, answer, _solution(steps, answer), "rational")


def _square_root(rng: random.Random) -> MadeUpProblem:
    outer, inner = rng.randint(2, 12), rng.choice([2, 3, 5, 6, 7, 10, 11, 13])
    radicand = outer * outer * inner
    answer = f"{outer}\\sqrt{{{inner}}}"
    problem = f"Simplify $\\sqrt{{{radicand}}}$."
    steps = f"${radicand} = {outer * outer} \\cdot {inner}$ and $\\sqrt{{{outer * outer}}} = {outer}$."
    return MadeUpProblem(problem, answer, _solution(steps, answer), "radical")


def _mean(rng: random.Random) -> MadeUpProblem:
    values = [rng.randint(1, 50) for _ in range(rng.randint(3, 6))]
    mean = Fraction(sum(values), len(values))
    answer = latex_number(mean)
    listed = ", ".join(str(v) for v in values)
    problem = f"What is the mean of the numbers ${listed}$?"
    steps = f"The sum is ${sum(values)}$ and there are ${len(values)}$ numbers, so the mean is ${answer}$."
    return MadeUpProblem(problem, answer, _solution(steps, answer), "rational")


# Integer answers in 0..999 by construction (at most 800, 960, 96 and 961): AIME-style.
INTEGER_KINDS: tuple[Callable[[random.Random], MadeUpProblem], ...] = (_collect, _boxes, _remainder, _rectangle)
ALL_KINDS = (*INTEGER_KINDS, _difference, _linear, _fraction_sum, _square_root, _mean)


def made_up_problems(
    rng: random.Random, count: int, kinds: tuple[Callable[[random.Random], MadeUpProblem], ...], taken: set[str]
) -> list[MadeUpProblem]:
    """``count`` distinct problems of the given kinds whose statements are not in ``taken`` (updated)."""
    problems: list[MadeUpProblem] = []
    while len(problems) < count:
        problem = rng.choice(kinds)(rng)
        if problem.problem not in taken:
            taken.add(problem.problem)
            problems.append(problem)
    return problems


# ---------------------------------------------------------------------------------------------
# Data files in the published schemas


def _write_parquet(rows: list[dict[str, Any]], schema: Any, path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def _write_jsonl(rows: list[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_dapo(problems: list[MadeUpProblem], folder: Path) -> Path:
    """DAPO-Math-17K's parquet (chat prompt with its instruction; integer ground truths; rows repeated twice)."""
    import pyarrow as pa

    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            ("extra_info", pa.struct([("index", pa.string())])),
        ]
    )
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": DAPO_PROMPT.format(problem=p.problem), "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": p.answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"mini-{i:05d}"},
        }
        for i, p in enumerate(problems)
    ]
    return _write_parquet(rows + rows, schema, folder / "data" / "dapo-math-17k.parquet")


def write_deepscaler(problems: list[MadeUpProblem], folder: Path) -> Path:
    """DeepScaleR's single JSON array of {problem, answer, solution}."""
    rows = [{"problem": p.problem, "answer": p.answer, "solution": p.solution} for p in problems]
    path = folder / "deepscaler.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1))
    return path


def write_aime24(problems: list[MadeUpProblem], folder: Path) -> Path:
    """HuggingFaceH4/aime_2024's parquet: id, problem, solution, answer (string), url, year (string)."""
    import pyarrow as pa

    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("problem", pa.string()),
            ("solution", pa.string()),
            ("answer", pa.string()),
            ("url", pa.string()),
            ("year", pa.string()),
        ]
    )
    rows = [
        {
            "id": 60 + i,
            "problem": p.problem,
            "solution": p.solution,
            "answer": p.answer,
            "url": f"https://example.invalid/mini/aime24/{i + 1}",
            "year": "2024",
        }
        for i, p in enumerate(problems)
    ]
    return _write_parquet(rows, schema, folder / "data" / "train-00000-of-00001.parquet")


def write_aime25(problems: list[MadeUpProblem], folder: Path) -> Path:
    """math-ai/aime25's test.jsonl: problem, answer, id."""
    rows = [{"problem": p.problem, "answer": p.answer, "id": str(i)} for i, p in enumerate(problems)]
    return _write_jsonl(rows, folder / "test.jsonl")


def write_amc23(problems: list[MadeUpProblem], folder: Path) -> Path:
    """math-ai/amc23's parquet: id, question, answer (a number, float64), url."""
    import pyarrow as pa

    schema = pa.schema([("id", pa.int64()), ("question", pa.string()), ("answer", pa.float64()), ("url", pa.string())])
    rows = [
        {
            "id": i,
            "question": p.problem,
            "answer": float(p.answer),
            "url": f"https://example.invalid/mini/amc23/{i + 1}",
        }
        for i, p in enumerate(problems)
    ]
    return _write_parquet(rows, schema, folder / "test-00000-of-00001.parquet")


def write_math500(problems: list[MadeUpProblem], folder: Path, rng: random.Random) -> Path:
    """HuggingFaceH4/MATH-500's test.jsonl: problem, solution, answer, subject, level, unique_id."""
    rows = [
        {
            "problem": p.problem,
            "solution": p.solution,
            "answer": p.answer,
            "subject": rng.choice(SUBJECTS),
            "level": rng.randint(1, 5),
            "unique_id": f"test/mini/{i}.json",
        }
        for i, p in enumerate(problems)
    ]
    return _write_jsonl(rows, folder / "test.jsonl")


# ---------------------------------------------------------------------------------------------
# Tokenizer and checkpoint


def corpus(problems: list[MadeUpProblem]) -> list[str]:
    """Training text for the tokenizer: prompts in both instruction styles, solutions and answer lines."""
    texts = []
    for p in problems:
        texts += [
            DAPO_PROMPT.format(problem=p.problem),
            f"{p.problem} {VERL_INSTRUCTION}",
            p.solution,
            f"Answer: {p.answer}",
        ]
    return texts


def train_tokenizer(texts: list[str], vocab_size: int = BPE_VOCAB) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` with Qwen's pre-tokenizer and the three special tokens last."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def save_tokenizer(tokenizer: Any, folder: Path, model_max_length: int) -> None:
    """Save as a Hugging Face tokenizer folder: tokenizer.json and tokenizer_config.json (chat template inside)."""
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf_tokenizer.save_pretrained(str(folder))
    # The layout Qwen's repositories publish, which older transformers and serving engines read too: the generic
    # fast-tokenizer class and the chat template inside tokenizer_config.json.
    config_path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def padded_vocab(size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """``size`` rounded up to a multiple of ``multiple``."""
    return -(-size // multiple) * multiple


def save_checkpoint(folder: Path, vocab_size: int, endoftext_id: int, im_end_id: int, seed: int) -> None:
    """A randomly initialised 2-layer Qwen3 (hidden 64, 4 query / 2 KV heads of 32, tied embeddings) in fp32."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=endoftext_id,
        pad_token_id=endoftext_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float()
    model.generation_config = GenerationConfig(
        eos_token_id=[im_end_id, endoftext_id], pad_token_id=endoftext_id, bos_token_id=None
    )
    model.save_pretrained(str(folder))


def write_mini_assets(folder: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tokenizer + checkpoint folder and one data folder per registered data set; returns their paths
    (``"model"`` and the data set names). Deterministic in ``seed``; takes seconds."""
    folder = Path(folder)
    rng = random.Random(seed)
    taken: set[str] = set()
    splits = {
        "aime24": made_up_problems(rng, 30, INTEGER_KINDS, taken),
        "aime25": made_up_problems(rng, 30, INTEGER_KINDS, taken),
        "amc23": made_up_problems(rng, 40, INTEGER_KINDS, taken),
        "math500": made_up_problems(rng, 100, ALL_KINDS, taken),
        "dapo_math_17k": made_up_problems(rng, 256, INTEGER_KINDS, taken),
        "deepscaler": made_up_problems(rng, 256, ALL_KINDS, taken),
    }
    data = folder / "data"
    paths = {name: data / name for name in splits}
    write_dapo(splits["dapo_math_17k"], paths["dapo_math_17k"])
    write_deepscaler(splits["deepscaler"], paths["deepscaler"])
    write_aime24(splits["aime24"], paths["aime24"])
    write_aime25(splits["aime25"], paths["aime25"])
    write_amc23(splits["amc23"], paths["amc23"])
    write_math500(splits["math500"], paths["math500"], rng)

    model_dir = folder / "model"
    extra = made_up_problems(rng, 3000, ALL_KINDS, taken)  # tokenizer text beyond the data files
    tokenizer = train_tokenizer(corpus([*extra, *(p for problems in splits.values() for p in problems)]))
    save_tokenizer(tokenizer, model_dir, model_max_length=2048)
    vocab = padded_vocab(tokenizer.get_vocab_size())
    save_checkpoint(model_dir, vocab, tokenizer.token_to_id(ENDOFTEXT), tokenizer.token_to_id(IM_END), seed)
    return {"model": model_dir, **paths}


def main(argv: list[str] | None = None) -> None:
    """``python -m fp8rl.tasks.math.mini --out DIR [--seed N]``: write the mini assets and list them."""
    parser = argparse.ArgumentParser(prog="fp8rl mini-assets", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write into (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="fixes the problems, the tokenizer and the weights")
    args = parser.parse_args(argv)
    for name, path in write_mini_assets(args.out, seed=args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
