"""Truncated sampling replayed: the engine records the tokens its min-p / top-k / top-p kept, the policy renormalizes
pi over exactly those, and pi / mu is exact (ais_lightning.rollout.support)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
from ais_lightning.ops import entropy_from_logprobs, impurity_from_logprobs
from ais_lightning.policy import Policy
from ais_lightning.rollout import SamplingConfig, TorchRolloutEngine
from ais_lightning.rollout.sampling import truncation_mask
from ais_lightning.rollout.support import FlatSupport, SamplingSupport, SupportRecorder, kept_mask

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

PROMPTS = ["12+34=", "5+7=", "99+1=", "8+8="]


def _mask(rows):
    return torch.tensor(rows, dtype=torch.bool)


def test_recorder_lays_out_each_rows_kept_ids_position_after_position():
    """Sets added in any order (a diffusion sampler unmasks out of order) come out row-major, ids ascending within
    a position; positions outside the response mask (after a stop token) are dropped."""
    v = 6
    rec = SupportRecorder()
    sets = {(0, 1): [4, 2], (1, 0): [5], (0, 0): [0, 1, 3], (1, 1): [1, 2], (0, 2): [3]}  # (row, col): ids
    for (row, col), ids in sets.items():
        kept = torch.zeros(1, v, dtype=torch.bool)
        kept[0, ids] = True
        rec.add(torch.tensor([row]), col, kept)
    support = rec.build(_mask([[True, True, True], [True, False, False]]))  # row 1 stopped after position 0
    assert support.counts.tolist() == [[3, 2, 1], [1, 0, 0]]
    assert support.ids.tolist() == [[0, 1, 3, 2, 4, 3], [5, -1, -1, -1, -1, -1]]
    assert support.counts.dtype == support.ids.dtype == torch.int32
    flat = support.flat(_mask([[True, True, True], [True, False, False]]))
    assert flat.counts.tolist() == [3, 2, 1, 1] and flat.ids.tolist() == [0, 1, 3, 2, 4, 3, 5]
    assert kept_mask(flat, v).tolist()[1] == [False, False, True, False, True, False]
    assert flat.take(torch.tensor([3, 0])).ids.tolist() == [5, 0, 1, 3]
    assert [p.counts.tolist() for p in flat.split(3)] == [[3, 2, 1], [1]]
    assert support.num_bytes == 4 * (6 + 12)
    rows = dataclasses.replace(
        support, counts=support.counts[[1]], ids=support.ids[[1]]
    )  # what RolloutBatch.rows takes
    assert rows.flat(_mask([[True, False, False]])).ids.tolist() == [5]


@pytest.mark.parametrize(
    "counts, ids, match",
    [
        ([[2, 1]], [[0, 1, 2]], "0 elsewhere"),  # a count on the masked position
        ([[2, 0]], [[0, 1, 2]], "exactly"),  # more ids than counts
        ([[1, 0]], [[-1, 3]], "exactly"),  # padding before an id
    ],
)
def test_a_support_that_does_not_fit_the_batch_is_refused_naming_it(counts, ids, match):
    support = SamplingSupport(torch.tensor(counts, dtype=torch.int32), torch.tensor(ids, dtype=torch.int32))
    with pytest.raises(ValueError, match=match):
        support.flat(_mask([[True, False]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        kept_mask(FlatSupport(torch.tensor([7]), torch.tensor([1])), 5)


@pytest.fixture(scope="module")
def policy():
    return Policy(build_tiny_qwen3(seed=0), build_char_tokenizer()).eval()


def _sample(policy, engine, **truncation):
    tok = policy.tokenizer
    sampling = SamplingConfig(
        n=4, max_new_tokens=10, seed=0, stop_token_ids=[tok.eos_token_id], temperature=0.8, **truncation
    )
    return engine.generate(policy.encode_prompts(PROMPTS), sampling)


@torch.no_grad()
def _trainer_logits(policy, batch, temperature):
    """The policy's tempered logits at every response position, from one full forward (an independent path)."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)  # [B, P+T]
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)  # [B, P+T]
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = policy.model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits  # [B, P+T, V]
    return logits[:, batch.prompt_ids.shape[1] - 1 : -1].float() / temperature  # [B, T, V]


