"""Injected activation outliers leave the function unchanged and make coarse FP8 scaling worse."""

import pytest
import torch

from fp8rl.models.gpt import fp8_autocast
from fp8rl.models.logprobs import forward_logits
from fp8rl.models.outliers import inject_activation_outliers, outlier_channel_ids


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


def test_injection_preserves_the_function_in_fp32(tiny_model, batch) -> None:
    before = logits(tiny_model, batch)
    ids = inject_activation_outliers(tiny_model, channels=4, scale=32.0, seed=0)
    layer = tiny_model.decoder.layers[0]
    assert torch.allclose(layer.input_layernorm.weight[ids], torch.full((4,), 32.0))
    after = logits(tiny_model, batch)
    assert (after - before).abs().max() < 1e-4 * before.abs().max()


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
