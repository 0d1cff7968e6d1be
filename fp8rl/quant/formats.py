"""FP8 formats: the two OCP 8-bit floating point encodings used for training.

E4M3 ("fn" variant: no infinities, one NaN pattern, max 448) carries weights and activations;
E5M2 (IEEE-like, max 57344) carries gradients in the "hybrid" recipes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 encoding and the constants its quantizers need."""

    name: str  # "e4m3" or "e5m2"
    dtype: torch.dtype  # torch storage dtype
    max: float  # largest finite magnitude
    exponent_bits: int
    mantissa_bits: int
    exponent_bias: int

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value, 2^(1 - bias)."""
        return 2.0 ** (1 - self.exponent_bias)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive subnormal value, 2^(1 - bias - mantissa_bits)."""
        return 2.0 ** (1 - self.exponent_bias - self.mantissa_bits)

    @property
    def max_exponent(self) -> int:
        """Unbiased exponent of `max` (8 for E4M3, 15 for E5M2): the MX spec's emax_elem."""
        return int(torch.tensor(self.max).log2().floor().item())


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, exponent_bits=4, mantissa_bits=3, exponent_bias=7)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, exponent_bits=5, mantissa_bits=2, exponent_bias=15)

FORMATS: dict[str, Fp8Format] = {f.name: f for f in (E4M3, E5M2)}


def get_format(fmt: str | Fp8Format) -> Fp8Format:
    """Look a format up by name ("e4m3", "e5m2"); an unknown name raises and lists the valid ones."""
    if isinstance(fmt, Fp8Format):
        return fmt
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown FP8 format {fmt!r}; valid formats: {sorted(FORMATS)}") from None
