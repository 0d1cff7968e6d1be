"""Scaling granularities: which elements of a 2-D tensor (R, C) share one FP8 scale.

Block shapes are (rows, cols); `None` means "the whole dimension". Every granularity is a block
shape, so one code path quantizes all of them. Shapes that are not multiples of the block get a
partial last block (its amax is taken over the elements that exist).
"""

from __future__ import annotations

import math

BlockShape = tuple[int | None, int | None]

GRANULARITIES: dict[str, BlockShape] = {
    "tensor": (None, None),  # one scale for the whole tensor (per-tensor current scaling)
    "row": (1, None),  # one scale per row: per token (activations), per output channel (weights)
    "col": (None, 1),  # one scale per column (the transposed operand of a rowwise GEMM)
    "block_1x128": (1, 128),  # DeepSeek-V3 activations and gradients
    "block_128x128": (128, 128),  # DeepSeek-V3 weights
    "mx_1x32": (1, 32),  # OCP MXFP8: 32 elements per power-of-two (E8M0) scale
    "block_128x1": (128, 1),  # block_1x128 of the transposed tensor (columnwise usage)
    "mx_32x1": (32, 1),  # mx_1x32 of the transposed tensor (columnwise usage)
}

# The granularity that quantizing x with `g` gives x^T: lets a GEMM operand be quantized
# in place of its transpose without copying the transpose first.
TRANSPOSED: dict[str, str] = {
    "tensor": "tensor",
    "row": "col",
    "col": "row",
    "block_1x128": "block_128x1",
    "block_128x1": "block_1x128",
    "block_128x128": "block_128x128",
    "mx_1x32": "mx_32x1",
    "mx_32x1": "mx_1x32",
}

# Granularities whose scale is always a power of two (stored as E8M0 on hardware).
POW2_ONLY = frozenset({"mx_1x32", "mx_32x1"})


def check_granularity(granularity: str) -> str:
    """Return the name if known; otherwise raise and list the valid names."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; valid granularities: {sorted(GRANULARITIES)}")
    return granularity


def block_shape(granularity: str, rows: int, cols: int) -> tuple[int, int]:
    """The concrete (block_rows, block_cols) for a (rows, cols) tensor."""
    block_rows, block_cols = GRANULARITIES[check_granularity(granularity)]
    return (max(rows, 1) if block_rows is None else block_rows, max(cols, 1) if block_cols is None else block_cols)


def scale_shape(granularity: str, rows: int, cols: int) -> tuple[int, ...]:
    """Shape of the scale tensor: (rows, cols) divided by the block shape, rounded up; () for "tensor"."""
    if granularity == "tensor":
        return ()
    block_rows, block_cols = block_shape(granularity, rows, cols)
    return (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
