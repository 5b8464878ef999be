"""Prompt checks and left padding shared by every engine."""

import pytest
import torch

from ais_lightning.rollout.prompts import check_prompts, left_pad


def test_left_pad_hand_values():
    ids, mask = left_pad([[5, 6, 7], (8,)], pad_token_id=1)
    assert ids.tolist() == [[5, 6, 7], [1, 1, 8]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]
    assert ids.dtype == torch.long and mask.dtype == torch.bool


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([], "non-empty list of token-id lists"),
        ("abc", "non-empty list of token-id lists"),
        ([[1], []], "prompts\\[1\\] must be a non-empty list"),
        ([[1, -1]], "prompts\\[0\\] has token ids outside \\[0, 10\\)"),
        ([[1, 2], [10]], "prompts\\[1\\] has token ids outside \\[0, 10\\)"),
    ],
)
def test_check_prompts_rejects(prompts, match):
    with pytest.raises(ValueError, match=match):
        check_prompts(prompts, vocab_size=10)


def test_check_prompts_without_vocab_only_rejects_negative_ids():
    check_prompts([[10**6]])
    with pytest.raises(ValueError, match="outside \\[0, None\\)"):
        check_prompts([[-1]])
