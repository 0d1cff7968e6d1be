"""The Transformer Engine policy: name mapping, configs, packing and key checks on CPU; the model itself on a
GPU (gpu marker). What each CPU test stands in for is said in its docstring."""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from fp8rl.models.config import get_model_config
from fp8rl.models.logprobs import causal_padding_mask, left_pad
from fp8rl.models.parallel import preset_layout
from fp8rl.models.te_backend import (
    TE_FP8_FIELDS,
    check_te_state_keys,
    local_to_te_state_dict,
    pack_padded_batch,
    packed_attention_mask,
    packed_forward,
    te_fp8,
    te_fp8_fields,
    te_optimizer_config_kwargs,
    te_to_local_state_dict,
    token_mask_from_attention_mask,
    unpack_packed,
)
from fp8rl.models.te_recipes import (
    TE_VERSION_RANGE,
    apply_te_recipe_env,
    check_backend_supports,
    check_gpu_environment,
    te_recipe_env,
    torchao_config_kwargs,
)
from fp8rl.quant import get_recipe

from .conftest import require_megatron


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


# ------------------------------------------------------------------------------- FP8 fields (item 3)
@pytest.mark.parametrize(
    ("recipe", "fields"),
    [
        (None, {"fp8": None}),
        ("tensorwise", {"fp8": "hybrid", "fp8_recipe": "tensorwise"}),  # TorchAO's (and TE's) tensorwise
        ("blockwise", {"fp8": "e4m3", "fp8_recipe": "blockwise"}),
        ("mxfp8", {"fp8": "e4m3", "fp8_recipe": "mxfp8"}),
        (get_recipe("blockwise", fmt="hybrid"), {"fp8": "hybrid", "fp8_recipe": "blockwise"}),
    ],
)
def test_recipe_names_map_to_megatron_fp8_fields(recipe, fields) -> None:
    assert te_fp8_fields(recipe) == fields


def test_delayed_scaling_passes_margin_history_and_algorithm() -> None:
    """megatron 0.16.1 builds TEDelayedScaling from fp8_margin / fp8_amax_history_len / fp8_amax_compute_algo,
    whose defaults (0, 1, "most_recent") are not the recipe's: they must be set from the recipe."""
    recipe = get_recipe("tensorwise", fmt="hybrid", scaling="delayed", margin=2, amax_history_len=32)
    assert te_fp8_fields(recipe) == {
        "fp8": "hybrid",
        "fp8_recipe": "delayed",
        "fp8_margin": 2,
        "fp8_amax_history_len": 32,
        "fp8_amax_compute_algo": "max",
    }
    most_recent = get_recipe("tensorwise", scaling="delayed", amax_compute_algo="most_recent")
    assert te_fp8_fields(most_recent)["fp8_amax_compute_algo"] == "most_recent"
    assert set(te_fp8_fields(recipe)) == set(TE_FP8_FIELDS)


def test_transformer_config_carries_layout_bf16_fp8_delayed_fields_and_recompute() -> None:
    require_megatron()
    from fp8rl.models.te_backend import te_transformer_config

    cfg = te_transformer_config(get_model_config("qwen3_14b"), preset_layout("qwen3_14b"), "blockwise")
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.sequence_parallel) == (4, 1, True)
    assert (cfg.fp8, cfg.fp8_recipe, cfg.bf16, cfg.params_dtype) == ("e4m3", "blockwise", True, torch.bfloat16)
    assert (cfg.recompute_granularity, cfg.num_layers, cfg.hidden_size) == ("full", 40, 5120)
    delayed = get_recipe("tensorwise", scaling="delayed", margin=1, amax_history_len=16, amax_compute_algo="max")
    cfg = te_transformer_config(get_model_config("qwen3_8b"), preset_layout("qwen3_8b"), delayed)
    assert (cfg.fp8_recipe, cfg.fp8_margin, cfg.fp8_amax_history_len, cfg.fp8_amax_compute_algo) == (
        "delayed",
        1,
        16,
        "max",
    )


