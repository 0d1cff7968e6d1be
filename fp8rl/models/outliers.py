"""Activation outlier channels, injected without changing the function the model computes.

LLMs carry a few residual-stream channels whose activations are 10-100x the rest ("massive
activations"); they reach every linear layer's input through the pre-norms. FP8 scaling granularity
matters through them: one outlier sets the scale of everything that shares its scale (the whole tensor
for tensorwise, the whole token for rowwise, only its 1x128 block for blockwise, its 32 elements for
MXFP8), and squeezes the other values towards FP8's subnormals. The tiny CPU model has no such
channels, so granularity orderings seen on LLMs cannot show on it (PILOT.md).

`inject_activation_outliers` reparametrizes every block: the pre-norm gain of channel c is multiplied
by `scale` and the matching input column of the linear that reads it (QKV after the input norm, FC1
after the pre-MLP norm) is divided by `scale`. In exact arithmetic the network is unchanged; what the
FP8 linears see is an input with `scale`-times larger channels, as in an LLM, read by weight columns
`scale` times smaller (LLMs' massive-activation channels are also read by small weights). This is an
ablation of ours (documented in results/README.md), not something the paper does.

E4M3 is a floating-point format: a larger scale moves the other values down in binades, and they only
lose precision once they leave its normal range (below 2^-6 of the scale's 448, i.e. outliers beyond
~1e4 x the typical value). Measured on the tiny model (results/tiny/mechanism_outlier_scan.md), outliers
up to 8192 x leave the FP8 noise unchanged; 32768 x separates the granularities.

Channel choice: `channels` distinct channels drawn with `seed` from the first `block` channels. With
hidden size 256 the tiny model has only two 1x128 blocks per token; an LLM (hidden 4096: 32 blocks)
has its handful of outlier channels in a few of its blocks, so we keep them in one block too.
"""

from __future__ import annotations

import torch

NORM_TO_LINEAR = (
    ("input_layernorm", "self_attention.linear_qkv"),
    ("pre_mlp_layernorm", "mlp.linear_fc1"),
)


def outlier_channel_ids(hidden_size: int, channels: int, seed: int = 0, block: int = 128) -> torch.Tensor:
    """The channels that get outliers: `channels` distinct ids in [0, min(block, hidden_size))."""
    pool = min(block, hidden_size)
    if not 0 < channels <= pool:
        raise ValueError(f"model.outlier_channels={channels} must be in 1..{pool} (one block of the hidden size)")
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(pool, generator=gen)[:channels].sort().values


@torch.no_grad()
def inject_activation_outliers(model: torch.nn.Module, channels: int, scale: float, seed: int = 0) -> torch.Tensor:
    """Scale `channels` pre-norm gains by `scale` and the reading linears' columns by 1/scale; returns the ids."""
    if scale <= 0:
        raise ValueError(f"model.outlier_scale={scale} must be positive")
    layers = list(_decoder_layers(model))
    hidden = layers[0].input_layernorm.weight.shape[0]
    ids = outlier_channel_ids(hidden, channels, seed)
    for layer in layers:
        for norm_name, linear_name in NORM_TO_LINEAR:
            norm = _get(layer, norm_name)
            linear = _get(layer, linear_name)
            if getattr(norm, "bias", None) is not None:
                norm.bias[ids] *= scale
            norm.weight[ids] *= scale
            linear.weight[:, ids] /= scale
    return ids


def _decoder_layers(model: torch.nn.Module):
    decoder = getattr(getattr(model, "module", model), "decoder", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise TypeError("inject_activation_outliers expects a megatron GPTModel (model.decoder.layers)")
    return decoder.layers


def _get(module: torch.nn.Module, dotted: str) -> torch.nn.Module:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module
