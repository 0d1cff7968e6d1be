"""Models: megatron-core GPTModel on CPU or GPU, switchable emulated-FP8 linears, log-probs, KV-cache sampling.

Only the configs are re-exported here, so that reading a config does not import megatron-core;
import the rest from its module (``fp8rl.models.gpt``, ``.logprobs``, ``.generate``, ``.cpu_compat``).
"""

from fp8rl.models.config import (
    ModelConfig,
    get_model_config,
    model_preset_names,
    padded_vocab_size,
    register_model_preset,
    with_tokenizer_vocab,
)

__all__ = [
    "ModelConfig",
    "get_model_config",
    "model_preset_names",
    "padded_vocab_size",
    "register_model_preset",
    "with_tokenizer_vocab",
]
