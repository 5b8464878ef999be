"""Coupled regeneration: same weights give the same tokens, different distributions diverge only where
they differ, and the agreement measures are right on hand-made cases."""

from __future__ import annotations

import copy

import pytest
import torch

from ais_lightning.models import build_tiny_qwen3
from ais_lightning.rollout import SamplingConfig, TorchRolloutEngine
from ais_lightning.rollout.coupled import (
    NOISE_KEY,
    coupling_agreement,
    regenerate,
    supports_coupled_noise,
    token_agreement,
)
from ais_lightning.rollout.sampling import sample_from_logprobs, uniform_table

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [40], [20, 21, 22, 23]]  # different lengths


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    return build_tiny_qwen3(seed=0).eval()


def _lp(*probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


# ------------------------------------------------------------------ the pure measures
def test_coupling_agreement_by_hand():
    same = coupling_agreement(_lp([0.2, 0.3, 0.5]), _lp([0.2, 0.3, 0.5]))
    assert same.item() == pytest.approx(1.0)
    # [0, .5) [.5, 1) vs [0, .25) [.25, 1): overlaps .25 + .5 = 1 - TV (TV = .25)
    assert coupling_agreement(_lp([0.5, 0.5]), _lp([0.25, 0.75])).item() == pytest.approx(0.75)
    # mass moved between neighbours reaches 1 - TV; moved across a token it costs more:
    # [.4, .2, .4] vs [.3, .2, .5] (TV = .1): overlaps .3 + .1 + .4 = .8 < .9
    assert coupling_agreement(_lp([0.4, 0.2, 0.4]), _lp([0.3, 0.2, 0.5])).item() == pytest.approx(0.8)
    # disjoint supports never agree; -inf (truncated) tokens are fine
    assert coupling_agreement(_lp([1.0, 0.0]), _lp([0.0, 1.0])).item() == pytest.approx(0.0)


def test_coupling_agreement_is_what_shared_uniforms_give():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 12, generator=gen) * 2
    b = a + torch.randn(3, 12, generator=gen) * 0.5
    n = 20_000
    u = torch.rand(n, generator=gen)  # [N]
    for row in range(3):
        ta = sample_from_logprobs(a[row].log_softmax(-1).expand(n, -1), uniforms=u)
        tb = sample_from_logprobs(b[row].log_softmax(-1).expand(n, -1), uniforms=u)
        empirical = (ta == tb).double().mean().item()
        expected = coupling_agreement(a[row : row + 1], b[row : row + 1]).item()
        assert empirical == pytest.approx(expected, abs=0.015)  # ~4 standard errors
        tv = 0.5 * (a[row].softmax(-1) - b[row].softmax(-1)).abs().sum().item()
        assert expected <= 1 - tv + 1e-6


def test_token_agreement_by_hand():
    ids_a = torch.tensor([[1, 2, 3, 0], [1, 2, 3, 4], [5, 6, 0, 0], [7, 0, 0, 0]])
    mask_a = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    ids_b = torch.tensor([[1, 2, 3], [1, 9, 3], [5, 6, 8], [8, 0, 0]])
    mask_b = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    out = token_agreement(ids_a, mask_a, ids_b, mask_b)
    assert out["shared"].tolist() == [3, 1, 2, 0]
    assert out["identical"].tolist() == [True, False, False, False]
    assert out["steps"].tolist() == [3, 2, 3, 1]  # an identical row: its length; else shared + 1
    assert out["diverged"].tolist() == [False, True, True, True]
    with pytest.raises(ValueError, match="mask_b"):
        token_agreement(ids_a, mask_a, ids_b, mask_b[:, :2])
    with pytest.raises(ValueError, match="ids_a"):
        token_agreement(ids_a.float(), mask_a, ids_b, mask_b)


