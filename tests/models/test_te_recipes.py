"""The fp8rl -> Transformer Engine recipe mapping and the hardware checks (no TE needed)."""

from __future__ import annotations

import pytest

from fp8rl.models.te_recipes import check_hardware_supports, te_recipe_kwargs
from fp8rl.quant import get_recipe


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [
        (get_recipe("tensorwise"), ("Float8CurrentScaling", {"fp8_format": "E4M3"})),
        (get_recipe("tensorwise", fmt="hybrid"), ("Float8CurrentScaling", {"fp8_format": "HYBRID"})),
        (get_recipe("blockwise"), ("Float8BlockScaling", {"fp8_format": "E4M3"})),
        (get_recipe("mxfp8"), ("MXFP8BlockScaling", {"fp8_format": "E4M3"})),
        (
            get_recipe("tensorwise", scaling="delayed", amax_history_len=8, margin=1),
            (
                "DelayedScaling",
                {"fp8_format": "E4M3", "margin": 1, "amax_history_len": 8, "amax_compute_algo": "max"},
            ),
        ),
    ],
)
def test_recipe_maps_to_the_te_class_and_arguments(recipe, expected) -> None:
    assert te_recipe_kwargs(recipe) == expected


def test_rowwise_has_no_te_recipe_and_says_what_to_use() -> None:
    with pytest.raises(ValueError, match="no Transformer Engine equivalent"):
        te_recipe_kwargs("rowwise")


def test_hardware_checks_name_the_capability_needed() -> None:
    check_hardware_supports("blockwise", (9, 0))
    with pytest.raises(ValueError, match=r"10\.0\+"):
        check_hardware_supports("mxfp8", (9, 0))
    with pytest.raises(ValueError, match="none was found"):
        check_hardware_supports("tensorwise", None)
