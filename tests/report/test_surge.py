import pytest

from fp8rl.report.surge import SurgeRule, detect_surge, moving_average


def test_flat_or_falling_entropy_is_not_a_surge() -> None:
    assert not detect_surge([0.3] * 40).surged
    falling = [0.4 - 0.008 * i for i in range(40)]
    assert not detect_surge(falling).surged


def test_a_sustained_mid_run_rise_is_a_surge() -> None:
    entropy = [0.2] * 20 + [0.6] * 10 + [0.25] * 10
    surge = detect_surge(entropy)
    assert surge.surged
    assert surge.baseline == pytest.approx(0.2)
    assert surge.ratio == pytest.approx(3.0)


def test_one_noisy_step_is_smoothed_away() -> None:
    entropy = [0.2] * 20 + [0.5] + [0.2] * 19  # window 5: peak 0.26 -> ratio 1.3
    surge = detect_surge(entropy)
    assert not surge.surged
    assert surge.ratio == pytest.approx(0.26 / 0.2)


def test_a_large_ratio_of_tiny_numbers_needs_the_minimum_rise() -> None:
    entropy = [0.01] * 10 + [0.05] * 10  # ratio 5 but rise 0.04 < 0.05 nats
    assert not detect_surge(entropy).surged
    assert detect_surge(entropy, SurgeRule(min_rise=0.03)).surged


def test_moving_average_is_centred_and_shrinks_at_the_edges() -> None:
    assert moving_average([0, 0, 3, 0, 0], 3) == [0, 1, 1, 1, 0]


def test_too_short_a_run_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 4 steps"):
        detect_surge([0.1, 0.2, 0.3])