def test_engine_records_the_set_its_truncation_keeps(policy):
    """Each position's recorded set is top-k then top-p of the logits the sampled token was drawn from, computed
    here by hand from the trainer's logits at fp32 (the same model)."""
    engine = TorchRolloutEngine(policy.model, precision="fp32")
    batch = _sample(policy, engine, top_k=20, top_p=0.9)
    mask = batch.response_mask
    scaled = _trainer_logits(policy, batch, 0.8)[mask]  # [N, V]
    recorded = kept_mask(batch.support.flat(mask), scaled.shape[-1])  # [N, V]
    probs = scaled.softmax(-1)
    by_hand = torch.zeros_like(recorded)
    for i in range(scaled.shape[0]):  # top-k: the 20 largest; top-p: smallest sorted prefix reaching 0.9
        top = probs[i].topk(20)
        renorm = top.values / top.values.sum()
        before = renorm.cumsum(0) - renorm
        by_hand[i, top.indices[before < 0.9]] = True
    assert torch.equal(recorded, by_hand)
    assert bool(recorded.gather(-1, batch.response_ids[mask][:, None]).all())  # the sampled token is kept
    assert int(batch.support.counts[mask].max()) <= 20 and int(batch.support.counts[~mask].abs().sum()) == 0
    assert _sample(policy, engine).support is None  # nothing truncated, nothing recorded
    assert _sample(policy, engine, top_p=0.9, record_support=False).support is None


def test_replayed_logprobs_are_a_softmax_over_the_kept_set(policy):
    """Log-probs, entropy and impurity under replay against a reference log-softmax restricted to the recorded set."""
    engine = TorchRolloutEngine(policy.model, precision="int8")  # the set is the engine's, not the trainer's
    batch = _sample(policy, engine, top_p=0.7, min_p=0.05)
    mask = batch.response_mask
    with torch.no_grad():
        out = policy.batch_logprobs(batch, temperature=0.8, compute_entropy=True)
    scaled = _trainer_logits(policy, batch, 0.8)[mask]  # [N, V]
    keep = kept_mask(batch.support.flat(mask), scaled.shape[-1])
    ref = torch.where(keep, scaled, -math.inf).log_softmax(-1)  # [N, V], -inf outside
    tokens = batch.response_ids[mask]
    torch.testing.assert_close(
        out.logprobs[mask], ref.gather(-1, tokens[:, None]).squeeze(-1), atol=2e-5, rtol=0
    )
    safe = torch.where(keep, ref, 0.0)  # p log p = 0 outside
    torch.testing.assert_close(out.entropy[mask], -(safe.exp() * safe * keep).sum(-1), atol=2e-5, rtol=0)
    torch.testing.assert_close(out.impurity[mask], 1 - (ref.exp() ** 2).sum(-1), atol=2e-5, rtol=0)
    # the full-vocabulary entropy is larger: replay did restrict the distribution
    full = entropy_from_logprobs(scaled.log_softmax(-1))
    assert bool((out.entropy[mask] < full - 1e-3).any())
    assert impurity_from_logprobs(scaled.log_softmax(-1)).mean() > out.impurity[mask].mean()


def test_at_fp32_replayed_ratios_are_one_and_unrenormalized_ones_carry_the_kept_mass(policy):
    """The acceptance test: top-p 0.9 and top-k 20 at fp32. Without replay log pi - log mu = log pi(S), the log of
    the mass the policy puts on the kept set (not 0: every corrector would correct it); with replay it is 0 to float
    precision."""
    engine = TorchRolloutEngine(policy.model, precision="fp32")
    batch = _sample(policy, engine, top_p=0.9, top_k=20)
    mask, mu = batch.response_mask, batch.rollout_logprobs
    with torch.no_grad():
        unrenormalized = policy.batch_logprobs(dataclasses.replace(batch, support=None), 0.8).logprobs
        replayed = policy.batch_logprobs(batch, 0.8).logprobs
    scaled = _trainer_logits(policy, batch, 0.8)[mask]
    kept_mass = (scaled.softmax(-1) * kept_mask(batch.support.flat(mask), scaled.shape[-1])).sum(-1)  # [N]
    error = (unrenormalized - mu)[mask]
    torch.testing.assert_close(error, kept_mass.log(), atol=2e-5, rtol=0)
    assert float(error.abs().max()) > 0.1
    assert float((replayed - mu)[mask].abs().max()) < 2e-5


