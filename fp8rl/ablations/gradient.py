"""Gradient ablations (`fp8rl.trainer.hooks.GradientAblation`): tokens whose gradient an update zeroes, drawn
from generators seeded by (run seed, step, update, data-parallel rank), so a run repeats bit for bit.

- `SyntheticOverclip` (``clipping.synthetic_overclip_std``, the 2026-12-01 collapse study's positive control):
  Gaussian noise of that std on the log-ratio of each token; a negative-advantage token whose noisy ratio falls
  to the lower bound while its true one does not loses its gradient (`algos.synthetic_overclip_mask`).
- `ClassDrop` (``clipping.synthetic_drop_neg`` = q, the junk organism's controls): each negative-advantage token
  of a class (the task's junk tokens) loses its gradient with probability q; ``matched`` removes as many
  negative tokens outside the class instead, drawn uniformly (`algos.synthetic_class_drop_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8rl import algos
from fp8rl.trainer.batch import step_generator, update_key
from fp8rl.trainer.hooks import UpdateSite

OVERCLIP_SALT = 4  # the synthetic over-clipping's noise
DROP_SALT = 5  # the class-targeted removal's draws


@dataclass(frozen=True)
class SyntheticOverclip:
    std: float
    seed: int

    def for_update(self, site: UpdateSite) -> LogRatioNoise:
        gen = step_generator(self.seed, update_key(site.step, site.update, site.rank), OVERCLIP_SALT)
        noise = torch.randn(site.old_logp.shape, generator=gen, dtype=torch.float32) * self.std
        return LogRatioNoise(noise.to(site.old_logp.device))


@dataclass(frozen=True)
class LogRatioNoise:
    """An update's log-ratio noise (rows, response_len); the tokens it zeroes depend on the live ratio."""

    noise: torch.Tensor

    def select(self, index: torch.Tensor) -> LogRatioNoise:
        return LogRatioNoise(self.noise[index])

    def zeroed(self, log_ratio: torch.Tensor, tokens: algos.TokenBatch, low: float) -> torch.Tensor:
        return algos.synthetic_overclip_mask(log_ratio, tokens.adv, tokens.mask, self.noise, low)


@dataclass(frozen=True)
class ClassDrop:
    q: float
    matched: bool  # remove as many negative tokens outside the class instead
    class_ids: frozenset[int]
    seed: int

    def for_update(self, site: UpdateSite) -> FixedTokens:
        gen = step_generator(self.seed, update_key(site.step, site.update, site.rank), DROP_SALT)
        ids = site.batch.response_ids
        uniform = torch.rand(ids.shape, generator=gen).to(ids.device)
        in_class = torch.isin(ids, torch.tensor(sorted(self.class_ids), device=ids.device))
        mask = algos.synthetic_class_drop_mask(site.adv, site.loss_mask, in_class, uniform, self.q, self.matched)
        return FixedTokens(mask)


@dataclass(frozen=True)
class FixedTokens:
    """Tokens chosen before the update's forward pass (rows, response_len) bool."""

    mask: torch.Tensor

    def select(self, index: torch.Tensor) -> FixedTokens:
        return FixedTokens(self.mask[index])

    def zeroed(self, log_ratio: torch.Tensor, tokens: algos.TokenBatch, low: float) -> torch.Tensor:
        return self.mask
