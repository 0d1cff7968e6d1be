"""The mini assets: a Qwen-style tokenizer, a tiny Qwen3 checkpoint that transformers and the megatron import load
with the same logits, and data files every loader reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp8rl.tasks.math import DATASETS, load_problems, math_rewards
from fp8rl.tasks.math.mini import CHAT_TEMPLATE, main, padded_vocab


@pytest.fixture(scope="module")
def tokenizer(mini_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(mini_assets["model"])


def test_tokenizer_round_trips_math_text_and_knows_the_special_tokens(tokenizer):
    text = "Solve for $x$: $-3x + 12 = 0$. So $x = \\frac{12}{3}$, i.e. \\boxed{4}.\nAnswer: 4 é ∑"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(ids) < 0.7 * len(text.encode())  # BPE merges, not bytes
    assert len(tokenizer.encode(" apples", add_special_tokens=False)) == 1  # a frequent word of the corpus
    specials = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert specials == [len(tokenizer) - 3, len(tokenizer) - 2, len(tokenizer) - 1]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert 512 <= len(tokenizer) <= 1024


def test_digits_are_single_tokens(tokenizer):
    assert [tokenizer.decode([i]) for i in tokenizer.encode("2025", add_special_tokens=False)] == list("2025")


def test_chat_template_is_qwen_style(tokenizer):
    assert tokenizer.chat_template == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "Answer: 2"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\nAnswer: 2<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_checkpoint_configs(mini_assets, tokenizer):
    config = json.loads((mini_assets["model"] / "config.json").read_text())
    generation = json.loads((mini_assets["model"] / "generation_config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["vocab_size"] == padded_vocab(len(tokenizer)) and config["vocab_size"] % 64 == 0
    assert config["vocab_size"] > len(tokenizer)  # padding rows exist, as in real checkpoints
    endoftext, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert config["eos_token_id"] == endoftext and generation["eos_token_id"] == [im_end, endoftext]
    assert (mini_assets["model"] / "model.safetensors").exists()


def set_up_megatron() -> None:
    """The package's explicit megatron set-up where it has one (``fp8rl.models.runtime``); without it,
    building a model sets megatron up by itself."""
    try:
        from fp8rl.models.runtime import init_megatron
    except ModuleNotFoundError:
        return
    init_megatron()


def test_checkpoint_loads_in_transformers_and_megatron_with_the_same_logits(mini_assets, tokenizer):
    from transformers import AutoModelForCausalLM

    from fp8rl.models.hf import load_hf_checkpoint
    from fp8rl.models.logprobs import forward_logits

    set_up_megatron()
    hf_model = AutoModelForCausalLM.from_pretrained(mini_assets["model"], attn_implementation="eager").eval()
    assert type(hf_model).__name__ == "Qwen3ForCausalLM"
    cfg, model = load_hf_checkpoint(mini_assets["model"])
    assert cfg.vocab_size == hf_model.config.vocab_size and cfg.tie_embeddings
    input_ids = torch.tensor([tokenizer.encode("Compute $3 + 4$. Answer: 7", add_special_tokens=False)])
    with torch.no_grad():
        expected = hf_model(input_ids=input_ids).logits.float()
        logits = forward_logits(model.eval(), input_ids, torch.ones_like(input_ids)).float()
    assert logits.shape == expected.shape == (1, input_ids.shape[1], cfg.vocab_size)
    assert expected.std() > 0.05  # a random model, but not a trivially flat one
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


def test_every_data_set_loads_from_its_mini_folder_with_correct_answers(mini_assets):
    sizes = {}
    for name in DATASETS:
        problems = load_problems(name, str(mini_assets[name]))
        sizes[name] = len(problems)
        solutions = [f"So the result is $\\boxed{{{p.answer}}}$." for p in problems]
        assert math_rewards(solutions, [p.answer for p in problems]) == [1.0] * len(problems)
    assert sizes == {"dapo_math_17k": 256, "deepscaler": 256, "aime24": 30, "aime25": 30, "amc23": 40, "math500": 100}


def test_mini_problem_sets_are_disjoint(mini_assets):
    statements = {name: {p.prompt for p in load_problems(name, str(mini_assets[name]))} for name in DATASETS}
    dapo = {prompt.split("\n\n")[1] for prompt in statements.pop("dapo_math_17k")}
    sets = [dapo, *statements.values()]
    assert sum(len(s) for s in sets) == len(set().union(*sets))


def test_aime_answers_are_integers_below_1000(mini_assets):
    for name in ("aime24", "aime25"):
        assert all(0 <= int(p.answer) < 1000 for p in load_problems(name, str(mini_assets[name])))


def test_command_line_writes_the_same_assets(mini_assets, tmp_path, capsys):
    main(["--out", str(tmp_path), "--seed", "0"])
    listed = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert set(listed) == {"model", *DATASETS}
    for name, path in listed.items():
        written = sorted(p.relative_to(path) for p in Path(path).rglob("*") if p.is_file())
        expected = sorted(p.relative_to(mini_assets[name]) for p in mini_assets[name].rglob("*") if p.is_file())
        assert written == expected
    for name in DATASETS:
        assert load_problems(name, listed[name]) == load_problems(name, str(mini_assets[name]))
