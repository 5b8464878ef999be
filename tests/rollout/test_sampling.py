"""Sampling functions: distributions, truncation, greedy, seeds (hand-derived numbers)."""

import math

import pytest
import torch

from ais_lightning.rollout.sampling import (
    draw_next,
    make_generator,
    sample_next,
    sampling_logprobs,
    truncation_mask,
)

# Chi-square critical value for df = 5 at alpha = 1e-3 (standard table): 20.515.
CHI2_DF5_P001 = 20.515


def _softmax_by_hand(logits: list[float], temperature: float) -> list[float]:
    z = [math.exp(x / temperature) for x in logits]
    s = sum(z)
    return [v / s for v in z]


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_samples_follow_softmax_over_temperature(temperature):
    logits = [1.5, 0.5, 0.0, -0.5, 1.0, -1.0]
    expected = _softmax_by_hand(logits, temperature)
    n = 40_000
    batch = torch.tensor(logits).expand(n, -1)  # [N, 6]: one draw per row
    tokens, _ = sample_next(batch, temperature, generator=make_generator(1234))
    counts = torch.bincount(tokens, minlength=6).double()
    chi2 = sum((float(c) - n * p) ** 2 / (n * p) for c, p in zip(counts, expected))
    assert chi2 < CHI2_DF5_P001


def test_greedy_is_argmax_with_t1_logprobs():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 1.0, 2.5]])
    tokens, lp = sample_next(logits, 0.0)
    assert tokens.tolist() == [1, 0]
    p = _softmax_by_hand([0.1, 2.0, -1.0], 1.0)[1]
    q = _softmax_by_hand([3.0, 1.0, 2.5], 1.0)[0]
    assert torch.allclose(lp, torch.tensor([math.log(p), math.log(q)]), atol=1e-6)


def test_untruncated_logprob_is_tempered_softmax():
    logits = torch.tensor([[1.0, 2.0, 0.0, -1.0]])
    tok, lp = sample_next(logits, 0.5, generator=make_generator(0))
    expected = math.log(_softmax_by_hand([1.0, 2.0, 0.0, -1.0], 0.5)[int(tok)])
    assert lp.item() == pytest.approx(expected, abs=1e-6)


