"""How the rollout samples responses (shared by the built-in sampler and the vLLM engine)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample responses."""

    max_new_tokens: int  # response length limit, EOS included
    eos_token_ids: tuple[int, ...]  # stop a row once one is sampled (it is part of the response)
    pad_token_id: int  # fills a row after its EOS
    temperature: float = 1.0  # 0 = greedy; log-probs then come from softmax(logits)
    top_p: float = 1.0  # nucleus sampling mass; 1 = off
    vocab_size: int | None = None  # sample among token ids < vocab_size (the tokenizer's); None = every logit row

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        if not self.eos_token_ids:
            raise ValueError("eos_token_ids must name at least one token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 or None, got {self.vocab_size}")
