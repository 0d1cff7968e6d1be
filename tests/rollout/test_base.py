"""fp8rl.rollout.base: the rollout batch's layout helpers."""

import torch

from fp8rl.rollout.base import RolloutBatch

PAD = 0


def batch(prompt_len: int, response_len: int, rows: int, fill: int) -> RolloutBatch:
    prompt_mask = torch.ones(rows, prompt_len, dtype=torch.long)
    prompt_mask[0, 0] = 0  # a left pad in the first row
    prompt_ids = torch.full((rows, prompt_len), fill) * prompt_mask
    response_mask = torch.ones(rows, response_len, dtype=torch.long)
    response_mask[-1, -1] = 0  # a right pad in the last row
    response_ids = torch.full((rows, response_len), fill) * response_mask
    logp = -torch.rand(rows, response_len) * response_mask
    return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, logp, logp.abs())


def test_concat_left_pads_prompts_and_right_pads_responses_to_the_widest():
    a, b = batch(3, 5, rows=2, fill=7), batch(6, 2, rows=3, fill=9)
    c = RolloutBatch.concat([a, b], PAD)
    assert c.prompt_ids.shape == (5, 6) and c.response_ids.shape == (5, 5)
    # a's prompts keep their tokens at the right end; b's responses keep theirs at the left end
    assert torch.equal(c.prompt_ids[:2, 3:], a.prompt_ids) and bool((c.prompt_ids[:2, :3] == PAD).all())
    assert torch.equal(c.prompt_mask[:2].sum(1), a.prompt_mask.sum(1))
    assert torch.equal(c.response_ids[2:, :2], b.response_ids) and bool((c.response_mask[2:, 2:] == 0).all())
    assert torch.equal(c.rollout_logp[:2], a.rollout_logp) and bool((c.rollout_logp[2:, 2:] == 0).all())
    # the trainer's layout: every row's real tokens are contiguous around the prompt/response boundary
    for row in range(5):
        real = c.attention_mask[row].nonzero().flatten()
        prompt_real = c.prompt_mask[row].nonzero().flatten()
        assert int(prompt_real.max()) == c.prompt_ids.shape[1] - 1 and int(real.min()) == int(prompt_real.min())


def test_concat_of_selected_rows_gives_the_batch_back():
    a = batch(4, 3, rows=4, fill=5)
    c = RolloutBatch.concat([a.select(slice(0, 2)), a.select(slice(2, 4))], PAD)
    for name in a.__dataclass_fields__:
        assert torch.equal(getattr(c, name), getattr(a, name)), name
