"""Prompts as the model expects them: raw, or one user message in the tokenizer's chat template."""

import pytest
import torch

from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
from ais_lightning.models.prompting import encode_prompts
from ais_lightning.modules.sft import encode_pairs
from ais_lightning.policy import Policy

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _chat_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_raw_prompts_are_the_text_alone():
    tokenizer = build_char_tokenizer()
    assert encode_prompts(tokenizer, ["12+34="]) == [tokenizer.encode("12+34=", add_special_tokens=False)]


def test_chat_prompts_are_one_user_message_with_the_generation_prompt():
    tokenizer = _chat_tokenizer()
    (ids,) = encode_prompts(tokenizer, ["12+34="], chat_template=True)
    assert tokenizer.decode(ids) == "<user>12+34=\n<assistant>"
    assert ids == tokenizer.encode("<user>12+34=\n<assistant>", add_special_tokens=False)


def test_a_tokenizer_without_a_template_is_refused_by_name():
    with pytest.raises(ValueError, match="chat_template=True needs a tokenizer with a chat template"):
        encode_prompts(build_char_tokenizer(), ["1+1="], chat_template=True)
    with pytest.raises(ValueError, match="the policy's tokenizer"):
        Policy(build_tiny_qwen3(), build_char_tokenizer(), chat_template=True)


def test_the_policy_and_the_warm_start_pairs_share_the_format():
    tokenizer = _chat_tokenizer()
    policy = Policy(build_tiny_qwen3(), tokenizer, chat_template=True)
    (ids,) = policy.encode_prompts(["7+8="])
    assert tokenizer.decode(ids) == "<user>7+8=\n<assistant>"
    p_ids, p_mask, r_ids, r_mask = encode_pairs(tokenizer, ["7+8="], ["15"], chat_template=True)
    assert p_ids[0][p_mask[0]].tolist() == ids
    assert r_ids[0][r_mask[0]].tolist() == tokenizer.encode("15", add_special_tokens=False) + [
        tokenizer.eos_token_id
    ]
    assert torch.equal(p_mask, torch.ones_like(p_mask))
