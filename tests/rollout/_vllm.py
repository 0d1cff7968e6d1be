"""Marks shared by the vLLM tests: integration lane, generous timeout, skipped (with the fix) without vLLM."""

from __future__ import annotations

import importlib.util

import pytest

VLLM_INTEGRATION = [
    pytest.mark.integration,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed: `make setup-vllm`, then run these tests with .venv-vllm/bin/python",
    ),
]
