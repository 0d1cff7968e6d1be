import json

import pytest
from tokenizers import Tokenizer

from fp8rl.tasks.tokenizer import SPECIAL_TOKENS, build_char_tokenizer

ALPHABET = "0123456789+-*="


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(ALPHABET)


def test_ids_are_specials_then_characters(tokenizer):
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id) == (0, 1, 2, 3)
    assert tokenizer.vocab_size == len(SPECIAL_TOKENS) + len(ALPHABET)
    assert tokenizer.encode("0", add_bos=False) == [4]


def test_one_token_per_character_with_bos_by_default(tokenizer):
    ids = tokenizer.encode("123+45=")
    assert ids[0] == tokenizer.bos_id and len(ids) == 8
    assert tokenizer.decode(ids) == "123+45="
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<bos>123+45="


def test_unknown_characters_map_to_unk(tokenizer):
    assert tokenizer.encode("1a", add_bos=False) == [tokenizer.encode("1", add_bos=False)[0], tokenizer.unk_id]


def test_duplicate_characters_are_kept_once():
    assert build_char_tokenizer("aab").vocab_size == len(SPECIAL_TOKENS) + 2


def test_saved_directory_loads_with_tokenizers(tokenizer, tmp_path):
    tokenizer.save(tmp_path, model_max_length=32)
    assert {p.name for p in tmp_path.iterdir()} == {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    loaded = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert loaded.encode("987*6=").ids == tokenizer.encode("987*6=")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (config["pad_token"], config["bos_token"], config["eos_token"]) == ("<pad>", "<bos>", "<eos>")


def test_saved_directory_loads_with_transformers(tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizer.save(tmp_path, model_max_length=32)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert hf("12+3=")["input_ids"] == tokenizer.encode("12+3=")
    assert hf.decode(tokenizer.encode("12+3=") + [2], skip_special_tokens=True) == "12+3="
    assert hf.padding_side == "left"