def test_te_linears_recast_the_current_weights_on_every_forward() -> None:
    """megatron hands TE ``is_first_microbatch=False`` after a linear's first forward, so TE reuses that pass's
    FP8 weights for every later pass (rollout, old log-probs, updates) unless the config disables the cache: then
    megatron hands TE None (recast every time). Checked against the pinned megatron's source text."""
    require_megatron()
    import importlib.util
    from pathlib import Path

    from fp8rl.models.te_backend import te_transformer_config

    cfg = te_transformer_config(get_model_config("qwen3_8b"), preset_layout("qwen3_8b"), "tensorwise")
    assert cfg.disable_parameter_transpose_cache is True
    source = Path(importlib.util.find_spec("megatron.core").origin).parent / "extensions/transformer_engine.py"
    rule = "None if self.disable_parameter_transpose_cache else self.is_first_microbatch"
    assert source.read_text().count(rule) == 3  # TELinear, TELayerNormColumnParallelLinear, TEGroupedLinear


def test_te_fp8_switches_every_field_and_restores_them() -> None:
    config = SimpleNamespace(
        fp8="e4m3", fp8_recipe="delayed", fp8_margin=1, fp8_amax_history_len=16, fp8_amax_compute_algo="max"
    )
    model = SimpleNamespace(module=SimpleNamespace(config=config))  # as Megatron's DDP wraps the GPTModel
    before = dict(vars(config))
    with te_fp8(model, None):
        assert config.fp8 is None
    assert vars(config) == before
    with te_fp8(model, "blockwise"):
        assert (config.fp8, config.fp8_recipe) == ("e4m3", "blockwise")
    assert vars(config) == before


# ------------------------------------------------------------------------------ backends (item 4)
def test_rowwise_on_te_is_refused_with_what_to_change() -> None:
    for call in (lambda: te_fp8_fields("rowwise"), lambda: check_backend_supports("rowwise", "te")):
        with pytest.raises(
            ValueError, match=r"rowwise cannot run with precision.backend=te.*precision.backend=emulated"
        ):
            call()


