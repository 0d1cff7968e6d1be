"""FP8 recipes: operand granularities and formats, defaults, validation."""

from __future__ import annotations

import dataclasses

import pytest

from fp8rl.quant import RECIPE_NAMES, Fp8Recipe, get_recipe
from fp8rl.quant.granularity import TRANSPOSED

# (activation, weight, gradient) granularity of each recipe, as the issue specifies them.
EXPECTED = {
    "tensorwise": ("tensor", "tensor", "tensor"),
    "rowwise": ("row", "row", "row"),
    "blockwise": ("block_1x128", "block_128x128", "block_1x128"),
    "mxfp8": ("mx_1x32", "mx_1x32", "mx_1x32"),
}


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_operand_granularities(name):
    recipe = get_recipe(name)
    assert (recipe.activation_granularity, recipe.weight_granularity, recipe.gradient_granularity) == EXPECTED[name]


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_formats_e4m3_everywhere_or_hybrid_e5m2_gradients(name):
    e4m3, hybrid = get_recipe(name, fmt="e4m3"), get_recipe(name, fmt="hybrid")
    assert (e4m3.forward_format, e4m3.backward_format) == ("e4m3", "e4m3")
    assert (hybrid.forward_format, hybrid.backward_format) == ("e4m3", "e5m2")


@pytest.mark.parametrize(
    ("name", "fmt", "pow2"),
    [("tensorwise", "hybrid", False), ("rowwise", "e4m3", True), ("blockwise", "e4m3", False), ("mxfp8", "e4m3", True)],
)
def test_each_name_defaults_to_the_papers_torchao_recipe(name, fmt, pow2):
    """TorchAO's tensorwise has E5M2 gradients, its rowwise power-of-two scales, its blockwise FP32 scales
    (tests/quant/test_torchao_recipes.py checks them against torchao itself); MXFP8's E8M0 scales are pow2."""
    recipe, built = get_recipe(name), Fp8Recipe(name)
    assert recipe == built and (recipe.fmt, recipe.pow2_scale, recipe.uses_pow2_scales) == (fmt, pow2, pow2)


def test_scale_overrides():
    """TE's own blockwise default (power-of-two scales) is one override away; MXFP8 always has them."""
    assert get_recipe("blockwise", pow2_scale=True).uses_pow2_scales
    assert get_recipe("mxfp8", pow2_scale=False).uses_pow2_scales
    assert not get_recipe("blockwise", pow2_scale=False).uses_pow2_scales
    assert get_recipe("rowwise", pow2_scale=True).uses_pow2_scales


def test_delayed_scaling_options():
    recipe = get_recipe("tensorwise", scaling="delayed", amax_history_len=4, amax_compute_algo="most_recent", margin=1)
    assert (recipe.scaling, recipe.amax_history_len, recipe.amax_compute_algo, recipe.margin) == (
        "delayed",
        4,
        "most_recent",
        1,
    )


def test_get_recipe_passes_recipes_through_and_applies_overrides():
    recipe = get_recipe("blockwise", fmt="hybrid")
    assert get_recipe(recipe) is recipe and get_recipe(recipe, fmt=None, pow2_scale=None) is recipe
    changed = get_recipe(recipe, pow2_scale=True)
    assert changed.fmt == "hybrid" and changed.pow2_scale and not recipe.pow2_scale


def test_recipes_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_recipe("rowwise").name = "tensorwise"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "channelwise"}, r"unknown FP8 recipe 'channelwise'.*tensorwise"),
        ({"name": "rowwise", "fmt": "e5m2"}, r"unknown FP8 format mode.*hybrid"),
        ({"name": "rowwise", "scaling": "lazy"}, r"unknown scaling.*delayed"),
        ({"name": "rowwise", "scaling": "delayed"}, r"delayed scaling exists only for the tensorwise recipe"),
        ({"name": "tensorwise", "amax_compute_algo": "mean"}, r"one of \['max', 'most_recent'\]"),
        ({"name": "tensorwise", "amax_history_len": 0}, r">= 1"),
    ],
)
def test_invalid_recipes_raise_with_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Fp8Recipe(**kwargs)


def test_every_granularity_has_a_transpose_and_it_is_an_involution():
    for granularity, transposed in TRANSPOSED.items():
        assert TRANSPOSED[transposed] == granularity
