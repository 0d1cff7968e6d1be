"""Rollout engines behind one interface (`RolloutEngine`): the built-in Megatron engine; vLLM later."""

from fp8rl.rollout.base import RolloutBatch, RolloutEngine
from fp8rl.rollout.builtin import BuiltinEngine

__all__ = ["BuiltinEngine", "RolloutBatch", "RolloutEngine"]