def test_chains_diverge_only_from_states_whose_distributions_differ():
    """Two first-order Markov chains over 6 tokens sampled with the same uniforms: their next-token
    distributions are equal after tokens 0-3 and differ after 4 and 5. Every divergence happens right
    after a 4 or a 5; yet they do diverge, so the agreement rate is below 1 only because of those."""
    gen = torch.Generator().manual_seed(0)
    table_a = torch.randn(6, 6, generator=gen).log_softmax(-1)  # [state, next]
    table_b = table_a.clone()
    table_b[4:] = torch.randn(2, 6, generator=gen).log_softmax(-1)
    rows, steps = 2000, 12
    u = uniform_table(rows, steps, seed=1)
    a = torch.zeros(rows, steps + 1, dtype=torch.long)
    b = torch.zeros(rows, steps + 1, dtype=torch.long)
    for t in range(steps):
        a[:, t + 1] = sample_from_logprobs(table_a[a[:, t]], uniforms=u[:, t])
        b[:, t + 1] = sample_from_logprobs(table_b[b[:, t]], uniforms=u[:, t])
    full = torch.ones(rows, steps, dtype=torch.bool)
    out = token_agreement(a[:, 1:], full, b[:, 1:], full)
    diverged = out["diverged"]
    assert 0 < int(diverged.sum()) < rows
    state_before = a[diverged, out["shared"][diverged]]  # the shared token the divergent step followed
    assert set(state_before.tolist()) <= {4, 5}
    rate = 1 - diverged.sum().item() / out["steps"].sum().item()
    assert 0 < rate < 1


# ------------------------------------------------------------------ the engines
def _noisy_batch(engine, sampling, seed=0):
    rows = len(PROMPTS) * sampling.n
    return engine.generate(PROMPTS, sampling, uniforms=uniform_table(rows, sampling.max_new_tokens, seed))


def test_the_batch_records_its_noise_and_default_sampling_records_none(model):
    engine = TorchRolloutEngine(model)
    sampling = SamplingConfig(n=2, max_new_tokens=5, seed=0)
    batch = _noisy_batch(engine, sampling)
    assert batch.extras[NOISE_KEY].shape == (8, 5)
    assert engine.generate(PROMPTS, sampling).extras == {}
    assert supports_coupled_noise(engine) and supports_coupled_noise(TorchRolloutEngine)
    with pytest.raises(ValueError, match="uniforms"):
        engine.generate(PROMPTS, sampling, uniforms=uniform_table(7, 5))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(PROMPTS, sampling, uniforms=uniform_table(8, 4))


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(n=6, max_new_tokens=12, stop_token_ids=[2, 30, 31, 40, 41, 50], seed=0),
        SamplingConfig(n=4, max_new_tokens=8, temperature=0.7, top_k=20, top_p=0.9, seed=0),
    ],
    ids=["stops", "top-k-top-p"],
)
def test_same_weights_regenerate_a_subset_token_for_token(model, sampling):
    """An fp32 cheap engine and an fp32 exact engine: regenerating chosen rows, in another batch and
    another order, reproduces them exactly (compaction of stopped rows keeps each row's noise)."""
    cheap = TorchRolloutEngine(model, precision="fp32")
    exact = TorchRolloutEngine(model, precision="fp32", compact_below=0.9)
    batch = _noisy_batch(cheap, sampling)
    n = sampling.n
    rows = torch.tensor([[4 * n - 1, 3 * n + 1], [1, 0], [2 * n - 1, n]])  # prompts 3, 0, 1; 2 rows each
    again = regenerate(exact, batch, rows, sampling)
    flat = rows.reshape(-1)
    assert again.prompt_index.tolist() == batch.prompt_index[flat].tolist() == [3, 3, 0, 0, 1, 1]
    out = token_agreement(
        batch.response_ids[flat], batch.response_mask[flat], again.response_ids, again.response_mask
    )
    assert out["identical"].all()
    assert torch.equal(again.extras[NOISE_KEY], batch.extras[NOISE_KEY][flat])
    lp_a = torch.where(again.response_mask, again.rollout_logprobs, 0)
    width = again.response_ids.shape[1]
    lp_b = torch.where(batch.response_mask[flat, :width], batch.rollout_logprobs[flat, :width], 0)
    assert (lp_a - lp_b).abs().max().item() < 1e-5
    if sampling.stop_token_ids:
        assert {"stop", "length"} <= set(batch.finish_reason), "some rows stopped early: compaction ran"


