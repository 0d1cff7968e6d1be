"""Character-level tokenizer built with Hugging Face ``tokenizers`` and saved in HF format.

Every character of the alphabet is one token; ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>`` are special
tokens with ids 0-3. ``encode(text)`` prepends ``<bos>`` (a template post-processor, so HF and vLLM
text prompts get it too); ``encode(text, add_bos=False)`` does not. The saved directory
(tokenizer.json, tokenizer_config.json, special_tokens_map.json) loads with
``tokenizers.Tokenizer.from_file`` and with transformers' ``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


class CharTokenizer:
    """A ``tokenizers.Tokenizer`` with one token per character, and its special-token ids."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.pad_id = self._special_id(PAD)
        self.bos_id = self._special_id(BOS)
        self.eos_id = self._special_id(EOS)
        self.unk_id = self._special_id(UNK)

    def _special_id(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer has no {token} token")
        return token_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The ids that end a response: <eos>."""
        return (self.eos_id,)

    @property
    def vocab_size(self) -> int:
        """Number of tokens, special tokens included."""
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text`` (one per character), with a leading ``<bos>`` unless ``add_bos`` is False."""
        return self.tokenizer.encode(text, add_special_tokens=add_bos).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens dropped unless ``skip_special_tokens`` is False."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | Path, model_max_length: int) -> Path:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(directory / "tokenizer.json"))
        special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special_map,
            "model_max_length": model_max_length,
            "padding_side": "left",  # prompts are left-padded for generation (see fp8rl.models.logprobs)
            "clean_up_tokenization_spaces": False,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        (directory / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> CharTokenizer:
        """Load a directory written by :meth:`save`."""
        return cls(Tokenizer.from_file(str(Path(directory) / "tokenizer.json")))


def build_char_tokenizer(alphabet: str) -> CharTokenizer:
    """Tokenizer whose ids are the special tokens (0-3) then each distinct character of ``alphabet`` in order."""
    chars = list(dict.fromkeys(alphabet))
    if any(len(token) != 1 for token in chars):
        raise ValueError("alphabet must be a string of single characters")
    vocab = {token: idx for idx, token in enumerate([*SPECIAL_TOKENS, *chars])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    return CharTokenizer(tokenizer)


class CharTask:
    """What the character-level tasks (arithmetic, chain) share: prompt and target ids, the response body
    before <eos>, the batch reward and the garble reason. A subclass sets ``tokenizer``, ``max_response_tokens``,
    ``answer_pattern`` and ``_answer_ids`` and defines ``reward(problem, response_ids)``."""

    tokenizer: CharTokenizer
    max_response_tokens: int
    answer_pattern: re.Pattern[str]  # a well-formed response body
    _answer_ids: frozenset[int]  # the token ids an answer may use

    def prompt_ids(self, problem) -> list[int]:
        """<bos> then the prompt characters."""
        return self.tokenizer.encode(problem.prompt)

    def target_ids(self, problem) -> list[int]:
        """The answer characters then <eos> (the supervised warm start's targets)."""
        return [*self.tokenizer.encode(problem.answer, add_bos=False), self.tokenizer.eos_id]

    def rewards(self, problems: Sequence, responses: Sequence[Sequence[int]]) -> list[float]:
        """The reward of each response."""
        return [self.reward(p, r) for p, r in zip(problems, responses, strict=True)]

    def split_at_eos(self, response_ids: Sequence[int]) -> tuple[list[int], bool]:
        """Tokens before the first <eos> within the length limit, and whether that <eos> exists."""
        window = [int(token) for token in response_ids[: self.max_response_tokens]]
        if self.tokenizer.eos_id in window:
            return window[: window.index(self.tokenizer.eos_id)], True
        return window, False

    def garble_reason(self, response_ids: Sequence[int]) -> str | None:
        """ "invalid_token", "no_eos", "unparseable" (checked in this order), or None if well formed."""
        body, has_eos = self.split_at_eos(response_ids)
        if any(token not in self._answer_ids for token in body):
            return "invalid_token"
        if not has_eos:
            return "no_eos"
        if not self.answer_pattern.fullmatch(self.tokenizer.decode(body)):
            return "unparseable"
        return None
