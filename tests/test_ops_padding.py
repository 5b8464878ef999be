"""ops.pad_sequences: the one padding helper behind the engines' prompts and the SFT batches."""

from __future__ import annotations

import pytest
import torch

from ais_lightning.ops import pad_sequences
from ais_lightning.rollout.torch_engine import left_pad


def test_left_and_right_padding_by_hand():
    seqs = [[5, 6, 7], [8], []]
    ids, mask = pad_sequences(seqs, 0, "left")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[True] * 3, [False, False, True], [False] * 3]
    ids, mask = pad_sequences(seqs, -1, "right")
    assert ids.tolist() == [[5, 6, 7], [8, -1, -1], [-1, -1, -1]]
    assert mask.tolist() == [[True] * 3, [True, False, False], [False] * 3]
    assert ids.dtype == torch.long and mask.dtype == torch.bool


def test_left_pad_is_left_padding_and_bad_side_is_named():
    a = left_pad([[1, 2], [3]], 9)
    b = pad_sequences([[1, 2], [3]], 9, "left")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert pad_sequences([], 0, "left")[0].shape == (0, 0)
    with pytest.raises(ValueError, match="side must be 'left' or 'right'"):
        pad_sequences([[1]], 0, "middle")
