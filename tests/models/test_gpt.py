import pytest
import torch

from fp8rl.models.fp8_layers import Fp8ColumnParallelLinear, Fp8RowParallelLinear
from fp8rl.models.gpt import (
    build_gpt_model,
    compute_precision,
    fp8_autocast,
    fp8_switchable_linears,
    set_fp8_recipe,
)
from fp8rl.models.logprobs import forward_logits
from fp8rl.quant import RECIPE_NAMES, get_recipe


@pytest.fixture()
def batch():
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 18, (4, 10), generator=generator)
    attention_mask = torch.ones(4, 10, dtype=torch.long)
    attention_mask[0, :3] = 0  # one left-padded row
    return input_ids, attention_mask


def logits_of(model, batch):
    with torch.no_grad():
        return forward_logits(model, *batch)


def test_the_four_block_linears_are_fp8_switchable(tiny_model, tiny_cfg):
    layer = tiny_model.decoder.layers[0]
    assert isinstance(layer.self_attention.linear_qkv, Fp8ColumnParallelLinear)
    assert isinstance(layer.self_attention.linear_proj, Fp8RowParallelLinear)
    assert isinstance(layer.mlp.linear_fc1, Fp8ColumnParallelLinear)
    assert isinstance(layer.mlp.linear_fc2, Fp8RowParallelLinear)
    assert len(fp8_switchable_linears(tiny_model)) == 4 * tiny_cfg.num_layers
    assert type(tiny_model.output_layer).__name__ == "ColumnParallelLinear"  # the LM head stays high precision


def test_weights_are_fp32_and_depend_only_on_the_seed(tiny_cfg):
    torch.manual_seed(5)
    rng_before = torch.get_rng_state()
    first, same, other = (build_gpt_model(tiny_cfg, seed=s) for s in (0, 0, 1))
    assert torch.equal(torch.get_rng_state(), rng_before)  # global RNG untouched
    assert all(p.dtype == torch.float32 for p in first.parameters())
    pairs = list(zip(first.parameters(), same.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in pairs)
    assert not torch.equal(first.embedding.word_embeddings.weight, other.embedding.word_embeddings.weight)


def test_logits_shape(tiny_model, tiny_cfg, batch):
    assert logits_of(tiny_model, batch).shape == (4, 10, tiny_cfg.vocab_size)


def test_fp8_autocast_none_is_the_plain_model(tiny_model, batch):
    plain = logits_of(tiny_model, batch)
    with fp8_autocast(tiny_model, None):
        assert torch.equal(logits_of(tiny_model, batch), plain)


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_fp8_recipe_changes_logits_by_quantization_noise_and_is_restored(tiny_model, batch, recipe):
    plain = logits_of(tiny_model, batch)
    with fp8_autocast(tiny_model, recipe):
        fp8 = logits_of(tiny_model, batch)
    assert not torch.allclose(fp8, plain)
    relative_error = (fp8 - plain).norm() / plain.norm()
    assert relative_error < 0.1  # E4M3 has 3 mantissa bits: a few percent, not garbage
    assert torch.equal(logits_of(tiny_model, batch), plain)


def test_nested_autocast_restores_the_outer_recipe(tiny_model):
    rowwise = get_recipe("rowwise")
    set_fp8_recipe(tiny_model, rowwise)
    with fp8_autocast(tiny_model, None):
        assert all(linear.fp8_recipe is None for linear in fp8_switchable_linears(tiny_model))
    assert all(linear.fp8_recipe is rowwise for linear in fp8_switchable_linears(tiny_model))
    set_fp8_recipe(tiny_model, None)


def test_recipe_by_name_equals_recipe_object(tiny_model, batch):
    with fp8_autocast(tiny_model, "blockwise"):
        by_name = logits_of(tiny_model, batch)
    with fp8_autocast(tiny_model, get_recipe("blockwise")):
        by_object = logits_of(tiny_model, batch)
    assert torch.equal(by_name, by_object)


def test_fp8_backward_reaches_every_weight(tiny_model, batch):
    with fp8_autocast(tiny_model, "tensorwise"):
        forward_logits(tiny_model, *batch).float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in tiny_model.parameters())


def test_delayed_scaling_keeps_state_per_layer(tiny_model, batch):
    with fp8_autocast(tiny_model, get_recipe("tensorwise", scaling="delayed")):
        logits_of(tiny_model, batch)
    states = [linear.fp8_scaling_state for linear in fp8_switchable_linears(tiny_model)]
    assert all(state is not None and state.histories for state in states)
    assert len({id(state) for state in states}) == len(states)


def test_bf16_precision_is_close_to_fp32_and_differs(tiny_model, batch):
    fp32 = logits_of(tiny_model, batch)
    with compute_precision("bf16"):
        bf16 = logits_of(tiny_model, batch)
    assert bf16.dtype == torch.bfloat16
    assert not torch.equal(bf16.float(), fp32)
    assert (bf16.float() - fp32).norm() / fp32.norm() < 0.05


def test_unknown_precision_raises():
    with pytest.raises(ValueError, match="fp32"):
        compute_precision("fp16")


def test_set_recipe_on_a_model_without_fp8_linears_raises():
    with pytest.raises(ValueError, match="build_gpt_model"):
        set_fp8_recipe(torch.nn.Linear(2, 2), "rowwise")
