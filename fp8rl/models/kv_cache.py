"""An emulated FP8 KV cache for megatron's static inference context (the built-in rollout engine).

What vLLM's ``kv_cache_dtype="fp8"`` does, and what fp8rl's vLLM engine asks for: keys and values are
stored as E4M3 with unit scales (vLLM's default when no scales are calibrated) and read back into the
compute dtype for attention. Here every key and value a self-attention layer writes to its cache is
rounded to E4M3 (scale 1, saturated at +-448) and stored in the compute dtype: the same numbers as
storing the FP8 codes and converting them on read. Attention then reads only rounded entries, in the
prefill as in every decode step.

One difference from vLLM, by construction of megatron's static context: it caches keys *before*
rotary embedding (the cached keys are rotated when read), vLLM caches them after. Here the rounding
therefore applies to pre-rotation keys, so the keys' rounding errors differ element by element from
vLLM's (not measured here); values are rounded the same way in both.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from megatron.core.transformer.attention import Attention

from fp8rl.quant import fake_quantize

KV_CACHE_FORMAT = "e4m3"
KV_CACHE_SCALE = 1.0  # vLLM's default k_scale / v_scale


def round_to_kv_cache(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to E4M3 with scale 1 (saturating), in t's dtype."""
    unit_scale_amax = torch.tensor(448.0 * KV_CACHE_SCALE)  # amax / 448 = the scale
    return fake_quantize(t, KV_CACHE_FORMAT, "tensor", amax=unit_scale_amax)


def _rounding_cache_writes(original, inference_context, query, key, value, *args, **kwargs):
    if inference_context is not None:
        key, value = round_to_kv_cache(key), round_to_kv_cache(value)
    return original(inference_context, query, key, value, *args, **kwargs)


@contextlib.contextmanager
def fp8_kv_cache(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Round every key/value written to the model's inference KV cache to E4M3 inside the block."""
    attentions = [m for m in model.modules() if isinstance(m, Attention)] if enabled else []
    for attention in attentions:
        original = attention._adjust_key_value_for_inference
        attention._adjust_key_value_for_inference = functools.partial(_rounding_cache_writes, original)
    try:
        yield
    finally:
        for attention in attentions:
            del attention._adjust_key_value_for_inference  # the class's method again