@pytest.mark.parametrize(
    ("recipe", "backend", "message"),
    [
        ("blockwise", "torchao", r"torchao has no FP8 recipe 'blockwise'"),
        (get_recipe("tensorwise", scaling="delayed"), "torchao", "dynamically only"),
        (get_recipe("tensorwise", scaling="delayed", pow2_scale=True), "te", "DelayedScaling has no power-of-two"),
        ("tensorwise", "apex", "precision.backend='apex'"),
    ],
)
def test_backend_refusals(recipe, backend, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_backend_supports(recipe, backend)


def test_backend_acceptance() -> None:
    for backend, recipes in (
        ("emulated", ("tensorwise", "rowwise", "blockwise", "mxfp8")),
        ("te", ("tensorwise", "blockwise", "mxfp8")),
        ("torchao", ("tensorwise", "rowwise")),
    ):
        check_backend_supports(None, backend)
        for recipe in recipes:
            check_backend_supports(recipe, backend)


def test_power_of_two_scales_map_to_te_environment_switches(monkeypatch) -> None:
    assert te_recipe_env("tensorwise") == {"NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES": "0"}
    assert te_recipe_env(get_recipe("tensorwise", pow2_scale=True)) == {"NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES": "1"}
    assert te_recipe_env("blockwise") == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}  # FP32 scales, as TorchAO
    assert te_recipe_env(get_recipe("blockwise", pow2_scale=True)) == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0"}
    assert (
        te_recipe_env("mxfp8")
        == te_recipe_env(None)
        == te_recipe_env(get_recipe("tensorwise", scaling="delayed"))
        == {}
    )
    # before TE is imported: set; after: checked against TE's class attributes
    monkeypatch.delitem(sys.modules, "transformer_engine.common.recipe", raising=False)
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    apply_te_recipe_env(get_recipe("blockwise", pow2_scale=False))
    assert __import__("os").environ["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] == "1"
    fake = types.ModuleType("transformer_engine.common.recipe")
    fake.Float8CurrentScaling = SimpleNamespace(use_power_2_scales=False)
    fake.Float8BlockScaling = SimpleNamespace(use_f32_scales=False)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", fake)
    apply_te_recipe_env(get_recipe("blockwise", pow2_scale=True))
    with pytest.raises(RuntimeError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES"):
        apply_te_recipe_env("blockwise")


def test_torchao_mapping_without_torchao() -> None:
    assert torchao_config_kwargs(get_recipe("rowwise", pow2_scale=True)) == {
        "granularity": "axiswise",
        "input_dtype": "e4m3",
        "weight_dtype": "e4m3",
        "grad_output_dtype": "e4m3",
        "round_scales_to_power_of_2": True,
    }
    hybrid = torchao_config_kwargs(get_recipe("tensorwise", fmt="hybrid"))
    assert (hybrid["granularity"], hybrid["grad_output_dtype"], hybrid["round_scales_to_power_of_2"]) == (
        "tensorwise",
        "e5m2",
        False,
    )


needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="needs torchao (the bench extra)"
)


@needs_torchao
def test_torchao_configs_equal_torchaos_own_recipes() -> None:
    """The paper's trainer: torchao's ROWWISE recipe = our rowwise with power-of-two scales; torchao's
    TENSORWISE default (E5M2 gradients, float32 scales) = our tensorwise "hybrid"."""
    from torchao.float8.config import Float8LinearConfig

    from fp8rl.models.te_recipes import to_torchao_config

    assert to_torchao_config("rowwise") == Float8LinearConfig.from_recipe_name("rowwise")  # the presets
    assert to_torchao_config("tensorwise") == Float8LinearConfig.from_recipe_name("tensorwise")
    assert to_torchao_config(get_recipe("rowwise", pow2_scale=True)) == Float8LinearConfig.from_recipe_name("rowwise")
    assert to_torchao_config(get_recipe("tensorwise", fmt="hybrid")) == Float8LinearConfig.from_recipe_name(
        "tensorwise"
    )


@needs_torchao
@pytest.mark.parametrize("recipe", [get_recipe("rowwise", pow2_scale=True), get_recipe("tensorwise", pow2_scale=True)])
def test_torchao_emulated_gemms_equal_the_emulator_bit_for_bit(recipe) -> None:
    """torchao's float8 training matmul (emulate=True runs on CPU) and fp8rl.quant's fp8_linear quantize the
    same operands with the same power-of-two scales: forward, dgrad and wgrad agree exactly in BF16."""
    from fp8rl.models.te_recipes import torchao_fp8_matmul
    from fp8rl.quant import fp8_linear

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=gen)
    x[:, :4] *= 30  # outlier channels
    w = torch.randn(96, 128, generator=gen) / 128**0.5
    dy = torch.randn(64, 96, generator=gen).to(torch.bfloat16)
    xa, wa = (t.to(torch.bfloat16).requires_grad_() for t in (x, w))
    xb, wb = (t.to(torch.bfloat16).requires_grad_() for t in (x, w))
    ya, yb = torchao_fp8_matmul(xa, wa, recipe, emulate=True), fp8_linear(xb, wb, None, recipe)
    ya.backward(dy)
    yb.backward(dy)
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad) and torch.equal(wa.grad, wb.grad)


# --------------------------------------------------------------------------------- GPU environment
H200 = {"device": "NVIDIA H200", "capability": (9, 0), "cuda": "12.9", "torch": "2.13.0", "torchao": "0.18.0"}


