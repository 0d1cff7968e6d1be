"""FP8 format constants: against the OCP spec's formulas and torch's dtype metadata."""

from __future__ import annotations

import pytest
import torch

from fp8rl.quant import E4M3, E5M2, FORMATS, get_format


@pytest.mark.parametrize(
    ("fmt", "dtype", "fmax", "min_normal", "min_subnormal", "max_exponent"),
    [
        (E4M3, torch.float8_e4m3fn, 448.0, 2.0**-6, 2.0**-9, 8),
        (E5M2, torch.float8_e5m2, 57344.0, 2.0**-14, 2.0**-16, 15),
    ],
)
def test_constants_match_the_spec(fmt, dtype, fmax, min_normal, min_subnormal, max_exponent):
    assert fmt.dtype == dtype
    assert fmt.max == fmax == torch.finfo(dtype).max
    assert fmt.min_normal == min_normal == torch.finfo(dtype).smallest_normal
    assert fmt.min_subnormal == min_subnormal
    assert fmt.max_exponent == max_exponent
    assert 1 + fmt.exponent_bits + fmt.mantissa_bits == 8


def test_max_from_the_bit_layout():
    """E4M3 "fn" reserves only S.1111.111 for NaN, so its max is 1.110b * 2^8; E5M2 reserves the top exponent."""
    assert E4M3.max == (1 + 6 / 8) * 2.0 ** (15 - E4M3.exponent_bias)
    assert E5M2.max == (1 + 3 / 4) * 2.0 ** (30 - E5M2.exponent_bias)


def test_lookup_by_name_and_passthrough():
    assert get_format("e4m3") is E4M3 and get_format("e5m2") is E5M2
    assert get_format(E5M2) is E5M2
    assert sorted(FORMATS) == ["e4m3", "e5m2"]


def test_unknown_format_raises_and_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown FP8 format 'e3m4'.*\['e4m3', 'e5m2'\]"):
        get_format("e3m4")
