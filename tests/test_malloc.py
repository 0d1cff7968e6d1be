"""fp8rl.malloc: glibc's mallopt settings that keep freed buffers in the process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fp8rl import malloc
from fp8rl.config import RunConfig, with_overrides
from fp8rl.identity import config_hash


def test_glibc_accepts_both_settings_and_provenance_says_so():
    if malloc._glibc() is None:
        pytest.skip("no glibc mallopt on this platform")
    assert malloc.keep_freed_memory() is True
    assert malloc.malloc_state().startswith("keep-freed")


def test_without_glibc_it_is_a_no_op_that_says_why(monkeypatch):
    monkeypatch.setattr(malloc, "_glibc", lambda: None)
    monkeypatch.setattr(malloc, "_state", "default")
    assert malloc.keep_freed_memory() is False
    assert malloc.malloc_state() == "default (no glibc mallopt)"


def test_a_fresh_process_starts_with_glibc_defaults():
    code = "from fp8rl.malloc import malloc_state; print(malloc_state())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "default"


def test_the_setting_is_speed_only_and_leaves_the_config_hash_alone():
    cfg = RunConfig()
    on = with_overrides(cfg, {"trainer.keep_freed_memory": not cfg.trainer.keep_freed_memory})
    assert config_hash(cfg) == config_hash(on)
