"""Calibrated FP8 KV cache scales inside vLLM's workers (`VllmEngine.set_kv_scales`).

vLLM 0.32 reads an attention layer's KV cache scales from what its loader sets for a checkpoint's ``k_scale`` /
``v_scale`` (vllm/model_executor/layers/quantization/kv_cache.py): the ``_k_scale`` / ``_v_scale`` tensors (GPU
kernels), their host floats ``_k_scale_float`` / ``_v_scale_float`` (the CPU backend, FlashInfer) and CPU copies
``_k_scale_cpu`` / ``_v_scale_cpu`` (AITER). `set_attention_kv_scales` sets all of them, as that loader does
(doubled on FP8-FNUZ platforms, as there); a weight reload puts vLLM's unit scales back
(``set_default_quant_scales``), so the engine calls it again after every push.
"""

from __future__ import annotations

import re

import torch

from fp8rl.models.kv_cache import KvScales

_LAYER = re.compile(r"layers\.(\d+)\.")


def vllm_layer_number(layer_name: str) -> int | None:
    """Megatron's layer number (1-based) of a vLLM attention layer name ``model.layers.N.self_attn.attn``: N + 1."""
    match = _LAYER.search(layer_name)
    return int(match.group(1)) + 1 if match else None


def set_attention_kv_scales(scales: KvScales, model: torch.nn.Module) -> list[int]:
    """Run inside a vLLM worker (``LLM.apply_model``): give each of `model`'s attention layers its (key, value)
    scale from `scales` (by megatron layer number). Returns the layer numbers set."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.platforms import current_platform

    factor = 2.0 if current_platform.is_fp8_fnuz() else 1.0
    done = []
    for module in model.modules():
        layer = vllm_layer_number(module.layer_name) if isinstance(module, Attention) else None
        if layer not in scales:
            continue
        k_scale, v_scale = (factor * float(s) for s in scales[layer])
        module._k_scale.fill_(k_scale)
        module._v_scale.fill_(v_scale)
        module._k_scale_float, module._v_scale_float = k_scale, v_scale
        module._k_scale_cpu.fill_(k_scale)
        module._v_scale_cpu.fill_(v_scale)
        done.append(layer)
    return done
