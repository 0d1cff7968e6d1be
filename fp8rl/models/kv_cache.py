"""An emulated FP8 KV cache for megatron's static inference context (the built-in rollout engine).

What vLLM's ``kv_cache_dtype="fp8"`` does: keys and values are stored as E4M3 with a per-layer scale and read
back into the compute dtype for attention. Here every key and value a self-attention layer writes to its cache
is rounded to E4M3 (saturated at +-448 x scale) and stored in the compute dtype: the same numbers as
storing the FP8 codes and converting them on read. Attention then reads only rounded entries, in the
prefill as in every decode step.

Scales (``precision.kv_cache_scales``): "unit" is vLLM's default for a checkpoint without scales (scale 1);
"calibrated" (the default) gives each layer its own key and value scale, amax / 448, as NeMo-RL recalibrates
Q/K/V scales every step: the trainer records every layer's key and value amax over the real (unmasked) tokens
of its old-log-prob pass over the step's rollout (`recording_kv_amax`, reduced over data- and tensor-parallel
ranks so the scales do not depend on the layout, gathered over pipeline stages), and the next rollout's cache
uses them (`fp8_kv_cache(model, scales=...)`; vLLM: `VllmEngine.set_kv_scales`). The first rollout of a run,
before any pass has been recorded, runs unit scales.

One difference from vLLM, by construction of megatron's static context: it caches keys *before*
rotary embedding (the cached keys are rotated when read), vLLM caches them after. Here the rounding
therefore applies to pre-rotation keys, so the keys' rounding errors differ element by element from
vLLM's (not measured here); values are rounded the same way in both. The calibration follows each engine's
cache: `recording_kv_amax(model, keys=...)` records the keys where the engine stores them ("pre_rotary" for
this engine, "post_rotary", the inputs of megatron's core attention, for vLLM's; an engine says which in its
``kv_cache_keys``). Rotary embedding keeps each rotated pair's norm, not each element's, so the two amaxes
differ by up to a factor sqrt(2).
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


KV_SCALE_POLICIES = ("unit", "calibrated")
KV_CACHE_KEYS = ("pre_rotary", "post_rotary")  # where an engine's cache takes the keys: before or after rotary
E4M3_MAX = 448.0
KvScales = dict[int, tuple[float, float]]  # megatron layer_number -> (key scale, value scale)


def round_to_kv_cache(t: torch.Tensor, scale: float = KV_CACHE_SCALE) -> torch.Tensor:
    """``t`` rounded to E4M3 with `scale` (saturating at +-448 x scale), in t's dtype."""
    return fake_quantize(t, KV_CACHE_FORMAT, "tensor", amax=torch.tensor(E4M3_MAX * scale))  # amax / 448 = scale


def _rounding_cache_writes(original, scales, inference_context, query, key, value, *args, **kwargs):
    if inference_context is not None:
        key, value = round_to_kv_cache(key, scales[0]), round_to_kv_cache(value, scales[1])
    return original(inference_context, query, key, value, *args, **kwargs)


def _attentions(model: torch.nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


@contextlib.contextmanager
def fp8_kv_cache(model: torch.nn.Module, enabled: bool = True, scales: KvScales | None = None) -> Iterator[None]:
    """Round every key/value written to the model's inference KV cache to E4M3 inside the block, with each layer's
    `scales` (a layer without one, or None: unit scales)."""
    attentions = _attentions(model) if enabled else []
    unit = (KV_CACHE_SCALE, KV_CACHE_SCALE)
    for attention in attentions:
        original = attention._adjust_key_value_for_inference
        layer_scales = (scales or {}).get(attention.layer_number, unit)
        attention._adjust_key_value_for_inference = functools.partial(_rounding_cache_writes, original, layer_scales)
    try:
        yield
    finally:
        for attention in attentions:
            del attention._adjust_key_value_for_inference  # the class's method again


def _recording_writes(original, record, inference_context, query, key, value, *args, **kwargs):
    if inference_context is None:  # a training forward: [s, b, groups, head dim], the keys before rotary
        record.append((key.detach().abs().amax(dim=(2, 3)), value.detach().abs().amax(dim=(2, 3))))
    return original(inference_context, query, key, value, *args, **kwargs)


def _recording_core_attention_inputs(record, module, args):
    _, key, value = args[:3]  # [s, b, groups, head dim]: the keys after rotary, as the core attention reads them
    record.append((key.detach().abs().amax(dim=(2, 3)), value.detach().abs().amax(dim=(2, 3))))


@contextlib.contextmanager
def recording_kv_amax(
    model: torch.nn.Module, keys: str = "pre_rotary"
) -> Iterator[dict[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Inside the block, every training forward of `model` records each layer's per-position key and value amax
    ([s, b] per forward, in call order: micro-batches stack along b); `kv_amax` reduces them. `keys`: the keys
    before rotary embedding (where megatron's inference context caches them) or after it (vLLM's cache)."""
    if keys not in KV_CACHE_KEYS:
        raise ValueError(f"keys={keys!r}; valid: {list(KV_CACHE_KEYS)}")
    records: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    attentions = _attentions(model)
    hooks = []
    for attention in attentions:
        record = records.setdefault(attention.layer_number, [])
        if keys == "post_rotary":
            hook = functools.partial(_recording_core_attention_inputs, record)
            hooks.append(attention.core_attention.register_forward_pre_hook(hook))
            continue
        original = attention._adjust_key_value_for_inference
        attention._adjust_key_value_for_inference = functools.partial(_recording_writes, original, record)
    try:
        yield records
    finally:
        for hook in hooks:
            hook.remove()
        if keys == "pre_rotary":
            for attention in attentions:
                del attention._adjust_key_value_for_inference


def kv_amax(records: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], attention_mask: torch.Tensor) -> torch.Tensor:
    """(layers, 2) key and value amax of each recorded layer (in layer_number order) over the tokens where
    `attention_mask` (b, s) is 1: padding positions are left out."""
    mask = attention_mask.t().bool()  # [s, b], as the records
    rows = []
    for layer in sorted(records):
        keys = torch.cat([k for k, _ in records[layer]], dim=1)
        values = torch.cat([v for _, v in records[layer]], dim=1)
        rows.append(torch.stack([keys[mask].max(), values[mask].max()]).float())
    return torch.stack(rows) if rows else torch.zeros(0, 2)


def kv_scales_from_amax(layers: list[int], amax: torch.Tensor) -> KvScales:
    """Each layer's (key, value) scale amax / 448 (unit where an amax is 0 or not finite)."""

    def scale(value: float) -> float:
        return value / E4M3_MAX if 0 < value < float("inf") else KV_CACHE_SCALE

    return {layer: (scale(float(k)), scale(float(v))) for layer, (k, v) in zip(layers, amax.tolist(), strict=True)}
