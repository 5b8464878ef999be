"""A character-level tokenizer built locally with the ``tokenizers`` library (no hub download).

Vocabulary (fixed order, so ids are stable across runs and machines):
``"<pad>"`` (0), ``"<bos>"`` (1), ``"<eos>"`` (2), then the printable ASCII characters 32..126
and ``"\\n"``: 99 tokens. Every character is one token, no special tokens are added on encode,
and decoding concatenates tokens without inserting spaces, so ``decode(encode(s)) == s`` for any
string over that alphabet. Characters outside it are first NFKC-normalized (full-width digits become
ASCII) and, if still unknown, replaced by ``"?"`` so a stray unicode quote never crashes a run.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
"""Special tokens in id order: pad = 0, bos = 1, eos = 2."""
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2
CHARACTERS = tuple(chr(code) for code in range(32, 127)) + ("\n",)
"""Printable ASCII (space .. '~') then newline, ids 3 .. 98."""
UNKNOWN_REPLACEMENT = "?"
"""What a character outside ``CHARACTERS`` becomes (after NFKC normalization)."""
CHAR_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARACTERS)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer (pad/bos/eos set, no special tokens added on encode)."""
    vocab = {token: idx for idx, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    backend.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace(Regex(r"[^\x20-\x7E\n]"), UNKNOWN_REPLACEMENT)]
    )
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per char
    backend.decoder = decoders.Fuse()  # concatenate, no spaces between tokens
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )
