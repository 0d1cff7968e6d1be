"""The Transformer Engine policy: name mapping and config on CPU; the model itself on a GPU (gpu marker)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fp8rl.models.config import get_model_config
from fp8rl.models.parallel import preset_layout
from fp8rl.models.te_backend import (
    local_to_te_state_dict,
    te_fp8_fields,
    te_to_local_state_dict,
    te_transformer_config,
)


def test_only_the_two_pre_norms_are_renamed_and_the_mapping_inverts(tiny_model) -> None:
    state = {k: v for k, v in tiny_model.state_dict().items() if not k.endswith("_extra_state")}
    te_state = local_to_te_state_dict(tiny_model.state_dict())
    renamed = {k for k in state if k not in te_state}
    assert renamed == {
        f"decoder.layers.{i}.{n}.weight" for i in range(4) for n in ("input_layernorm", "pre_mlp_layernorm")
    }
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te_state
    assert "decoder.layers.3.mlp.linear_fc1.layer_norm_weight" in te_state
    back = te_to_local_state_dict(te_state)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize(
    ("recipe", "fields"),
    [
        (None, {"fp8": None}),
        ("tensorwise", {"fp8": "e4m3", "fp8_recipe": "tensorwise"}),
        ("blockwise", {"fp8": "e4m3", "fp8_recipe": "blockwise"}),
        ("mxfp8", {"fp8": "e4m3", "fp8_recipe": "mxfp8"}),
    ],
)
def test_recipe_names_map_to_megatron_fp8_fields(recipe, fields) -> None:
    assert te_fp8_fields(recipe) == fields


def test_delayed_hybrid_and_rowwise() -> None:
    from fp8rl.quant import get_recipe

    assert te_fp8_fields(get_recipe("tensorwise", fmt="hybrid", scaling="delayed")) == {
        "fp8": "hybrid",
        "fp8_recipe": "delayed",
    }
    with pytest.raises(ValueError, match="rowwise has no Transformer Engine recipe"):
        te_fp8_fields("rowwise")


def test_transformer_config_carries_layout_bf16_fp8_and_recompute() -> None:
    cfg = te_transformer_config(get_model_config("qwen3_14b"), preset_layout("qwen3_14b"), "blockwise")
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.sequence_parallel) == (4, 1, True)
    assert (cfg.fp8, cfg.fp8_recipe, cfg.bf16, cfg.params_dtype) == ("e4m3", "blockwise", True, torch.bfloat16)
    assert (cfg.recompute_granularity, cfg.num_layers, cfg.hidden_size) == ("full", 40, 5120)


# ----------------------------------------------------------------------------------------------- GPU
needs_te = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is None, reason="needs transformer_engine (pip install 'fp8rl[gpu]')"
)


def _te_copy_of(local_model, tiny_cfg, recipe=None):
    from fp8rl.models.te_backend import build_te_gpt_model

    te_model = build_te_gpt_model(tiny_cfg, preset_layout("tiny"), recipe, seed=0)
    state = local_to_te_state_dict(local_model.state_dict())
    missing, unexpected = te_model.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()}, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    return te_model


def _batch(device):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 18, (8, 16), generator=gen).to(device)
    return ids, torch.ones_like(ids)


@pytest.mark.gpu
@needs_te
def test_te_spec_logits_match_the_local_spec_in_bf16(tiny_model, tiny_cfg) -> None:
    from fp8rl.models.gpt import compute_precision
    from fp8rl.models.logprobs import forward_logits

    te_model = _te_copy_of(tiny_model, tiny_cfg)
    local = tiny_model.cuda()
    ids, mask = _batch("cuda")
    with torch.no_grad(), compute_precision("bf16"):
        ours, theirs = forward_logits(local, ids, mask).float(), forward_logits(te_model, ids, mask).float()
    # both BF16 GEMMs with FP32 accumulation; TE fuses the norm into the GEMM: BF16-rounding-level differences
    scale = ours.abs().max()
    assert (ours - theirs).abs().max() <= 2e-2 * scale
    assert torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0) > 0.9999


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_te_fp8_pass_is_switched_per_block_and_restored(tiny_model, tiny_cfg, recipe) -> None:
    from fp8rl.models.gpt import fp8_autocast
    from fp8rl.models.logprobs import forward_logits

    te_model = _te_copy_of(tiny_model, tiny_cfg)
    ids, mask = _batch("cuda")
    with torch.no_grad():
        bf16 = forward_logits(te_model, ids, mask).float()
        with fp8_autocast(te_model, recipe):
            fp8 = forward_logits(te_model, ids, mask).float()
        again = forward_logits(te_model, ids, mask).float()
    assert te_model.config.fp8 is None and torch.equal(bf16, again)
    diff = (fp8 - bf16).abs().max() / bf16.abs().max()
    assert 0 < diff < 0.1  # FP8 noise: present, and of FP8's size (3 mantissa bits)