def test_top_k_keeps_k_largest_and_renormalizes():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    keep = truncation_mask(logits, top_k=2)
    assert keep.tolist() == [[True, False, True, False]]
    lp = sampling_logprobs(logits, 1.0, top_k=2)
    p0 = 1 / (1 + math.exp(-1.0))  # e^3 / (e^3 + e^2)
    assert lp[0, 0].item() == pytest.approx(math.log(p0), abs=1e-6)
    assert lp[0, 2].item() == pytest.approx(math.log(1 - p0), abs=1e-6)
    assert torch.isinf(lp[0, 1]) and torch.isinf(lp[0, 3])
    tokens, tlp = sample_next(logits.expand(2000, -1), 1.0, top_k=2, generator=make_generator(3))
    assert set(tokens.tolist()) == {0, 2}
    assert torch.allclose(tlp, lp[0, tokens], atol=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = [0.05, 0.5, 0.15, 0.3]
    logits = torch.tensor([probs]).log()
    # sorted: 0.5, 0.3, 0.15, 0.05; mass before each: 0, 0.5, 0.8, 0.95
    assert truncation_mask(logits, top_p=0.7).tolist() == [[False, True, False, True]]
    assert truncation_mask(logits, top_p=0.85).tolist() == [[False, True, True, True]]
    assert truncation_mask(logits, top_p=0.3).tolist() == [[False, True, False, False]]
    lp = sampling_logprobs(logits, 1.0, top_p=0.7)
    assert lp[0, 1].exp().item() == pytest.approx(0.5 / 0.8, abs=1e-6)
    assert lp[0, 3].exp().item() == pytest.approx(0.3 / 0.8, abs=1e-6)
    tokens, tlp = sample_next(logits.expand(2000, -1), 1.0, top_p=0.7, generator=make_generator(5))
    assert set(tokens.tolist()) == {1, 3}
    assert torch.allclose(tlp.exp(), torch.where(tokens == 1, 0.625, 0.375), atol=1e-6)


def test_top_k_then_top_p():
    probs = [0.4, 0.3, 0.2, 0.1]
    logits = torch.tensor([probs]).log()
    # top_k=3 renormalizes to 4/9, 3/9, 2/9; mass before: 0, 4/9, 7/9 -> top_p=0.6 keeps the first two
    assert truncation_mask(logits, top_k=3, top_p=0.6).tolist() == [[True, True, False, False]]
    assert truncation_mask(logits) is None


def test_min_p_keeps_tokens_within_a_factor_of_the_most_likely_then_top_k_and_top_p():
    probs = [0.05, 0.45, 0.2, 0.3]
    logits = torch.tensor([probs]).log()
    # min_p=0.4: keep p >= 0.4 * 0.45 = 0.18 -> tokens 1, 2, 3; 0.05 goes
    assert truncation_mask(logits, min_p=0.4).tolist() == [[False, True, True, True]]
    lp = sampling_logprobs(logits, 1.0, min_p=0.4)
    assert lp[0, 2].exp().item() == pytest.approx(0.2 / 0.95, abs=1e-6)
    # then top_k=2 among those: 0.45 and 0.3; then top_p=0.5 over 0.6, 0.4 (renormalized): mass before 0, 0.6
    assert truncation_mask(logits, top_k=2, min_p=0.4).tolist() == [[False, True, False, True]]
    assert truncation_mask(logits, top_k=2, top_p=0.5, min_p=0.4).tolist() == [[False, True, False, False]]
    # min_p applies after temperature (vLLM): at T = 2, p ~ sqrt(p), so 0.05 -> 0.118 of 0.355 ...
    scaled = [math.sqrt(p) / sum(math.sqrt(q) for q in probs) for p in probs]
    keep = [p >= 0.4 * max(scaled) for p in scaled]
    assert keep == [False, True, True, True]
    assert truncation_mask(logits / 2, min_p=0.4).tolist() == [keep]
    assert truncation_mask(logits / 2, min_p=0.7).tolist() == [[p >= 0.7 * max(scaled) for p in scaled]]
    with pytest.raises(ValueError, match="min_p"):
        truncation_mask(logits, min_p=1.5)


def test_draw_next_returns_the_kept_set_it_sampled_from():
    probs = [0.05, 0.5, 0.15, 0.3]
    logits = torch.tensor([probs]).log().expand(500, -1)  # [500, 4]
    draw = draw_next(logits, 1.0, top_p=0.7, generator=make_generator(1))
    assert draw.kept.tolist() == [[False, True, False, True]] * 500
    assert bool(draw.kept.gather(-1, draw.tokens[:, None]).all())
    assert draw_next(logits, 1.0, generator=make_generator(1)).kept is None  # nothing truncated
    assert draw_next(logits, 0.0, top_p=0.7).kept is None  # greedy has no distribution of its own
    assert torch.equal(draw.tokens, sample_next(logits, 1.0, top_p=0.7, generator=make_generator(1))[0])


def test_seeds_reproduce_and_differ():
    logits = torch.randn(64, 50)
    a, _ = sample_next(logits, 1.0, generator=make_generator(7))
    b, _ = sample_next(logits, 1.0, generator=make_generator(7))
    c, _ = sample_next(logits, 1.0, generator=make_generator(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert make_generator(None) is None


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="logits"):
        sample_next(torch.zeros(3), 1.0)
    with pytest.raises(ValueError, match="top_p"):
        truncation_mask(torch.zeros(1, 3), top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        truncation_mask(torch.zeros(1, 3), top_k=-1)
    with pytest.raises(ValueError, match="temperature"):
        sampling_logprobs(torch.zeros(1, 3), -1.0)


def test_inverse_cdf_never_draws_zero_probability_tokens_even_at_u_near_one(monkeypatch):
    """Zero-probability tokens sit where the CDF is flat, at the start, middle and end of the row;
    u ~ 1 (here the largest float32 below 1) must still land on the last token with mass."""
    from ais_lightning.rollout.sampling import sample_from_logprobs

    inf = float("-inf")
    logp = torch.tensor([[inf, math.log(0.25), inf, math.log(0.75), inf, inf]])  # [1, 6]
    tokens = sample_from_logprobs(logp.expand(20_000, -1), make_generator(0))
    counts = torch.bincount(tokens, minlength=6)
    assert counts[[0, 2, 4, 5]].sum() == 0
    assert abs(counts[1].item() / 20_000 - 0.25) < 0.02  # 0.25 +- ~6.5 standard errors

    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.full(shape, 1 - 2**-24, dtype=kw["dtype"]))
    assert sample_from_logprobs(logp).tolist() == [3]


def test_given_uniforms_pick_the_inverse_cdf_token_of_each_row():
    """probs [0.25, 0.75]: u in [0, 0.25) draws token 0, u in [0.25, 1) token 1; the generator is unused."""
    from ais_lightning.rollout.sampling import sample_from_logprobs

    logp = torch.tensor([[0.25, 0.75]]).log().expand(4, -1)  # [4, 2]
    u = torch.tensor([0.0, 0.2499, 0.25, 0.999])
    assert sample_from_logprobs(logp, uniforms=u).tolist() == [0, 0, 1, 1]
    gen = make_generator(0)
    state = gen.get_state()
    tokens, lp = sample_next(torch.tensor([[0.25, 0.75]]).log().expand(4, -1), 1.0, generator=gen, uniforms=u)
    assert tokens.tolist() == [0, 0, 1, 1]
    assert torch.equal(gen.get_state(), state), "the generator draws nothing when uniforms are given"
    assert torch.allclose(lp.exp(), torch.tensor([0.25, 0.25, 0.75, 0.75]))


def test_given_uniforms_follow_the_distribution():
    from ais_lightning.rollout.sampling import uniform_table

    logits = [1.5, 0.5, 0.0, -0.5, 1.0, -1.0]
    expected = _softmax_by_hand(logits, 1.0)
    n = 40_000
    u = uniform_table(n, 1, seed=11)[:, 0]  # [N]
    tokens, _ = sample_next(torch.tensor(logits).expand(n, -1), 1.0, uniforms=u)
    counts = torch.bincount(tokens, minlength=6).double()
    chi2 = sum((float(c) - n * p) ** 2 / (n * p) for c, p in zip(counts, expected))
    assert chi2 < CHI2_DF5_P001


def test_a_rows_uniforms_decide_its_token_whatever_the_other_rows():
    """Per-row noise: row i's token depends on its own uniform only, so any subset of rows resamples alike."""
    logits = torch.randn(16, 30, generator=torch.Generator().manual_seed(0))
    u = torch.rand(16, generator=torch.Generator().manual_seed(1))
    full, _ = sample_next(logits, 0.8, uniforms=u)
    subset = torch.tensor([3, 7, 8, 15])
    part, _ = sample_next(logits[subset], 0.8, uniforms=u[subset])
    assert torch.equal(part, full[subset])


def test_uniform_table_is_seeded_and_bad_uniforms_raise():
    from ais_lightning.rollout.sampling import check_uniforms, sample_from_logprobs, uniform_table

    a, b = uniform_table(5, 3, seed=2), uniform_table(5, 3, seed=2)
    assert a.shape == (5, 3) and a.dtype == torch.float32 and torch.equal(a, b)
    assert not torch.equal(a, uniform_table(5, 3, seed=3))
    assert bool(((a >= 0) & (a < 1)).all())
    for rows, steps, name in ((0, 3, "rows"), (2, 0, "steps"), (True, 3, "rows"), (2, 1.5, "steps")):
        with pytest.raises(ValueError, match=name):
            uniform_table(rows, steps)
    logp = torch.zeros(2, 3)
    bad = {
        "shape": torch.zeros(3),
        "floating": torch.zeros(2, dtype=torch.long),
        r"\[0, 1\)": torch.tensor([0.5, 1.0]),
    }
    for match, u in bad.items():
        with pytest.raises(ValueError, match=f"uniforms.*{match}"):
            sample_from_logprobs(logp, uniforms=u)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        check_uniforms(torch.tensor([float("nan")]), (1,))
    check_uniforms(torch.zeros(2, 7), (2, -1))  # -1: any width
    with pytest.raises(ValueError, match=r"shape \(3, -1\)"):
        check_uniforms(torch.zeros(2, 7), (3, -1))
