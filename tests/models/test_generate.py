import math

import pytest
import torch
from megatron.core.inference.contexts import StaticInferenceContext

from fp8rl.models.generate import SamplingConfig, generate, sample_tokens, top_p_filter
from fp8rl.models.gpt import fp8_autocast
from fp8rl.models.logprobs import (
    causal_padding_mask,
    decode_step_mask,
    forward_logits,
    left_pad,
    token_logprobs_and_entropy,
)

EOS, PAD = 2, 0
PROMPTS = [[1, 5, 6, 14, 7], [1, 9], [1, 8, 8, 16, 4, 5, 17]]


def row_seeds(seed: int, rows: int) -> list[int]:
    """One sampling seed per row (rows of one batch sample independently)."""
    return [seed * 1000 + row for row in range(rows)]


def prompt_batch():
    return left_pad(PROMPTS, pad_id=PAD)


def test_kv_cached_decoding_gives_the_full_forward_logits(tiny_model):
    """Prefill a left-padded prompt batch, then feed the continuation one token at a time."""
    tiny_model.eval()
    prompt_ids, prompt_mask = prompt_batch()
    continuation = torch.randint(3, 18, (3, 5), generator=torch.Generator().manual_seed(0))
    input_ids = torch.cat([prompt_ids, continuation], 1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(continuation)], 1)
    prompt_len = prompt_ids.size(1)
    with torch.no_grad():
        full = forward_logits(tiny_model, input_ids, attention_mask)
        ctx = StaticInferenceContext(max_batch_size=3, max_sequence_length=input_ids.size(1))
        prefill = tiny_model(
            prompt_ids, None, causal_padding_mask(prompt_mask), inference_context=ctx, runtime_gather_output=True
        )
        torch.testing.assert_close(prefill[:, -1], full[:, prompt_len - 1], atol=1e-5, rtol=0)
        ctx.sequence_len_offset = prompt_len
        ctx.enable_decode_mode()
        for step in range(continuation.size(1)):
            seen = attention_mask[:, : prompt_len + step + 1]
            step_logits = tiny_model(
                continuation[:, step : step + 1],
                None,
                decode_step_mask(seen),
                inference_context=ctx,
                runtime_gather_output=True,
            )
            ctx.sequence_len_offset += 1
            torch.testing.assert_close(step_logits[:, -1], full[:, prompt_len + step], atol=1e-5, rtol=0)


def test_greedy_generation_is_argmax_of_the_full_forward(tiny_model):
    prompt_ids, prompt_mask = prompt_batch()
    cfg = SamplingConfig(max_new_tokens=6, eos_token_ids=(EOS,), pad_token_id=PAD, temperature=0.0)
    out = generate(tiny_model, prompt_ids, prompt_mask, cfg)
    sequence, mask = prompt_ids, prompt_mask
    with torch.no_grad():
        for step in range(6):
            expected = forward_logits(tiny_model, sequence, mask)[:, -1].argmax(-1)
            alive = out.response_mask[:, step].bool()
            assert torch.equal(out.tokens[alive, step], expected[alive])
            sequence = torch.cat([sequence, out.tokens[:, step : step + 1]], 1)
            mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)


