"""Injected activation outliers leave the function unchanged and make coarse FP8 scaling worse."""

import pytest
import torch

from fp8rl.models.gpt import fp8_autocast
from fp8rl.models.logprobs import forward_logits
from fp8rl.models.outliers import inject_activation_outliers, outlier_channel_ids, remove_activation_outliers


@pytest.fixture
def batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 18, (8, 12), generator=gen)
    return ids, torch.ones_like(ids)


def logits(model, batch, recipe=None):
    with torch.no_grad(), fp8_autocast(model, recipe):
        return forward_logits(model, *batch).float()


def test_channel_ids_are_distinct_seeded_and_in_one_block() -> None:
    ids = outlier_channel_ids(256, 4, seed=3)
    assert ids.tolist() == sorted(set(ids.tolist())) and len(ids) == 4 and int(ids.max()) < 128
    assert torch.equal(ids, outlier_channel_ids(256, 4, seed=3))
    assert not torch.equal(ids, outlier_channel_ids(256, 4, seed=4))
    with pytest.raises(ValueError, match="model.outlier_channels=0 must be in 1..128"):
        outlier_channel_ids(256, 0)


def test_injection_preserves_the_function_and_the_parameters(tiny_model, batch) -> None:
    params = {k: v.clone() for k, v in tiny_model.state_dict().items() if torch.is_tensor(v)}
    before = logits(tiny_model, batch)
    ids = inject_activation_outliers(tiny_model, channels=4, scale=32768.0, seed=0)
    qkv = tiny_model.decoder.layers[0].self_attention.linear_qkv
    assert torch.equal(qkv.input_channel_scale[ids], torch.full((4,), 32768.0))
    assert float(qkv.input_channel_scale.sum()) == 256 - 4 + 4 * 32768.0
    after = logits(tiny_model, batch)
    assert (after - before).abs().max() < 1e-4 * before.abs().max()
    assert all(torch.equal(params[k], v) for k, v in tiny_model.state_dict().items() if k in params)
    remove_activation_outliers(tiny_model)
    assert qkv.input_channel_scale is None and torch.equal(logits(tiny_model, batch), before)


def test_a_training_step_sees_the_parameters_as_trained(tiny_model, batch) -> None:
    """The scale lives in the forward, so the optimizer's view of the weights is unchanged: Adam's first
    step moves every parameter by the same amount with and without outliers (up to rounding)."""

    def adam_step_delta(model):
        start = {k: p.detach().clone() for k, p in model.named_parameters()}
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        forward_logits(model, *batch).float().logsumexp(-1).mean().backward()
        opt.step()
        return {k: p.detach() - start[k] for k, p in model.named_parameters()}

    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in tiny_model.state_dict().items()}
    plain = adam_step_delta(tiny_model)
    tiny_model.load_state_dict(state)
    inject_activation_outliers(tiny_model, channels=4, scale=32768.0, seed=0)
    skewed = adam_step_delta(tiny_model)
    worst = max(float((plain[k] - skewed[k]).abs().max()) for k in plain)
    mean = sum(float((plain[k] - skewed[k]).abs().sum()) for k in plain) / sum(v.numel() for v in plain.values())
    # Adam's first step is ~lr = 1e-3 per element; rounding of the 2^15 x operands flips a few tiny-gradient
    # signs, nothing more (rescaling the parameters instead would move W / s by 2^15 x its relative step)
    assert worst < 0.5e-3 and mean < 1e-6


def fp8_error(model, batch, recipe) -> float:
    return (logits(model, batch, recipe) - logits(model, batch)).abs().mean().item()


def test_e4m3_absorbs_moderate_outliers(tiny_model, batch) -> None:
    clean = fp8_error(tiny_model, batch, "tensorwise")
    inject_activation_outliers(tiny_model, channels=4, scale=32.0, seed=0)
    # a floating-point format: scaling by 32 moves values 5 binades down, still inside E4M3's normal range
    assert fp8_error(tiny_model, batch, "tensorwise") < 1.3 * clean


def test_massive_outliers_hurt_tensorwise_more_than_mxfp8(tiny_model, batch) -> None:
    clean = {r: fp8_error(tiny_model, batch, r) for r in ("tensorwise", "mxfp8")}
    inject_activation_outliers(tiny_model, channels=4, scale=32768.0, seed=0)
    skewed = {r: fp8_error(tiny_model, batch, r) for r in ("tensorwise", "mxfp8")}
    # one scale per tensor now spans 2^15 x larger values and the rest underflow; 32-element blocks confine it
    assert skewed["tensorwise"] > 1.5 * clean["tensorwise"]
    assert skewed["tensorwise"] > 1.5 * skewed["mxfp8"]


def test_bad_scale_and_non_megatron_model_are_refused(tiny_model) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        inject_activation_outliers(tiny_model, 4, 0.0)
    with pytest.raises(TypeError, match="megatron GPTModel"):
        inject_activation_outliers(torch.nn.Linear(2, 2), 4, 32.0)
