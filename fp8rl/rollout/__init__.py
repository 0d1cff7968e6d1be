"""Rollout engines behind one interface (`RolloutEngine`): the built-in Megatron engine
(`fp8rl.rollout.builtin`) and vLLM (`fp8rl.rollout.vllm_engine`, which imports vLLM only when an engine is
built). This package imports neither, so reading the engine names costs nothing.
"""

from fp8rl.rollout.base import ROLLOUT_ENGINES, RolloutBatch, RolloutEngine

__all__ = ["ROLLOUT_ENGINES", "RolloutBatch", "RolloutEngine"]