def test_sampled_logprobs_match_the_trainer_recompute(tiny_model):
    prompt_ids, prompt_mask = prompt_batch()
    cfg = SamplingConfig(max_new_tokens=7, eos_token_ids=(EOS,), pad_token_id=PAD, temperature=0.8)
    out = generate(tiny_model, prompt_ids, prompt_mask, cfg, seeds=row_seeds(1, len(prompt_ids)))
    input_ids = torch.cat([prompt_ids, out.tokens], 1)
    attention_mask = torch.cat([prompt_mask, out.response_mask], 1)
    with torch.no_grad():
        logp, entropy = token_logprobs_and_entropy(tiny_model, input_ids, attention_mask, 7, temperature=0.8)
    valid = out.response_mask.bool()
    torch.testing.assert_close(out.logprobs[valid], logp[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy[valid], entropy[valid], atol=1e-5, rtol=0)


def test_a_vocab_limit_keeps_padding_rows_out_of_samples_and_log_probs(tiny_model, tiny_cfg):
    """The embedding has padding rows past the tokenizer's ids (18 of 64 here): never sampled with the
    limit, and the trainer's recompute with the same limit scores the same distribution."""
    vocab = 18
    assert tiny_cfg.vocab_size > vocab
    prompt_ids, prompt_mask = left_pad(PROMPTS * 4, pad_id=PAD)
    outs = {}
    for limit in (None, vocab):
        cfg = SamplingConfig(7, eos_token_ids=(EOS,), pad_token_id=PAD, temperature=0.8, vocab_size=limit)
        outs[limit] = generate(tiny_model, prompt_ids, prompt_mask, cfg, seeds=row_seeds(1, len(prompt_ids)))
    assert bool((outs[None].tokens >= vocab).any())  # a random-init model puts most mass on padding rows
    out = outs[vocab]
    assert bool((out.tokens < vocab).all())
    input_ids = torch.cat([prompt_ids, out.tokens], 1)
    attention_mask = torch.cat([prompt_mask, out.response_mask], 1)
    with torch.no_grad():
        logp, entropy = token_logprobs_and_entropy(tiny_model, input_ids, attention_mask, 7, 0.8, vocab_size=vocab)
    valid = out.response_mask.bool()
    torch.testing.assert_close(out.logprobs[valid], logp[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy[valid], entropy[valid], atol=1e-5, rtol=0)
    assert float(entropy[valid].max()) <= math.log(vocab) + 1e-5


class EosBiasedModel(torch.nn.Module):
    """The tiny model with ``bias`` added to the <eos> logit, so rows end at different steps."""

    def __init__(self, model: torch.nn.Module, bias: float) -> None:
        super().__init__()
        self.model, self.bias = model, bias

    def forward(self, *args, **kwargs):
        logits = self.model(*args, **kwargs)
        logits[..., EOS] += self.bias
        return logits


def test_rows_stop_at_eos_and_are_padded_after_it(tiny_model):
    prompt_ids, prompt_mask = left_pad(PROMPTS * 4, pad_id=PAD)
    cfg = SamplingConfig(max_new_tokens=8, eos_token_ids=(EOS,), pad_token_id=PAD, temperature=1.0)
    seeds = row_seeds(0, len(prompt_ids))
    out = generate(EosBiasedModel(tiny_model, 4.0), prompt_ids, prompt_mask, cfg, seeds=seeds)
    lengths = []
    for row in range(len(prompt_ids)):
        tokens, mask = out.tokens[row].tolist(), out.response_mask[row].tolist()
        length = tokens.index(EOS) + 1 if EOS in tokens else len(tokens)
        lengths.append(length)
        assert mask == [1] * length + [0] * (8 - length)
        assert tokens[length:] == [PAD] * (8 - length)
        assert (out.logprobs[row, length:] == 0).all() and (out.logprobs[row, :length] < 0).all()
    assert len(set(lengths)) > 2  # rows really stopped at different steps


def test_greedy_eos_ends_every_row_at_once(tiny_model):
    prompt_ids, prompt_mask = prompt_batch()
    cfg = SamplingConfig(max_new_tokens=5, eos_token_ids=(EOS,), pad_token_id=PAD, temperature=0.0)
    out = generate(EosBiasedModel(tiny_model, 1e4), prompt_ids, prompt_mask, cfg)
    assert out.tokens.tolist() == [[EOS, PAD, PAD, PAD, PAD]] * 3
    assert out.response_mask.tolist() == [[1, 0, 0, 0, 0]] * 3


def test_a_rows_sample_depends_on_its_seed_not_on_the_rest_of_the_batch(tiny_model):
    """Data parallelism splits a step's rows over ranks: a row must sample the same response alone or in the
    whole batch (inverse-CDF sampling from the row's own uniforms)."""
    prompt_ids, prompt_mask = left_pad(PROMPTS * 4, pad_id=PAD)
    cfg = SamplingConfig(max_new_tokens=6, eos_token_ids=(EOS,), pad_token_id=PAD, temperature=1.0)
    seeds = row_seeds(5, len(prompt_ids))
    whole = generate(tiny_model, prompt_ids, prompt_mask, cfg, seeds=seeds)
    half = len(prompt_ids) // 2
    second = generate(tiny_model, prompt_ids[half:], prompt_mask[half:], cfg, seeds=seeds[half:])
    assert torch.equal(whole.tokens[half:], second.tokens)
    other = generate(tiny_model, prompt_ids, prompt_mask, cfg, seeds=row_seeds(6, len(prompt_ids)))
    assert not torch.equal(whole.tokens, other.tokens)


def test_inverse_cdf_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]])).expand(20000, 3)
    cfg = SamplingConfig(max_new_tokens=1, eos_token_ids=(0,), pad_token_id=0, temperature=1.0)
    tokens = sample_tokens(logits, cfg, torch.rand(20000, generator=torch.Generator().manual_seed(0)))
    frequencies = torch.bincount(tokens, minlength=3).float() / 20000
    torch.testing.assert_close(frequencies, torch.tensor([0.1, 0.6, 0.3]), atol=0.015, rtol=0)