@pytest.mark.parametrize(
    ("report", "recipe", "backend", "message"),
    [
        ({**H200, "capability": None, "device": None}, "tensorwise", "te", "needs a CUDA GPU and none was found"),
        ({**H200, "transformer_engine": None}, "tensorwise", "te", r"transformer-engine>=2.9,<2.12"),
        ({**H200, "transformer_engine": "2.12.0"}, None, "te", r"Transformer Engine 2.12.0: megatron-core 0.16.1"),
        ({**H200, "transformer_engine": "2.8.0+cu12"}, "tensorwise", "te", r">=2.9,<2.12"),
        ({**H200, "transformer_engine": "2.10.0", "cuda": "12.8"}, "blockwise", "te", r"CUDA 12.9\+"),
        ({**H200, "transformer_engine": "2.10.0"}, "mxfp8", "te", r"10\.0\+"),
        ({**H200, "capability": (8, 0), "transformer_engine": "2.10.0"}, "tensorwise", "te", r"8\.9\+"),
        (
            {**H200, "capability": (8, 9), "transformer_engine": "2.10.0", "cuda": "12.0"},
            "tensorwise",
            "te",
            r"12\.1\+",
        ),
        ({**H200, "capability": (12, 0), "transformer_engine": "2.11.0"}, "mxfp8", "te", r"12\.x"),
        ({**H200, "torchao": None}, "rowwise", "torchao", "torchao is not installed"),
    ],
)
def test_gpu_environment_refusals_say_what_to_change(report, recipe, backend, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_gpu_environment(recipe, backend, report)


def test_gpu_environment_acceptance_on_an_h200() -> None:
    report = {**H200, "transformer_engine": "2.10.0+f3b2a1"}
    for recipe in (None, "tensorwise", "blockwise", get_recipe("tensorwise", scaling="delayed")):
        assert check_gpu_environment(recipe, "te", report) is report
    check_gpu_environment(get_recipe("rowwise", pow2_scale=True), "torchao", report)
    check_gpu_environment("mxfp8", "emulated", {**H200, "capability": None})
    assert TE_VERSION_RANGE == ((2, 9), (2, 12))


# ------------------------------------------------------------------------------------ packing (item 1)
def trainer_batch(
    prompts: list[list[int]], response_lengths: list[int], width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's layout: left-padded prompts | right-padded responses (fp8rl.models.logprobs)."""
    prompt_ids, prompt_mask = left_pad(prompts, 0)
    response_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    response_mask = torch.zeros_like(response_ids)
    for row, length in enumerate(response_lengths):
        response_ids[row, :length] = torch.arange(1, length + 1) + 20
        response_mask[row, :length] = 1
    return torch.cat([prompt_ids, response_ids], 1), torch.cat([prompt_mask, response_mask], 1)


BATCHES = [
    ([[5, 6, 7], [8, 9], [4, 5, 6, 7, 8]], [2, 4, 1], 4),
    ([[3]], [6], 6),
    ([[1, 2, 3, 4], [5, 6, 7, 8]], [0, 3], 3),  # a response of length 0
    ([[7, 7], [7, 7, 7, 7, 7, 7], [9], [2, 3, 4]], [5, 1, 5, 2], 5),
]


@pytest.mark.parametrize(("prompts", "responses", "width"), BATCHES)
@pytest.mark.parametrize("multiple", [1, 8, 128])
def test_packed_sequences_attend_to_exactly_the_keys_of_the_local_mask(prompts, responses, width, multiple) -> None:
    """Every real query of the THD pack sees the same key positions as under the local spec's causal |
    key-is-pad mask; the pack is padded to the multiple by one extra fill sequence."""
    ids, mask = trainer_batch(prompts, responses, width)
    packed = pack_padded_batch(ids, mask, pad_to_multiple=multiple)
    real = mask.bool()
    local = causal_padding_mask(mask)[:, 0]
    thd = packed_attention_mask(packed)[:, 0]
    assert torch.equal(thd[real], local[real])
    assert thd[~real].all()  # pad queries attend nowhere (their outputs are dropped)
    total = int(real.sum())
    assert packed.input_ids.shape == (1, total + packed.fill) and (total + packed.fill) % multiple == 0
    assert packed.fill < multiple
    assert int(packed.cu_seqlens[-1]) == total + packed.fill and packed.cu_seqlens.dtype == torch.int32
    assert torch.equal(packed.input_ids[0, :total], ids[real])
    lengths = (packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]).tolist()
    assert lengths[: len(prompts)] == real.sum(1).tolist() and packed.max_seqlen == max(lengths)


def test_padding_inside_a_row_is_refused_and_the_4d_mask_reduces_to_tokens() -> None:
    ids, mask = trainer_batch([[5, 6, 7], [8, 9]], [2, 3], 3)
    assert torch.equal(token_mask_from_attention_mask(causal_padding_mask(mask)), mask.bool())
    holed = mask.clone()
    holed[0, -2] = 0
    holed[0, -1] = 1
    with pytest.raises(ValueError, match="padding between real tokens"):
        pack_padded_batch(ids, holed)
    with pytest.raises(ValueError, match="expected"):
        token_mask_from_attention_mask(torch.ones(2, 3, 4))


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    angle = positions[:, None].double() * 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def _attend(q, k, v, allowed):
    scores = (q @ k.T) / math.sqrt(q.size(-1))
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num() @ v


class _Projections:
    def __init__(self, vocab: int = 40, dim: int = 16) -> None:
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.randn(vocab, dim, generator=gen, dtype=torch.float64)
        self.wq, self.wk, self.wv = (torch.randn(dim, dim, generator=gen, dtype=torch.float64) for _ in range(3))


def test_rope_attention_over_the_pack_equals_the_padded_one_at_every_real_token() -> None:
    """A stand-in for megatron's THD path (RoPE restarting per sequence, block-causal over cu_seqlens, as
    rope_utils._apply_rotary_pos_emb_thd and TE's padding_causal do) against the local spec's (RoPE by
    column index, causal | key-is-pad mask): equal outputs at real tokens, gradients through the unpacking."""
    p = _Projections()

    def padded(ids, mask):
        out = []
        for row in range(ids.size(0)):
            h = p.embed[ids[row]]
            pos = torch.arange(ids.size(1))
            q, k, v = _rope(h @ p.wq, pos), _rope(h @ p.wk, pos), h @ p.wv
            out.append(_attend(q, k, v, ~causal_padding_mask(mask)[row, 0]))
        return torch.stack(out)

    def thd_forward(input_ids, position_ids, attention_mask, packed_seq_params=None):
        assert attention_mask is None and packed_seq_params.qkv_format == "thd"
        cu = packed_seq_params.cu_seqlens_q.long()
        h = p.embed[input_ids[0]]
        outs = []
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            x, pos = h[start:end], torch.arange(end - start)  # megatron: positions restart per sequence
            q, k, v = _rope(x @ p.wq, pos), _rope(x @ p.wk, pos), x @ p.wv
            outs.append(_attend(q, k, v, torch.ones(end - start, end - start, dtype=torch.bool).tril()))
        return torch.cat(outs)[None]

    require_megatron()  # PackedSeqParams
    for prompts, responses, width in BATCHES:
        ids, mask = trainer_batch(prompts, responses, width)
        real = mask.bool()
        ours = packed_forward(thd_forward, ids, causal_padding_mask(mask), pad_to_multiple=8)
        theirs = padded(ids, mask)
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours[real], theirs[real], rtol=1e-12, atol=1e-12)
        assert (ours[~real] == 0).all()
    values = torch.randn(1, 12, 3, requires_grad=True)
    packed = pack_padded_batch(*trainer_batch([[5, 6]], [3], 3), pad_to_multiple=4)
    unpack_packed(packed, values[:, : packed.input_ids.size(1)]).sum().backward()
    assert values.grad[0, :5].eq(1).all() and values.grad[0, 5:].eq(0).all()


