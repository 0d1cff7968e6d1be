"""The hardware checks of the FP8 recipes (no TE needed)."""

from __future__ import annotations

import pytest

from fp8rl.models.te_recipes import check_hardware_supports


def test_hardware_checks_name_the_capability_needed() -> None:
    check_hardware_supports("blockwise", (9, 0))
    with pytest.raises(ValueError, match=r"10\.0\+"):
        check_hardware_supports("mxfp8", (9, 0))
    with pytest.raises(ValueError, match="none was found"):
        check_hardware_supports("tensorwise", None)
