"""Rollout engines behind one interface (`RolloutEngine`): the built-in Megatron engine and vLLM.

`fp8rl.rollout.vllm_engine` imports vLLM only when an engine is built.
"""

from fp8rl.rollout.base import RolloutBatch, RolloutEngine
from fp8rl.rollout.builtin import BuiltinEngine
from fp8rl.rollout.vllm_engine import VllmEngine, check_vllm_support

__all__ = ["BuiltinEngine", "RolloutBatch", "RolloutEngine", "VllmEngine", "check_vllm_support"]
