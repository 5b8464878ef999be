"""DiffusionPolicy: path log-probs (parity with the engine's mu at fp32), contexts, gradients, seam methods."""

from __future__ import annotations

import pytest
import torch

from ais_lightning.models import build_tiny_diffusion
from ais_lightning.policy import DiffusionPolicy, TinyLLaDA, tiny_diffusion_policy
from ais_lightning.policy.diffusion import path_contexts
from ais_lightning.rollout.base import SamplingConfig
from ais_lightning.rollout.diffusion_engine import DiffusionRolloutEngine

MASK = 99
PROMPTS = [[20, 21, 14, 22, 23, 32], [24, 14, 25, 32], [3, 4, 5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def policy():
    return tiny_diffusion_policy(seed=0)


def _rollout(policy, temperature=1.0, n=3, seed=5, **engine_kwargs):
    engine = DiffusionRolloutEngine(policy.fresh_model(), **engine_kwargs)
    engine.sync_weights(policy.full_state_dict())
    sampling = SamplingConfig(
        n=n, temperature=temperature, max_new_tokens=8, stop_token_ids=list(range(30, 40)), seed=seed
    )
    return engine.generate(PROMPTS, sampling)


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
@pytest.mark.parametrize("block_length, steps", [(None, None), (3, None), (4, 4)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_engine_mu_equals_policy_pi_on_the_same_path(
    policy, remasking, block_length, steps, temperature
):
    """Acceptance criterion: at fp32 the engine's mu and the Policy's pi agree to 1e-5 on every token."""
    batch = _rollout(policy, temperature, remasking=remasking, block_length=block_length, steps=steps)
    with torch.no_grad():
        pi = policy.batch_logprobs(batch, temperature=temperature).logprobs
    mask = batch.response_mask
    assert mask.any() and (~mask).any()
    assert (pi - batch.rollout_logprobs).abs().max() <= 1e-5
    assert (pi[~mask] == 0).all()


def test_path_logprobs_and_entropy_match_a_token_by_token_replay(policy):
    """Independent check: rebuild each token's context by hand and run the plain model forward on it."""
    batch = _rollout(policy, temperature=0.8, block_length=3)
    with torch.no_grad():
        out = policy.batch_logprobs(batch, temperature=0.8, compute_entropy=True)
    canvas, step = batch.extras["canvas_ids"], batch.extras["unmask_step"]
    plen = batch.prompt_ids.shape[1]
    checked = 0
    for b in range(canvas.shape[0]):
        for t in range(canvas.shape[1]):
            if not batch.response_mask[b, t]:
                assert out.logprobs[b, t] == 0 and out.entropy[b, t] == 0 and out.impurity[b, t] == 0
                continue
            context = canvas[b].clone()
            context[step[b] >= step[b, t]] = MASK  # the token itself and everything unmasked later
            ids = torch.cat([batch.prompt_ids[b], context])[None]
            attention = torch.cat([batch.prompt_mask[b], torch.ones_like(context, dtype=torch.bool)])[None]
            with torch.no_grad():
                logp = (policy.model(ids, attention_mask=attention)[0, plen + t].float() / 0.8).log_softmax(
                    -1
                )
            torch.testing.assert_close(out.logprobs[b, t], logp[canvas[b, t]], rtol=0, atol=1e-5)
            torch.testing.assert_close(out.entropy[b, t], -(logp.exp() * logp).sum(), rtol=0, atol=1e-5)
            torch.testing.assert_close(out.impurity[b, t], 1 - logp.exp().square().sum(), rtol=0, atol=1e-6)
            checked += 1
    assert checked == int(batch.response_mask.sum())


def test_path_contexts_by_hand():
    canvas = torch.tensor([[5, 6, 7], [8, 9, 10]])
    step = torch.tensor([[1, 0, 2], [0, 0, 1]])
    score = torch.tensor([[True, True, False], [True, True, True]])
    contexts, rows, which = path_contexts(canvas, step, score, MASK)
    # (row 0, step 0), (row 0, step 1), (row 1, step 0), (row 1, step 1); row 0 step 2 scores nothing.
    assert rows.tolist() == [0, 0, 1, 1]
    assert contexts.tolist() == [[MASK, MASK, MASK], [MASK, 6, MASK], [MASK, MASK, MASK], [8, 9, MASK]]
    assert which.tolist() == [[1, 0, -1], [2, 2, 3]]
    with pytest.raises(ValueError, match="unmask_step"):
        path_contexts(canvas, torch.full_like(step, -1), score, MASK)


def test_gradients_reach_every_trained_parameter(policy):
    batch = _rollout(policy, block_length=4)
    model = build_tiny_diffusion(seed=0)
    trainee = DiffusionPolicy(model, logprob_chunk_size=5)  # several head chunks, checkpointed
    out = trainee.batch_logprobs(batch, temperature=1.0, compute_entropy=True)
    (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_rows_of_a_batch_score_like_the_whole_batch(policy):
    batch = _rollout(policy, block_length=3)
    index = torch.tensor([7, 0, 4])
    with torch.no_grad():
        full = policy.batch_logprobs(batch).logprobs
        part = policy.batch_logprobs(batch.rows(index)).logprobs
    torch.testing.assert_close(part, full[index], rtol=0, atol=1e-6)


def test_batch_without_path_is_rejected(policy):
    batch = _rollout(policy)
    batch.extras.pop("unmask_step")
    with pytest.raises(ValueError, match="unmask_step"):
        policy.batch_logprobs(batch)
    batch = _rollout(policy)
    batch.extras["canvas_ids"] = batch.extras["canvas_ids"].roll(1, dims=1)
    with pytest.raises(ValueError, match="disagrees"):
        policy.batch_logprobs(batch)
    with pytest.raises(ValueError, match="batch_logprobs"):
        policy.response_logprobs(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)


def test_seam_methods(policy):
    assert len(policy.decoder_layers()) == 4
    names = [n for n, _ in policy.full_state_dict()]
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    assert "model.rotary_emb.inv_freq" in names  # the non-persistent buffer is synced too
    state = torch.random.get_rng_state()
    fresh = policy.fresh_model()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert type(fresh) is type(policy.model) and fresh.config == policy.model.config
    assert fresh is not policy.model and fresh.lm_head.weight is fresh.model.embed_tokens.weight
    engine = policy.build_engine("fp32", block_length=4)
    assert engine.block_length == 4
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in policy.model.state_dict().items())
    assert policy.tokenizer.mask_token_id == policy.mask_token_id == MASK
    with pytest.raises(NotImplementedError):
        DiffusionPolicy.from_pretrained("/nowhere")


def test_builder_and_spec():
    spec = TinyLLaDA(response_length=6)
    built = spec.build(seed=1)
    assert isinstance(built, DiffusionPolicy) and built.response_length == 6
    ref = build_tiny_diffusion(seed=1)
    assert torch.equal(built.model.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    assert tiny_diffusion_policy(dtype="bfloat16").model.lm_head.weight.dtype == torch.bfloat16
    for kwargs, match in (
        ({"dtype": "float16"}, "dtype"),
        ({"logprob_chunk_size": 0}, "logprob_chunk_size"),
        ({"response_length": 0}, "response_length"),
        ({"mask_eps": 0.0}, "mask_eps"),
        ({"aligned_quantization": "fp7"}, "aligned_quantization"),
    ):
        with pytest.raises(ValueError, match=match):
            TinyLLaDA(**kwargs)
    aligned = TinyLLaDA(aligned_quantization="fp8").build()
    assert aligned.apply_aligned_quantization()  # QaRL's aligned forward works on this family too