def test_packed_seq_params_are_megatrons_thd_ones() -> None:
    require_megatron()
    from fp8rl.models.te_backend import packed_seq_params

    packed = pack_padded_batch(*trainer_batch([[5, 6, 7], [8]], [2, 1], 2), pad_to_multiple=16)
    params = packed_seq_params(packed)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q is params.cu_seqlens_kv is packed.cu_seqlens
    assert params.max_seqlen_q == params.max_seqlen_kv == packed.max_seqlen == 16 - 7
    assert params.cu_seqlens_q.tolist() == [0, 5, 7, 16]


# ------------------------------------------------------------------------------ TEGPTModel on CPU
def _local_spec_te_model_class(tiny_cfg):
    """A TEGPTModel built with the local spec on CPU: exercises its forward routing and key checks."""
    require_megatron()
    from fp8rl.models.gpt import fp8_switchable_layer_spec, transformer_config
    from fp8rl.models.runtime import init_megatron
    from fp8rl.models.te_backend import te_gpt_model_class

    init_megatron(seed=0)
    return te_gpt_model_class()(
        config=transformer_config(tiny_cfg),
        transformer_layer_spec=fp8_switchable_layer_spec(tiny_cfg),
        vocab_size=tiny_cfg.vocab_size,
        max_sequence_length=tiny_cfg.max_seq_len,
        position_embedding_type="rope",
    )