def test_replay_keeps_gradients_finite_and_zero_outside_the_kept_set(policy):
    """Dropped tokens get probability 0 with a finite log-prob (not -inf), so p log p and its gradient are 0, not
    NaN: the loss's entropy bonus and log-probs backpropagate as over any distribution."""
    engine = TorchRolloutEngine(policy.model, precision="fp32")
    batch = _sample(policy, engine, top_k=3)
    head = policy.model.get_output_embeddings().weight
    out = policy.batch_logprobs(batch, temperature=0.8, compute_entropy=True)
    mask = batch.response_mask.clone()  # the engine's is an inference tensor: autograd may not save it
    (out.logprobs[mask].sum() + out.entropy[mask].sum()).backward()
    assert torch.isfinite(head.grad).all() and head.grad.abs().sum() > 0
    never_kept = ~kept_mask(batch.support.flat(mask), head.shape[0]).any(0)  # [V] tokens no position kept
    never_kept[torch.cat([batch.prompt_ids.flatten(), batch.response_ids.flatten()])] = (
        False  # tied embeddings
    )
    assert bool(never_kept.any()) and float(head.grad[never_kept].abs().max()) == 0.0
    policy.zero_grad(set_to_none=True)


def test_a_response_token_outside_its_recorded_set_is_refused(policy):
    engine = TorchRolloutEngine(policy.model, precision="fp32")
    batch = _sample(policy, engine, top_k=2)
    other = _sample(policy, engine, top_k=1)  # another sample's sets: the greedy token only
    forged = dataclasses.replace(batch, support=other.support)
    if torch.equal(other.response_mask, batch.response_mask):
        with pytest.raises(ValueError, match="not in the kept set"):
            policy.batch_logprobs(forged, 0.8)
    else:
        with pytest.raises(ValueError, match="support"):
            policy.batch_logprobs(forged, 0.8)


def test_the_truncation_mask_is_the_engines_own_even_when_the_trainers_ranking_differs(policy):
    """At int8 the engine's kept set and the one the trainer would pick from its own logits (NeMo-RL's filter)
    differ at some positions; replay uses the engine's, so every sampled token is in it."""
    engine = TorchRolloutEngine(policy.model, precision="fp4")
    batch = _sample(policy, engine, top_p=0.9)
    mask = batch.response_mask
    scaled = _trainer_logits(policy, batch, 0.8)[mask]
    trainer_side = truncation_mask(scaled, top_p=0.9)
    engine_side = kept_mask(batch.support.flat(mask), scaled.shape[-1])
    assert not torch.equal(trainer_side, engine_side)
    assert bool(engine_side.gather(-1, batch.response_ids[mask][:, None]).all())


def test_the_diffusion_sampler_records_each_tokens_set_at_its_unmasking_step():
    """LLaDA's sampler unmasks positions out of order; each token's recorded set is the one it was drawn from, and
    the diffusion policy's replayed path log-probs equal mu at fp32 (unrenormalized they carry log pi(S))."""
    from ais_lightning.policy.diffusion import tiny_diffusion_policy

    policy = tiny_diffusion_policy(seed=0, response_length=8).eval()
    engine = policy.build_engine(
        "fp32", block_length=4, steps=4
    )  # 2 tokens per step, lowest confidence first
    sampling = SamplingConfig(n=3, max_new_tokens=8, seed=1, top_k=5, top_p=0.8, stop_token_ids=[])
    batch = engine.generate(policy.encode_prompts(["12+34=", "5+7="]), sampling)
    mask = batch.response_mask
    assert int(batch.support.counts[mask].max()) <= 5 and bool(mask.all())
    with torch.no_grad():
        replayed = policy.batch_logprobs(batch, 1.0).logprobs
        unrenormalized = policy.batch_logprobs(dataclasses.replace(batch, support=None), 1.0).logprobs
    assert float((replayed - batch.rollout_logprobs)[mask].abs().max()) < 1e-5
    assert float((unrenormalized - batch.rollout_logprobs)[mask].abs().max()) > 0.1
