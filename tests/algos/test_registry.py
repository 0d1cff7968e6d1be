import pytest

from fp8rl.algos import (
    ADVANTAGE_ESTIMATORS,
    CLIP_BOUND_POLICIES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    Registry,
    UnknownNameError,
    get_advantage_estimator,
    get_clip_bound_policy,
    get_kl_estimator,
    get_policy_loss,
    get_rollout_correction,
    register_policy_loss,
)


def test_register_and_get():
    registry = Registry("thing")

    @registry.register("b", "alias_b")
    def thing_b():
        return "b"

    registry.add("a", len)
    assert registry.get("b") is thing_b
    assert registry.get("alias_b") is thing_b
    assert registry.names() == ["a", "alias_b", "b"]
    assert "a" in registry and "zzz" not in registry
    assert len(registry) == 3


def test_unknown_name_raises_listing_sorted_names():
    registry = Registry("widget")
    registry.add("zeta", len)
    registry.add("alpha", len)
    with pytest.raises(KeyError) as excinfo:
        registry.get("beta")
    assert isinstance(excinfo.value, ValueError)
    assert str(excinfo.value) == "unknown widget 'beta'; valid names: alpha, zeta"


def test_registering_a_different_object_under_a_taken_name_raises():
    registry = Registry("widget")
    registry.add("x", len)
    registry.add("x", len)  # the same object again is a no-op
    with pytest.raises(ValueError, match="already registered"):
        registry.add("x", abs)
    assert registry.get("x") is len


def test_empty_name_rejected():
    with pytest.raises(ValueError):
        Registry("widget").add("", len)


@pytest.mark.parametrize(
    ("getter", "registry", "expected"),
    [
        (get_policy_loss, POLICY_LOSSES, {"ppo_clip", "dual_clip", "cispo", "vanilla"}),
        (get_advantage_estimator, ADVANTAGE_ESTIMATORS, {"grpo", "rloo"}),
        (get_kl_estimator, KL_ESTIMATORS, {"k1", "k2", "k3", "kl", "mse", "low_var_kl"}),
        (
            get_rollout_correction,
            ROLLOUT_CORRECTIONS,
            {"none", "tis_token", "tis_seq", "mis_token", "mis_seq", "icepop"},
        ),
        (get_clip_bound_policy, CLIP_BOUND_POLICIES, {"standard", "calibrated"}),
    ],
)
def test_public_registries(getter, registry, expected):
    assert set(registry.names()) == expected
    for name in expected:
        assert getter(name) is registry.get(name)
    with pytest.raises(UnknownNameError) as excinfo:
        getter("no_such_name")
    assert ", ".join(sorted(expected)) in str(excinfo.value)


def test_policy_loss_registration_of_a_different_surrogate_raises():
    def another_surrogate(ratio, adv, mask, clip_low, clip_high):
        return -adv * ratio, {}

    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("ppo_clip")(another_surrogate)
    assert get_policy_loss("ppo_clip").surrogate is not another_surrogate
    # re-registering the registered surrogate is a no-op
    register_policy_loss("ppo_clip")(get_policy_loss("ppo_clip").surrogate)