def test_te_model_loading_tolerates_only_missing_extra_state(tiny_cfg) -> None:
    model = _local_spec_te_model_class(tiny_cfg)
    state = model.state_dict()
    model.load_state_dict({k: v for k, v in state.items() if not k.endswith("_extra_state")}, strict=False)
    with pytest.raises(RuntimeError, match=r"missing \['decoder.final_layernorm.weight'\]"):
        model.load_state_dict({k: v for k, v in state.items() if k != "decoder.final_layernorm.weight"}, strict=False)
    with pytest.raises(RuntimeError, match=r"unexpected \['decoder.layers.0.input_layernorm.weight.bogus'\]"):
        model.load_state_dict({**state, "decoder.layers.0.input_layernorm.weight.bogus": torch.zeros(1)})
    check_te_state_keys(["decoder.layers.0.self_attention.core_attention._extra_state"], [])
    with pytest.raises(RuntimeError, match="local_to_te_state_dict"):
        check_te_state_keys(["decoder.layers.0.input_layernorm.weight"], [])


def test_te_model_forward_packs_padded_batches_and_passes_the_rest_through(tiny_cfg, monkeypatch) -> None:
    from fp8rl.models import te_backend

    model = _local_spec_te_model_class(tiny_cfg)
    calls = []
    monkeypatch.setattr(te_backend, "packed_forward", lambda fn, ids, mask, **kw: calls.append(("packed", kw)))
    ids, mask = trainer_batch([[5, 6], [7]], [2, 1], 2)
    model(ids, None, causal_padding_mask(mask))
    assert calls == [("packed", {"pad_to_multiple": te_backend.THD_PAD_MULTIPLE})]
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.size(1)).expand_as(ids), None)  # no mask: megatron's forward
    assert logits.shape == (*ids.shape, tiny_cfg.vocab_size) and len(calls) == 1


# ---------------------------------------------------------------------------- optimizer (item 2)
class _StepProbe:
    """megatron's Float16OptimizerWithFloat16Params.step() with its CUDA-only pieces replaced: main grads
    given, no model copies, one single-process group (its found-inf all-reduce runs over gloo)."""

    @staticmethod
    def make(config, grads):
        from megatron.core.optimizer.grad_scaler import ConstantGradScaler
        from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

        class Probe(Float16OptimizerWithFloat16Params):
            def __init__(self) -> None:  # noqa: D401 - no super().__init__: it allocates CUDA tensors
                self.config, self.is_stub_optimizer, self.grads, self.steps = config, False, grads, 0
                # get_megatron_optimizer's rule (optimizer/__init__.py:430-431), with a CPU scale tensor
                self.grad_scaler = None
                if config.loss_scale:
                    self.grad_scaler = object.__new__(ConstantGradScaler)
                    self.grad_scaler._scale = torch.tensor([float(config.loss_scale)])
                    self.found_inf = torch.tensor([0.0])
                probe = self

                class Inner:
                    param_groups: list = []

                    def step(self) -> None:
                        probe.steps += 1

                self.optimizer = Inner()

            def _copy_model_grads_to_main_grads(self) -> None:
                pass

            def _collect_main_grad_data_for_unscaling(self):
                return self.grads

            def get_grad_stats_parallel_group(self):
                return None

            def _copy_main_params_to_model_params(self) -> None:
                pass

        return Probe()


