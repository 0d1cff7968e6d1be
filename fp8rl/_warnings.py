"""Silence megatron-core's import-time notices that are expected on CPU (entry points call this)."""

from __future__ import annotations

import warnings

EXPECTED_ON_CPU = (
    r".*Transformer Engine and Apex are not installed.*",
    r".*Apex is not installed.*",
    r".*full scope is deprecated.*",
    r".*MLP requires ffn_hidden_size.*",
    r".*Mismatch dtype between input and weight.*",
)


def silence_expected_warnings() -> None:
    for pattern in EXPECTED_ON_CPU:
        warnings.filterwarnings("ignore", message=pattern)
