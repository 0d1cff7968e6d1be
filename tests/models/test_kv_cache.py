"""The emulated FP8 KV cache (fp8rl.models.kv_cache) on megatron's static inference context."""

import pytest
import torch
from megatron.core.inference.contexts import StaticInferenceContext

from fp8rl.models.generate import SamplingConfig, generate
from fp8rl.models.gpt import compute_precision
from fp8rl.models.kv_cache import fp8_kv_cache, kv_amax, kv_scales_from_amax, recording_kv_amax, round_to_kv_cache
from fp8rl.models.logprobs import causal_padding_mask, left_pad

EOS, PAD = 2, 0
PROMPTS = [[1, 5, 6, 14, 7], [1, 9], [1, 8, 8, 16, 4, 5, 17]]


def row_seeds(seed: int, rows: int) -> list[int]:
    """One sampling seed per row (rows of one batch sample independently)."""
    return [seed * 1000 + row for row in range(rows)]


def e4m3_representable(t: torch.Tensor) -> bool:
    return torch.equal(t.float().to(torch.float8_e4m3fn).float(), t.float())


def prefill_cache(model, rounded: bool) -> dict:
    prompt_ids, prompt_mask = left_pad(PROMPTS, pad_id=PAD)
    ctx = StaticInferenceContext(max_batch_size=3, max_sequence_length=prompt_ids.size(1))
    model.eval()
    with torch.no_grad(), compute_precision("bf16"), fp8_kv_cache(model, rounded):
        model(prompt_ids, None, causal_padding_mask(prompt_mask), inference_context=ctx, runtime_gather_output=True)
    return ctx.key_value_memory_dict


def test_round_to_kv_cache_is_a_unit_scale_saturating_e4m3_cast():
    t = torch.tensor([0.0, 1.0, 1.0625, -3.3, 1e-3, 500.0, -1e4], dtype=torch.bfloat16)
    expected = t.float().clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.bfloat16)
    assert torch.equal(round_to_kv_cache(t), expected)
    assert round_to_kv_cache(t).dtype == torch.bfloat16


def test_cached_keys_and_values_are_e4m3_values_inside_the_block_only(tiny_model):
    plain = prefill_cache(tiny_model, rounded=False)
    rounded = prefill_cache(tiny_model, rounded=True)
    for layer, (key, value) in rounded.items():
        assert e4m3_representable(key) and e4m3_representable(value)
        assert not torch.equal(key, plain[layer][0]) and not torch.equal(value, plain[layer][1])
    first = min(plain)  # later layers read rounded entries below them, so only the first sees the same inputs
    assert torch.equal(rounded[first][0], round_to_kv_cache(plain[first][0]))
    assert torch.equal(rounded[first][1], round_to_kv_cache(plain[first][1]))
    after = prefill_cache(tiny_model, rounded=False)  # the patch is gone after the block
    assert all(torch.equal(after[layer][0], plain[layer][0]) for layer in plain)


def test_generation_with_an_fp8_kv_cache_stays_close_to_the_bf16_cache(tiny_model):
    prompt_ids, prompt_mask = left_pad(PROMPTS, pad_id=PAD)
    cfg = SamplingConfig(max_new_tokens=8, eos_token_ids=(EOS,), pad_token_id=PAD, temperature=1.0)
    outs = {}
    for rounded in (False, True):
        with compute_precision("bf16"), fp8_kv_cache(tiny_model, rounded):
            seeds = row_seeds(3, len(prompt_ids))
            outs[rounded] = generate(tiny_model, prompt_ids, prompt_mask, cfg, seeds=seeds)
    first = outs[False].response_mask[:, 0].bool()
    diff = (outs[True].logprobs[:, 0] - outs[False].logprobs[:, 0])[first]
    assert torch.equal(outs[True].tokens[:, 0], outs[False].tokens[:, 0])  # same seed, nearly the same logits
    assert 0 < float(diff.abs().max()) < 0.1  # the cache's rounding changes log-probs, a little