def test_sampling_is_reproducible_with_a_seeded_generator_and_restores_train_mode(tiny_model):
    tiny_model.train()
    prompt_ids, prompt_mask = prompt_batch()
    cfg = SamplingConfig(max_new_tokens=6, eos_token_ids=(EOS,), pad_token_id=PAD, top_p=0.9)
    first = generate(tiny_model, prompt_ids, prompt_mask, cfg, seeds=row_seeds(3, len(prompt_ids)))
    second = generate(tiny_model, prompt_ids, prompt_mask, cfg, seeds=row_seeds(3, len(prompt_ids)))
    assert torch.equal(first.tokens, second.tokens)
    assert tiny_model.training


def test_top_p_filter_keeps_the_smallest_covering_set():
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25]])
    kept = top_p_filter(probs, 0.7)
    torch.testing.assert_close(kept[0], torch.tensor([0.0, 0.5, 0.3, 0.0]))
    assert (kept[1] > 0).sum() == 3
    assert torch.equal(top_p_filter(probs, 1.0), probs)


@pytest.mark.parametrize(
    "bad",
    [
        {"max_new_tokens": 0},
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"vocab_size": 0},
        {"eos_token_ids": ()},
    ],
)
def test_sampling_config_validation(bad):
    fields = {"max_new_tokens": 4, "eos_token_ids": (EOS,), "pad_token_id": PAD, **bad}
    with pytest.raises(ValueError):
        SamplingConfig(**fields)


def test_fp8_rowwise_rollout_logprobs_match_the_fp8_trainer_recompute(tiny_model):
    """Per-token activation scales make the cached and the full forward quantize identically."""
    prompt_ids, prompt_mask = prompt_batch()
    cfg = SamplingConfig(max_new_tokens=5, eos_token_ids=(EOS,), pad_token_id=PAD)
    with fp8_autocast(tiny_model, "rowwise"):
        out = generate(tiny_model, prompt_ids, prompt_mask, cfg, seeds=row_seeds(2, len(prompt_ids)))
        input_ids = torch.cat([prompt_ids, out.tokens], 1)
        attention_mask = torch.cat([prompt_mask, out.response_mask], 1)
        with torch.no_grad():
            logp, _ = token_logprobs_and_entropy(tiny_model, input_ids, attention_mask, 5)
    with torch.no_grad():
        high_precision_logp, _ = token_logprobs_and_entropy(tiny_model, input_ids, attention_mask, 5)
    valid = out.response_mask.bool()
    torch.testing.assert_close(out.logprobs[valid], logp[valid], atol=1e-4, rtol=0)
    assert not torch.allclose(out.logprobs[valid], high_precision_logp[valid], atol=1e-4, rtol=0)