def test_compaction_keeps_each_rows_noise(model):
    sampling = SamplingConfig(n=8, max_new_tokens=16, stop_token_ids=[2, 30, 31, 40, 41, 50], seed=0)
    plain = _noisy_batch(TorchRolloutEngine(model, compact_below=0.0), sampling)
    compacted = _noisy_batch(TorchRolloutEngine(model, compact_below=0.95), sampling)
    assert torch.equal(plain.response_ids, compacted.response_ids)
    assert torch.equal(plain.response_mask, compacted.response_mask)
    assert plain.response_mask.sum(-1).min() < plain.response_mask.shape[1], "rows stopped: compaction ran"


def test_regeneration_diverges_only_after_a_token_whose_embedding_differs():
    """Engines that differ only in the input embedding of tokens 90-98 have equal next-token distributions
    until such a token is in the context. Prompts avoid them, so a regenerated row may only diverge at a
    step after one of them was generated (identically, by both)."""
    model = build_tiny_qwen3(seed=0, tie_word_embeddings=False).eval()
    changed = copy.deepcopy(model)
    with torch.no_grad():
        emb = changed.model.embed_tokens.weight
        emb[90:] = torch.randn(emb[90:].shape, generator=torch.Generator().manual_seed(0))
    cheap = TorchRolloutEngine(changed)
    exact = TorchRolloutEngine(model)
    sampling = SamplingConfig(n=16, max_new_tokens=10, seed=0)
    batch = _noisy_batch(cheap, sampling)
    rows = torch.arange(batch.response_ids.shape[0]).view(len(PROMPTS), sampling.n)
    again = regenerate(exact, batch, rows, sampling)
    out = token_agreement(batch.response_ids, batch.response_mask, again.response_ids, again.response_mask)
    diverged = out["diverged"]
    assert 0 < int(diverged.sum()) < diverged.numel(), "the changed tokens matter, but not everywhere"
    for row in diverged.nonzero().flatten().tolist():
        prefix = batch.response_ids[row, : out["shared"][row]]
        assert bool((prefix >= 90).any()), f"row {row} diverged before any changed token was generated"


def test_lower_precision_agrees_often_but_not_always(model):
    """fp4 screening vs fp32 regeneration: distributions differ a little at every step, so most steps
    and some whole rows agree, and the per-step agreement rate is reported below 1."""
    sampling = SamplingConfig(n=16, max_new_tokens=10, seed=0)
    batch = _noisy_batch(TorchRolloutEngine(model, precision="fp4"), sampling)
    rows = torch.arange(batch.response_ids.shape[0]).view(len(PROMPTS), sampling.n)
    again = regenerate(TorchRolloutEngine(model), batch, rows, sampling)
    out = token_agreement(batch.response_ids, batch.response_mask, again.response_ids, again.response_mask)
    rate = 1 - out["diverged"].sum().item() / out["steps"].sum().item()
    assert 0.5 < rate < 1
    assert 0 < out["identical"].float().mean().item() < 1


def test_regenerate_checks_its_inputs(model):
    engine = TorchRolloutEngine(model)
    sampling = SamplingConfig(n=2, max_new_tokens=4, seed=0)
    batch = _noisy_batch(engine, sampling)
    with pytest.raises(ValueError, match="extras"):
        regenerate(engine, engine.generate(PROMPTS, sampling), torch.tensor([[0, 1]]), sampling)
    with pytest.raises(ValueError, match="one prompt per line"):
        regenerate(engine, batch, torch.tensor([[1, 2]]), sampling)
    with pytest.raises(ValueError, match="rows"):
        regenerate(engine, batch, torch.tensor([0, 1]), sampling)
    with pytest.raises(ValueError, match="rows"):
        regenerate(engine, batch, torch.tensor([[0, 8]]), sampling)

    class NoNoise:
        def generate(self, prompts, sampling):
            raise AssertionError("never called")

    with pytest.raises(ValueError, match="NoNoise"):
        regenerate(NoNoise(), batch, torch.tensor([[0, 1]]), sampling)
