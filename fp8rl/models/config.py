"""Model shapes as typed configs, and named presets.

"tiny" is the CPU workhorse (Qwen3-like: RMSNorm, SwiGLU, RoPE, QK-norm, no bias); its vocabulary
comes from the task tokenizer (``vocab_size=None`` until :func:`with_tokenizer_vocab`). The real
shapes are for GPU runs only; they are never instantiated on CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

VOCAB_PAD_MULTIPLE = 64  # embedding rows are padded to this multiple (GEMM-friendly, like Megatron's padding)
NORMALIZATIONS = ("RMSNorm", "LayerNorm")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer built with megatron-core's GPTModel."""

    name: str  # preset name, for logs and cache keys
    num_layers: int  # transformer blocks
    hidden_size: int  # residual-stream width (d_model)
    num_attention_heads: int  # query heads
    num_query_groups: int  # key/value heads (GQA); equal to num_attention_heads for plain MHA
    ffn_hidden_size: int  # MLP inner width (per branch of the SwiGLU gate)
    vocab_size: int | None  # embedding rows; None = take the task tokenizer's, padded (see with_tokenizer_vocab)
    max_seq_len: int  # longest sequence (prompt + response) the model is built for
    head_dim: int | None = None  # per-head width (kv_channels); None = hidden_size // num_attention_heads
    rotary_base: float = 1_000_000.0  # RoPE theta
    norm_epsilon: float = 1e-6  # RMSNorm / LayerNorm epsilon
    normalization: str = "RMSNorm"  # "RMSNorm" or "LayerNorm"
    qk_layernorm: bool = True  # normalize queries and keys per head before RoPE (Qwen3)
    add_qkv_bias: bool = False  # bias on the fused QKV projection only (Qwen2.5)
    add_bias_linear: bool = False  # bias on every other block linear
    swiglu: bool = True  # gated SiLU MLP (two fc1 branches); False = plain GELU MLP
    tie_embeddings: bool = False  # share the input embedding with the output layer
    hidden_dropout: float = 0.0  # dropout after attention / MLP (0 for RL: log-probs must be deterministic)
    attention_dropout: float = 0.0  # dropout on attention probabilities (0 for the same reason)
    init_std: float = 0.02  # std of the normal weight init (output projections are scaled by 1/sqrt(2 L))

    def __post_init__(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization={self.normalization!r}; valid: {NORMALIZATIONS}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; set head_dim explicitly"
            )
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")

    @property
    def kv_channels(self) -> int:
        """Per-head width."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads


def parameter_count(cfg: ModelConfig) -> int:
    """Number of parameters of the GPTModel built from ``cfg`` (vocab resolved), without building it."""
    if cfg.vocab_size is None:
        raise ValueError(f"model {cfg.name!r} has no vocab_size yet")
    hidden, head_dim = cfg.hidden_size, cfg.kv_channels
    q_width, kv_width = cfg.num_attention_heads * head_dim, cfg.num_query_groups * head_dim
    attention = hidden * (q_width + 2 * kv_width) + q_width * hidden
    attention_bias = (q_width + 2 * kv_width) * (cfg.add_qkv_bias or cfg.add_bias_linear) + hidden * cfg.add_bias_linear
    fc1_width = cfg.ffn_hidden_size * (2 if cfg.swiglu else 1)
    mlp = hidden * fc1_width + cfg.ffn_hidden_size * hidden + (fc1_width + hidden) * cfg.add_bias_linear
    norm = hidden * (1 if cfg.normalization == "RMSNorm" else 2)  # LayerNorm adds a bias
    qk_norm = 2 * head_dim * (1 if cfg.normalization == "RMSNorm" else 2) * cfg.qk_layernorm
    per_layer = attention + attention_bias + mlp + 2 * norm + qk_norm
    embeddings = cfg.vocab_size * hidden * (1 if cfg.tie_embeddings else 2)
    return cfg.num_layers * per_layer + norm + embeddings


def padded_vocab_size(num_tokens: int, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    """Smallest multiple of ``multiple`` that holds ``num_tokens`` embedding rows."""
    return -(-num_tokens // multiple) * multiple


def with_tokenizer_vocab(cfg: ModelConfig, tokenizer_vocab_size: int) -> ModelConfig:
    """Resolve ``vocab_size`` for a tokenizer: padded tokenizer size if unset, else checked to fit."""
    if cfg.vocab_size is None:
        return dataclasses.replace(cfg, vocab_size=padded_vocab_size(tokenizer_vocab_size))
    if tokenizer_vocab_size > cfg.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer_vocab_size} tokens but model {cfg.name!r} has vocab_size={cfg.vocab_size}"
        )
    return cfg


_MODEL_PRESETS: dict[str, ModelConfig] = {}


def register_model_preset(cfg: ModelConfig) -> ModelConfig:
    """Register ``cfg`` under ``cfg.name``; registering a different config under a taken name raises."""
    taken = _MODEL_PRESETS.get(cfg.name)
    if taken is not None and taken != cfg:
        raise ValueError(f"model preset {cfg.name!r} is already registered with a different config")
    _MODEL_PRESETS[cfg.name] = cfg
    return cfg


def get_model_config(name: str) -> ModelConfig:
    """The preset registered as ``name``; an unknown name raises and lists the valid ones."""
    if name not in _MODEL_PRESETS:
        raise KeyError(f"unknown model preset {name!r}; valid: {sorted(_MODEL_PRESETS)}")
    return _MODEL_PRESETS[name]


def model_preset_names() -> list[str]:
    """Names of all registered presets, sorted."""
    return sorted(_MODEL_PRESETS)


# CPU model: 3.44M parameters at a 64-row vocabulary; head_dim 64 so RoPE and QK-norm act as in Qwen3.
register_model_preset(
    ModelConfig(
        name="tiny",
        num_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        num_query_groups=4,
        ffn_hidden_size=768,
        vocab_size=None,
        max_seq_len=64,
        rotary_base=10_000.0,
    )
)

# Qwen3-8B-Base (HF config.json): 36 layers, 4096 wide, 32 query / 8 KV heads of 128, ffn 12288,
# vocab 151936, rope theta 1e6, RMSNorm eps 1e-6, QK-norm, no bias, untied embeddings, 32K positions.
register_model_preset(
    ModelConfig(
        name="qwen3_8b",
        num_layers=36,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=12288,
        vocab_size=151936,
        max_seq_len=32768,
        head_dim=128,
        rotary_base=1_000_000.0,
        norm_epsilon=1e-6,
        qk_layernorm=True,
        tie_embeddings=False,
    )
)

# Qwen3-14B-Base: 40 layers, 5120 wide, 40 query / 8 KV heads of 128, ffn 17408, otherwise as Qwen3-8B.
register_model_preset(
    ModelConfig(
        name="qwen3_14b",
        num_layers=40,
        hidden_size=5120,
        num_attention_heads=40,
        num_query_groups=8,
        ffn_hidden_size=17408,
        vocab_size=151936,
        max_seq_len=32768,
        head_dim=128,
        rotary_base=1_000_000.0,
        norm_epsilon=1e-6,
        qk_layernorm=True,
        tie_embeddings=False,
    )
)

# Qwen2.5-32B: 64 layers, 5120 wide, 40 query / 8 KV heads of 128, ffn 27648, vocab 152064,
# rope theta 1e6, RMSNorm eps 1e-5, QKV bias (no other bias), no QK-norm, untied, 128K positions.
register_model_preset(
    ModelConfig(
        name="qwen2_5_32b",
        num_layers=64,
        hidden_size=5120,
        num_attention_heads=40,
        num_query_groups=8,
        ffn_hidden_size=27648,
        vocab_size=152064,
        max_seq_len=131072,
        head_dim=128,
        rotary_base=1_000_000.0,
        norm_epsilon=1e-5,
        qk_layernorm=False,
        add_qkv_bias=True,
        tie_embeddings=False,
    )
)
