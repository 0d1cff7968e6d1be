"""Activation outlier channels, injected without changing the function the model computes.

LLMs carry a few residual-stream channels whose activations are 10-10^4 x the rest ("massive
activations"); they reach every linear layer's input through the pre-norms. FP8 scaling granularity
matters through them: one outlier sets the scale of everything that shares its scale (the whole tensor
for tensorwise, the whole token for rowwise, only its 1x128 block for blockwise, its 32 elements for
MXFP8), and squeezes the other values towards FP8's subnormals. The tiny CPU model has no such
channels, so granularity orderings seen on LLMs cannot show on it (PILOT.md).

`inject_activation_outliers` gives the linears that read the pre-norms (QKV, FC1) an input-channel
scale s (`scale` on `channels` channels, 1 elsewhere): their GEMM computes (x * s) @ (W / s)^T, in BF16
or in the FP8 recipe, so the operands the quantizer sees have `scale`-times larger activation channels
read by `scale`-times smaller weight columns (LLMs' massive-activation channels are also read by small
weights), while the parameters, their gradients' direction and the optimizer's view of them stay as
trained. (Rescaling the parameters instead, norm gain x s and weight columns / s, is not invariant
under Adam, whose per-parameter steps then move the shrunken columns s times too far: it broke BF16
training in a first attempt.) In exact arithmetic the network is unchanged. This is an ablation of ours
(its findings in results/README.md, its table results/tiny/stress_outliers-tiny.md), not something the paper does.

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

READING_LINEARS = ("self_attention.linear_qkv", "mlp.linear_fc1")  # the linears that read the pre-norms


def outlier_channel_ids(hidden_size: int, channels: int, seed: int = 0, block: int = 128) -> torch.Tensor:
    """The channels that get outliers: `channels` distinct ids in [0, min(block, hidden_size))."""
    pool = min(block, hidden_size)
    if not 0 < channels <= pool:
        raise ValueError(f"model.outlier_channels={channels} must be in 1..{pool} (one block of the hidden size)")
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(pool, generator=gen)[:channels].sort().values


@torch.no_grad()
def inject_activation_outliers(model: torch.nn.Module, channels: int, scale: float, seed: int = 0) -> torch.Tensor:
    """Give QKV and FC1 of every block the input-channel scale (`scale` on `channels` channels); returns the ids."""
    if scale <= 0:
        raise ValueError(f"model.outlier_scale={scale} must be positive")
    layers = list(_decoder_layers(model))
    hidden = layers[0].input_layernorm.weight.shape[0]
    ids = outlier_channel_ids(hidden, channels, seed)
    channel_scale = torch.ones(hidden)
    channel_scale[ids] = scale
    for layer in layers:
        for linear_name in READING_LINEARS:
            linear = _get(layer, linear_name)
            if not hasattr(linear, "input_channel_scale"):
                raise TypeError(f"{linear_name} is not an fp8rl FP8-switchable linear (build_gpt_model)")
            linear.input_channel_scale = channel_scale.clone()
    return ids


def remove_activation_outliers(model: torch.nn.Module) -> None:
    """Undo `inject_activation_outliers` (the parameters were never changed)."""
    for layer in _decoder_layers(model):
        for linear_name in READING_LINEARS:
            _get(layer, linear_name).input_channel_scale = None


def _decoder_layers(model: torch.nn.Module):
    decoder = getattr(getattr(model, "module", model), "decoder", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise TypeError("inject_activation_outliers expects a megatron GPTModel (model.decoder.layers)")
    return decoder.layers


def _get(module: torch.nn.Module, dotted: str) -> torch.nn.Module:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module