def test_a_calibrated_scale_keeps_small_keys_that_unit_scales_flush():
    """Unit scales put keys of magnitude ~1e-3 among E4M3's subnormals (2^-9 steps); amax / 448 keeps 3 bits."""
    t = torch.linspace(-1e-3, 1e-3, 257)
    unit = (round_to_kv_cache(t) - t).abs().max()
    calibrated = (round_to_kv_cache(t, float(t.abs().max()) / 448) - t).abs().max()
    assert calibrated < unit / 20


def test_calibrated_scales_are_each_layers_amax_over_real_tokens_only(tiny_model):
    """The trainer's old-log-prob pass records every layer's keys and values; padding positions are left out."""
    prompt_ids, prompt_mask = left_pad(PROMPTS, pad_id=PAD)
    with torch.no_grad(), recording_kv_amax(tiny_model) as records:
        tiny_model(prompt_ids, None, causal_padding_mask(prompt_mask))
    layers = sorted(records)
    assert len(layers) == tiny_model.config.num_layers
    amax = kv_amax(records, prompt_mask)
    keys_per_position = records[layers[0]][0][0]  # [s, b]
    assert float(amax[0, 0]) == float(keys_per_position[prompt_mask.t().bool()].max())
    everywhere = kv_amax(records, torch.ones_like(prompt_mask))
    assert (everywhere >= amax).all()
    scales = kv_scales_from_amax(layers, amax)
    assert scales[layers[0]] == (float(amax[0, 0]) / 448, float(amax[0, 1]) / 448)
    assert kv_scales_from_amax([1], torch.tensor([[0.0, float("inf")]])) == {1: (1.0, 1.0)}
    cache = prefill_cache_with(tiny_model, scales)
    key = cache[layers[0]][0].float()
    assert key.abs().max() <= 448 * scales[layers[0]][0] + 1e-6  # saturated at the calibrated range


def prefill_cache_with(model, scales) -> dict:
    prompt_ids, prompt_mask = left_pad(PROMPTS, pad_id=PAD)
    ctx = StaticInferenceContext(max_batch_size=3, max_sequence_length=prompt_ids.size(1))
    model.eval()
    with torch.no_grad(), compute_precision("bf16"), fp8_kv_cache(model, True, scales):
        model(prompt_ids, None, causal_padding_mask(prompt_mask), inference_context=ctx, runtime_gather_output=True)
    return ctx.key_value_memory_dict


def test_keys_are_recorded_where_the_engine_caches_them_before_or_after_rotary(tiny_model):
    """vLLM caches keys after rotary embedding, megatron's static context before it: the recorded key amax
    follows the engine (rotary keeps each rotated pair's norm, so the two differ by at most sqrt(2) per
    position); values are not rotated and record the same."""
    assert tiny_model.config.num_layers and tiny_model.position_embedding_type == "rope"
    prompt_ids, prompt_mask = left_pad(PROMPTS, pad_id=PAD)
    records = {}
    for keys in ("pre_rotary", "post_rotary"):
        with torch.no_grad(), recording_kv_amax(tiny_model, keys) as records[keys]:
            tiny_model(prompt_ids, None, causal_padding_mask(prompt_mask))
    pre, post = records["pre_rotary"], records["post_rotary"]
    assert sorted(pre) == sorted(post) and all(len(pre[layer]) == len(post[layer]) == 1 for layer in pre)
    for layer in pre:
        (k_pre, v_pre), (k_post, v_post) = pre[layer][0], post[layer][0]
        assert torch.equal(v_pre, v_post)
        assert not torch.equal(k_pre, k_post)  # rotated
        assert (k_post <= k_pre * 2**0.5 * (1 + 1e-5)).all() and (k_pre <= k_post * 2**0.5 * (1 + 1e-5)).all()
    with torch.no_grad(), recording_kv_amax(tiny_model, "post_rotary") as again:
        pass
    assert all(not hooks for hooks in (m._forward_pre_hooks for m in tiny_model.modules()))  # hooks removed
    assert again == {layer: [] for layer in pre}
    with pytest.raises(ValueError, match="keys='after'; valid"):
        with recording_kv_amax(tiny_model, "after"):
            pass
