"""Tests for ErrorTokenRate / repeat_token_mask: hand-counted degenerate responses, padding, accumulation."""

from __future__ import annotations

import math

import pytest
import torch

from ais_lightning.diagnostics import ErrorTokenRate, repeat_token_mask

NAN = float("nan")
PAD = ord("a")  # padding id deliberately equal to a real token: it must not extend a repetition


def encode(*texts: str, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Characters -> ids (ord), right-padded with PAD to ``width``; mask True on the characters."""
    width = max(len(t) for t in texts) if width is None else width
    ids = torch.full((len(texts), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(texts), width, dtype=torch.bool)
    for i, text in enumerate(texts):
        ids[i, : len(text)] = torch.tensor([ord(c) for c in text])
        mask[i, : len(text)] = True
    return ids, mask


def flags(text: str, **kwargs) -> str:
    """The flagged positions of one string as a '^'/'.' picture, for readable hand-checked asserts."""
    ids, mask = encode(text)
    row = repeat_token_mask(ids, mask, **kwargs)[0]
    return "".join("^" if f else "." for f in row.tolist())


@pytest.mark.parametrize(
    "text, expected",
    [
        ("abcabcabcabc", "^" * 12),  # 4 copies of "abc"
        ("aaaaaa", "^" * 6),  # unigram run, n=1 (>= 3 copies)
        ("hello world!", "." * 12),  # "ll" is only 2 copies
        ("xyzabcabcabcq", "...^^^^^^^^^."),  # exactly 3 copies inside normal text
        ("abcabcab", "." * 8),  # 2 copies + partial: shorter than 3 * 3 tokens
        ("abcabcabcab", "^" * 11),  # 3 copies + trailing partial copy: the whole periodic span
        ("ababab", "^" * 6),  # period 2 has no period 3: found by the n=2 pass
        ("aaab", "^^^."),
        ("aabaa", "....."),
    ],
)
def test_repeat_mask_hand_cases(text, expected):
    assert flags(text) == expected


def test_repeat_mask_parameters():
    assert flags("ababab", ngram=1) == "......"  # only unigram units
    assert flags("aaaaaa", min_ngram=2) == "^" * 6  # "aa" x 3 is still a 2-gram repetition
    assert flags("aaaaa", min_ngram=2) == "....."  # 5 tokens < 2 * 3
    assert flags("xabab", min_repeats=2) == ".^^^^"
    assert flags("xabab", min_repeats=3) == "....."


def test_padding_and_gaps_do_not_count_or_bridge():
    # "aa" + one padding "a": only 2 valid copies, and the padded position itself is never flagged.
    ids, mask = encode("aa", "aaaa", width=4)
    out = repeat_token_mask(ids, mask)
    assert out.tolist() == [[False, False, False, False], [True, True, True, True]]
    # a masked hole in the middle of "aaaaa" leaves runs of 2 on both sides
    mask = torch.tensor([[True, True, False, True, True]])
    assert not repeat_token_mask(torch.full((1, 5), PAD), mask).any()


def brute_force(ids: list[int], valid: list[bool], ngram: int, min_repeats: int) -> list[bool]:
    """Straight from the definition: windows of min_repeats copies of the n-gram starting at s."""
    out = [False] * len(ids)
    for n in range(1, ngram + 1):
        w = n * min_repeats
        for s in range(len(ids) - w + 1):
            if all(valid[s : s + w]) and all(ids[s + j] == ids[s + j % n] for j in range(w)):
                out[s : s + w] = [True] * w
    return out


def test_repeat_mask_matches_brute_force_on_random_rows():
    gen = torch.Generator().manual_seed(0)
    for ngram, min_repeats in [(3, 3), (2, 2), (4, 2), (1, 4)]:
        ids = torch.randint(0, 2, (16, 30), generator=gen)  # binary alphabet: many repetitions
        lengths = torch.randint(0, 31, (16,), generator=gen)
        mask = torch.arange(30) < lengths.unsqueeze(-1)
        mask[3, 10] = False  # a hole inside a row
        got = repeat_token_mask(ids, mask, ngram=ngram, min_repeats=min_repeats)
        for b in range(16):
            assert got[b].tolist() == brute_force(ids[b].tolist(), mask[b].tolist(), ngram, min_repeats)


def _mixed_batch():
    # valid tokens: 12 + 6 + 12 + 13 = 43; repeat errors: 12 + 6 + 0 + 9 = 27
    return ("abcabcabcabc", "aaaaaa", "hello world!", "xyzabcabcabcq"), 27 / 43


def test_repeat_rate_on_mixed_padded_batch():
    texts, expected = _mixed_batch()
    metric = ErrorTokenRate("repeat")
    metric.update(*encode(*texts))
    assert float(metric.compute()) == pytest.approx(expected)


def test_several_updates_equal_one_update_on_the_concatenation():
    texts, expected = _mixed_batch()
    split = ErrorTokenRate("repeat")
    split.update(*encode(texts[0], texts[1]))  # width 12
    split.update(*encode(texts[2], width=20))  # extra padding
    split.update(*encode(texts[3]))  # width 13
    whole = ErrorTokenRate("repeat")
    whole.update(*encode(*texts))
    assert float(split.compute()) == pytest.approx(float(whole.compute()))
    assert float(split.compute()) == pytest.approx(expected)


def test_low_logprob_rate_hand_values():
    # threshold -8, strict: errors are -9, -20 (row 0) and -8.5 (row 1); -8.0 is not below it.
    logprobs = torch.tensor([[-0.1, -9.0, -8.0, -20.0], [-8.5, NAN, -math.inf, NAN]])
    mask = torch.tensor([[True, True, True, True], [True, False, False, False]])
    metric = ErrorTokenRate("low_logprob")
    metric.update(logprobs, mask)
    assert float(metric.compute()) == pytest.approx(3 / 5)
    metric.update(torch.tensor([[-1.0, -2.0, -30.0]]), torch.tensor([[True, True, True]]))
    assert float(metric.compute()) == pytest.approx(4 / 8)
    high = ErrorTokenRate("low_logprob", logprob_threshold=-0.5)
    high.update(logprobs, mask)
    assert float(high.compute()) == pytest.approx(4 / 5)


@pytest.mark.filterwarnings("ignore:The ``compute`` method")
@pytest.mark.parametrize("kind", ["repeat", "low_logprob"])
def test_empty_input_is_finite_zero(kind):
    metric = ErrorTokenRate(kind)
    assert float(metric.compute()) == 0.0
    values = torch.zeros(2, 3, dtype=torch.long) if kind == "repeat" else torch.zeros(2, 3)
    metric.update(values, torch.zeros(2, 3, dtype=torch.bool))
    assert float(metric.compute()) == 0.0
    metric.update(values[:, :0], torch.zeros(2, 0, dtype=torch.bool))  # zero-length responses
    assert float(metric.compute()) == 0.0


def test_metric_contract():
    metric = ErrorTokenRate()
    assert metric.full_state_update is False
    assert metric._reductions["total"].__name__ == metric._reductions["count"].__name__
    ids, mask = encode("aaaaaa")
    metric.update(ids, mask)
    assert metric.compute().shape == ()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kind="garbled"), "kind"),
        (dict(ngram=0), "ngram"),
        (dict(ngram=2.0), "ngram"),
        (dict(min_repeats=1), "min_repeats"),
        (dict(min_ngram=0), "min_ngram"),
        (dict(ngram=2, min_ngram=3), "ngram"),
        (dict(logprob_threshold=0.5), "logprob_threshold"),
        (dict(logprob_threshold=NAN), "logprob_threshold"),
    ],
)
def test_constructor_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ErrorTokenRate(**kwargs)


def test_update_validation_names_the_tensor():
    ids, mask = encode("abcabc")
    with pytest.raises(ValueError, match="response_ids"):
        ErrorTokenRate("repeat").update(ids.float(), mask)
    with pytest.raises(ValueError, match="response_ids"):
        ErrorTokenRate("repeat").update(ids[:, :3], mask)
    with pytest.raises(ValueError, match="mask"):
        ErrorTokenRate("repeat").update(ids, mask.long())
    with pytest.raises(ValueError, match="train_logprobs"):
        ErrorTokenRate("low_logprob").update(ids, mask)
    with pytest.raises(ValueError, match="train_logprobs"):
        ErrorTokenRate("low_logprob").update(torch.full(mask.shape, NAN), mask)