def test_bf16_optimizer_skips_a_nan_step_only_with_the_constant_loss_scale() -> None:
    require_megatron()
    from megatron.core.optimizer import OptimizerConfig

    from fp8rl.models.runtime import init_megatron

    init_megatron()
    ours = te_optimizer_config_kwargs(preset_layout("qwen3_8b"), lr=1e-6, weight_decay=0.0)
    assert ours["loss_scale"] == 1.0 and ours["bf16"] and ours["clip_grad"] == 0.0
    fixed = OptimizerConfig(**ours)
    unscaled = OptimizerConfig(**{**ours, "loss_scale": None})
    nan, finite = torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])
    probe = _StepProbe.make(unscaled, [nan])
    assert probe.step()[0] and probe.steps == 1  # megatron's bf16 default: the NaN step is applied
    probe = _StepProbe.make(fixed, [nan])
    assert probe.step() == (False, None, None) and probe.steps == 0  # skipped
    probe = _StepProbe.make(fixed, [finite, torch.tensor([float("inf")])])
    assert probe.step() == (False, None, None) and probe.steps == 0
    probe = _StepProbe.make(fixed, [finite])
    assert probe.step()[0] and probe.steps == 1 and torch.equal(finite, torch.tensor([1.0, 2.0]))  # unscaled by 1


# ----------------------------------------------------------------------------------------------- GPU
needs_te = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is None, reason="needs transformer_engine (pip install 'fp8rl[gpu]')"
)


def _te_copy_of(local_model, tiny_cfg, recipe=None):
    from fp8rl.models.te_backend import build_te_gpt_model, load_te_state_dict

    te_model = build_te_gpt_model(tiny_cfg, preset_layout("tiny"), recipe, seed=0)
    state = local_to_te_state_dict(local_model.state_dict())
    load_te_state_dict(te_model, {k: v.to(torch.bfloat16) for k, v in state.items()})
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
def test_te_spec_matches_the_local_spec_on_left_and_right_padded_batches(tiny_model, tiny_cfg) -> None:
    """Item 1 on the GPU: the trainer's padded layout through the packed TE model equals the local spec at
    every real token (with the old causal-only TE mask the real tokens after left pads would differ)."""
    from fp8rl.models.gpt import compute_precision
    from fp8rl.models.logprobs import forward_logits
    from fp8rl.models.te_backend import te_forward_logits

    te_model = _te_copy_of(tiny_model, tiny_cfg)
    local = tiny_model.cuda()
    ids, mask = trainer_batch([[5, 6, 7, 8, 9, 10], [8, 9], [4, 5, 6, 7], [11]], [3, 6, 1, 5], 6)
    ids, mask = ids.cuda(), mask.cuda()
    real = mask.bool()
    with torch.no_grad(), compute_precision("bf16"):
        ours = forward_logits(local, ids, mask).float()[real]
        theirs = forward_logits(te_model, ids, mask).float()[real]
        direct = te_forward_logits(te_model, ids, mask).float()[real]
    assert torch.equal(theirs, direct)
    assert (ours - theirs).abs().max() <= 2e-2 * ours.abs().max()
    assert torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0) > 0.9999


