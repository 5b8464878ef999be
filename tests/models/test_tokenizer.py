"""The local character tokenizer: ids, round trips, offline save/load."""

from __future__ import annotations

import string

import pytest
from transformers import AutoTokenizer

from ais_lightning.models import build_char_tokenizer

ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_special_ids_and_size(tok):
    assert len(tok) == 3 + 95 + 1
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_one_id_per_char_in_vocab_order(tok):
    # ' ' is the first character (id 3), so chr(c) has id c - 32 + 3; '\n' is last (98).
    assert tok.encode("12+34=") == [ord(c) - 29 for c in "12+34="] == [20, 21, 14, 22, 23, 32]
    assert tok.encode("\n") == [98]
    assert tok.encode(ALPHABET) == list(range(3, 99))


@pytest.mark.parametrize("text", [ALPHABET, "  a  b ", "x = 1 ,\n\n y.", string.punctuation, ""])
def test_decode_round_trips_exactly(tok, text):
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_special_tokens_skip_and_no_auto_bos_eos(tok):
    ids = [1] + tok.encode("a b") + [2, 0, 0]
    assert tok.decode(ids, skip_special_tokens=True) == "a b"
    assert tok.decode(ids) == "<bos>a b<eos><pad><pad>"
    assert tok("ab")["input_ids"] == [68, 69]  # no bos/eos added


def test_unknown_characters_become_question_mark(tok):
    # NFKC maps full-width digits to ASCII; what is still unknown becomes "?" (id 34).
    assert tok.encode("\uff11\u00e9\u2019") == [20, 34, 34]


def test_left_padding_by_default(tok):
    batch = tok(["ab", "abc"], padding=True)
    assert batch["input_ids"] == [[0, 68, 69], [68, 69, 70]]
    assert batch["attention_mask"] == [[0, 1, 1], [1, 1, 1]]


def test_save_and_load_offline(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert len(loaded) == len(tok)
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    text = "7 * 8 = 56\nok."
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
