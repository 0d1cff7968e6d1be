import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8rl.models.logprobs import (
    causal_padding_mask,
    forward_logits,
    left_pad,
    logprobs_and_entropy_from_logits,
    position_ids_from_mask,
    token_logprobs_and_entropy,
)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=5, max_size=5), min_size=1, max_size=4))
def test_causal_padding_mask_matches_a_loop(rows):
    attention_mask = torch.tensor(rows, dtype=torch.long)
    mask = causal_padding_mask(attention_mask)
    for b, row in enumerate(rows):
        for q in range(5):
            for k in range(5):
                assert bool(mask[b, 0, q, k]) == (k > q or not row[k])


def test_position_ids_count_real_tokens():
    attention_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(attention_mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


def test_left_pad():
    ids, mask = left_pad([[5, 6], [7], [8, 9, 10]], pad_id=0)
    assert ids.tolist() == [[0, 5, 6], [0, 0, 7], [8, 9, 10]]
    assert mask.tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1]]


def test_logprobs_and_entropy_match_a_reference():
    logits = torch.randn(3, 5, 11)
    tokens = torch.randint(0, 11, (3, 5))
    logp, entropy = logprobs_and_entropy_from_logits(logits, tokens, temperature=0.7)
    for b in range(3):
        for t in range(5):
            probs = torch.softmax(logits[b, t].double() / 0.7, dim=-1)
            assert logp[b, t].item() == pytest.approx(math.log(probs[tokens[b, t]].item()), abs=1e-5)
            assert entropy[b, t].item() == pytest.approx(-(probs * probs.log()).sum().item(), abs=1e-5)
    assert logp.dtype == entropy.dtype == torch.float32


def test_entropy_is_between_zero_and_log_vocab():
    logits = torch.randn(64, 17) * 5
    _, entropy = logprobs_and_entropy_from_logits(logits, torch.zeros(64, dtype=torch.long))
    assert (entropy >= -1e-6).all() and (entropy <= math.log(17) + 1e-6).all()


def test_response_logprobs_equal_a_per_row_unpadded_reference(tiny_model):
    prompts = [[1, 5, 6, 14], [1, 7], [1, 8, 9, 10, 11, 17]]
    responses = [[4, 5, 2], [6, 2, 0], [7, 8, 9]]  # row 1 is right-padded after <eos>=2
    prompt_ids, prompt_mask = left_pad(prompts, pad_id=0)
    response_ids = torch.tensor(responses)
    response_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    input_ids = torch.cat([prompt_ids, response_ids], 1)
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    with torch.no_grad():
        logp, entropy = token_logprobs_and_entropy(tiny_model, input_ids, attention_mask, response_len=3)
        for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            sequence = torch.tensor([prompt + response])
            logits = forward_logits(tiny_model, sequence, torch.ones_like(sequence))[0, len(prompt) - 1 : -1]
            ref_logp, ref_entropy = logprobs_and_entropy_from_logits(logits, sequence[0, len(prompt) :])
            valid = response_mask[row].bool()
            torch.testing.assert_close(logp[row][valid], ref_logp[valid], atol=1e-5, rtol=0)
            torch.testing.assert_close(entropy[row][valid], ref_entropy[valid], atol=1e-5, rtol=0)


def test_response_len_is_checked(tiny_model):
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="response_len"):
        token_logprobs_and_entropy(tiny_model, ids, torch.ones_like(ids), response_len=4)


class _MaskRecorder(torch.nn.Module):
    """Stands in for a GPTModel: records the mask it is called with, returns zero logits (b, s, 5)."""

    def __init__(self, backend: str | None) -> None:
        super().__init__()
        if backend is not None:
            self.fp8rl_backend = backend
        self.masks: list[torch.Tensor] = []

    def forward(self, input_ids, position_ids, attention_mask):
        self.masks.append(attention_mask)
        return torch.zeros(*input_ids.shape, 5)


def test_a_transformer_engine_model_gets_the_token_mask_not_the_quadratic_one():
    """Issue 25, item 9: the TE model packs the batch from the (b, s) token mask; building the (b, 1, s, s) mask
    for it cost O(b s^2) bools (268 MB per 16K-token row) only to read its last row back."""
    from types import SimpleNamespace

    from fp8rl.models.logprobs import model_attention_mask
    from fp8rl.models.policy import Policy

    ids = torch.tensor([[0, 0, 3, 4, 2], [1, 3, 3, 4, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    for backend, shape in ((None, (2, 1, 5, 5)), ("te", (2, 5))):
        model = _MaskRecorder(backend)
        assert model_attention_mask(model, mask).shape == shape
        policy = Policy(model, cfg=None, dims=SimpleNamespace(tp=1, pp=1))
        policy.logprobs(ids, mask, response_len=2, temperature=1.0, vocab_size=None)
        assert [m.shape for m in model.masks] == [shape]
    assert torch.equal(model_attention_mask(_MaskRecorder("te"), mask), mask.bool())