@pytest.mark.gpu
@needs_te
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_te_fp8_pass_is_switched_per_block_and_restored(tiny_model, tiny_cfg, recipe) -> None:
    from fp8rl.models.autocast import fp8_recipe_block
    from fp8rl.models.logprobs import forward_logits

    te_model = _te_copy_of(tiny_model, tiny_cfg)
    ids, mask = _batch("cuda")
    with torch.no_grad():
        bf16 = forward_logits(te_model, ids, mask).float()
        with fp8_recipe_block(te_model, recipe):
            fp8 = forward_logits(te_model, ids, mask).float()
        again = forward_logits(te_model, ids, mask).float()
    assert te_model.config.fp8 is None and torch.equal(bf16, again)
    diff = (fp8 - bf16).abs().max() / bf16.abs().max()
    assert 0 < diff < 0.1  # FP8 noise: present, and of FP8's size (3 mantissa bits)


@pytest.mark.gpu
@needs_te
def test_an_fp8_pass_after_a_weight_change_uses_the_new_weights(tiny_model, tiny_cfg) -> None:
    """TE's FP8 weight cache (item: stale FP8 weights): after the weights change, an FP8 forward equals that of a
    freshly built TE model loaded with the changed weights (with megatron's is_first_microbatch=False it would
    reuse the first pass's FP8 weights)."""
    from fp8rl.models.autocast import fp8_recipe_block
    from fp8rl.models.logprobs import forward_logits

    te_model = _te_copy_of(tiny_model, tiny_cfg)
    ids, mask = _batch("cuda")
    with torch.no_grad():
        with fp8_recipe_block(te_model, "tensorwise"):
            forward_logits(te_model, ids, mask)  # the first FP8 pass (TE would cache its FP8 weights)
        for param in te_model.parameters():
            param.mul_(1.5)  # what an optimizer step does, large enough to move every FP8 code
        with fp8_recipe_block(te_model, "tensorwise"):
            after = forward_logits(te_model, ids, mask).float()
        fresh = _te_copy_of(tiny_model, tiny_cfg)
        fresh.load_state_dict(te_model.state_dict())
        with fp8_recipe_block(fresh, "tensorwise"):
            expected = forward_logits(fresh, ids, mask).float()
    assert torch.equal(after, expected)


@pytest.mark.gpu
@needs_te
def test_megatron_optimizer_skips_a_step_with_nan_gradients(tiny_model, tiny_cfg) -> None:
    from fp8rl.models.te_backend import policy_optimizer

    te_model = _te_copy_of(tiny_model, tiny_cfg)
    ddp_model, optimizer = policy_optimizer(te_model, preset_layout("tiny"), lr=1e-3, weight_decay=0.0)
    before = {k: v.detach().clone() for k, v in te_model.state_dict().items() if torch.is_tensor(v)}
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    for param in te_model.parameters():
        param.main_grad.fill_(float("nan"))
    ddp_model.finish_grad_sync()
    applied, grad_norm, _ = optimizer.step()
    assert not applied and grad_norm is None
    after = te_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.gpu
@needs_torchao
def test_torchao_rowwise_gemm_on_the_gpu_matches_its_emulation() -> None:
    from fp8rl.models.te_recipes import torchao_fp8_matmul

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm FP8 needs compute capability 8.9+")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 512, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(384, 512, device="cuda", generator=gen) / 512**0.5).to(torch.bfloat16)
    recipe = get_recipe("rowwise", pow2_scale=True)
    real, emulated = torchao_fp8_matmul(x, w, recipe), torchao_fp8_matmul(x, w, recipe, emulate=True)
    magnitude = (x.float().abs() @ w.float().abs().t()).max()
    assert (real.float() - emulated.float()).abs().max() <= 2**-6 * magnitude  # accumulation + BF16 output


def test_torchaos_real_gemms_pad_their_inner_dimension_and_its_emulation_does_not() -> None:
    """torch._scaled_mm wants its second operand's dimensions divisible by 16, and the wgrad GEMM's inner dimension
    is an RL micro-batch's token count: the real GEMMs pad (zeros), the emulation keeps torchao's own (no padding)."""
    from fp8rl.models.te_recipes import torchao_pads_inner_dim

    assert torchao_pads_inner_dim(emulate=False)
    assert not torchao_pads_inner_dim(emulate=True)
