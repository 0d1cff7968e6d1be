import dataclasses

import pytest

from fp8rl.models.config import (
    ModelConfig,
    get_model_config,
    model_preset_names,
    padded_vocab_size,
    parameter_count,
    register_model_preset,
    with_tokenizer_vocab,
)
from fp8rl.models.gpt import build_gpt_model, count_parameters


def test_presets_are_registered():
    assert {"tiny", "qwen3_8b", "qwen3_14b", "qwen2_5_32b"} <= set(model_preset_names())


def test_unknown_preset_lists_valid_names():
    with pytest.raises(KeyError, match="qwen3_8b"):
        get_model_config("qwen3_9b")


def test_registering_a_different_config_under_a_taken_name_raises():
    tiny = get_model_config("tiny")
    register_model_preset(tiny)  # the same config again is fine
    with pytest.raises(ValueError, match="already registered"):
        register_model_preset(dataclasses.replace(tiny, num_layers=5))


@pytest.mark.parametrize(
    ("name", "layers", "hidden", "heads", "groups", "ffn", "vocab", "qk_norm", "qkv_bias", "eps"),
    [
        ("qwen3_8b", 36, 4096, 32, 8, 12288, 151936, True, False, 1e-6),
        ("qwen3_14b", 40, 5120, 40, 8, 17408, 151936, True, False, 1e-6),
        ("qwen2_5_32b", 64, 5120, 40, 8, 27648, 152064, False, True, 1e-5),
    ],
)
def test_real_shapes_match_the_published_configs(
    name, layers, hidden, heads, groups, ffn, vocab, qk_norm, qkv_bias, eps
):
    cfg = get_model_config(name)
    got = (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.ffn_hidden_size)
    assert got == (layers, hidden, heads, groups, ffn)
    assert (cfg.vocab_size, cfg.qk_layernorm, cfg.add_qkv_bias, cfg.norm_epsilon) == (vocab, qk_norm, qkv_bias, eps)
    assert cfg.kv_channels == 128 and cfg.rotary_base == 1e6 and not cfg.tie_embeddings and cfg.swiglu


@pytest.mark.parametrize(("name", "billions"), [("qwen3_8b", 8.19), ("qwen3_14b", 14.77), ("qwen2_5_32b", 32.76)])
def test_real_shapes_have_the_published_parameter_counts(name, billions):
    assert parameter_count(get_model_config(name)) / 1e9 == pytest.approx(billions, abs=0.01)


def test_parameter_count_matches_the_built_model(tiny_cfg):
    qkv_bias_cfg = dataclasses.replace(tiny_cfg, add_qkv_bias=True, qk_layernorm=False, tie_embeddings=True)
    for cfg in (tiny_cfg, qkv_bias_cfg):
        assert count_parameters(build_gpt_model(cfg)) == parameter_count(cfg)


def test_tiny_is_qwen3_like_with_head_dim_64():
    tiny = get_model_config("tiny")
    assert tiny.normalization == "RMSNorm" and tiny.swiglu and tiny.qk_layernorm
    assert not (tiny.add_qkv_bias or tiny.add_bias_linear)
    assert tiny.kv_channels == 64 and tiny.vocab_size is None


@pytest.mark.parametrize(("tokens", "padded"), [(1, 64), (18, 64), (64, 64), (65, 128)])
def test_padded_vocab_size(tokens, padded):
    assert padded_vocab_size(tokens) == padded


def test_with_tokenizer_vocab_resolves_or_checks():
    assert with_tokenizer_vocab(get_model_config("tiny"), 70).vocab_size == 128
    qwen = get_model_config("qwen3_8b")
    assert with_tokenizer_vocab(qwen, 151665) is qwen
    with pytest.raises(ValueError, match="151936"):
        with_tokenizer_vocab(qwen, 200_000)


def test_unresolved_vocab_cannot_be_built():
    with pytest.raises(ValueError, match="with_tokenizer_vocab"):
        build_gpt_model(get_model_config("tiny"))


@pytest.mark.parametrize(
    "overrides",
    [{"normalization": "BatchNorm"}, {"num_query_groups": 3}, {"hidden_size": 250}, {"vocab_size": 0}],
)
def test_invalid_configs_fail_at_construction(overrides):
    fields = dict(name="x", num_layers=1, hidden_size=256, num_attention_heads=4, num_query_groups=4)
    fields.update(ffn_hidden_size=512, vocab_size=64, max_seq_len=16)
    fields.update(overrides)
    with pytest.raises(ValueError):
        ModelConfig(**fields)
