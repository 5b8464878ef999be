"""Policy.response_logprobs against naive full-logits computations; weights export."""

from __future__ import annotations

import pytest
import torch

from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3, save_tiny_model
from ais_lightning.policy import Policy, build_sequences, load_named_tensors

PAD = 0


def make_batch(seed: int = 0):
    """Left-padded prompts of lengths 2..6 and right-padded responses of lengths 1..5 (one empty)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = [6, 2, 4, 3], [5, 1, 3, 0]
    P, T = max(prompt_lens), max(response_lens)
    prompt_ids = torch.full((4, P), PAD)
    response_ids = torch.full((4, T), PAD)
    for b, (lp, lr) in enumerate(zip(prompt_lens, response_lens)):
        prompt_ids[b, P - lp :] = torch.randint(3, 99, (lp,), generator=g)
        response_ids[b, :lr] = torch.randint(3, 99, (lr,), generator=g)
    return prompt_ids, prompt_ids != PAD, response_ids, response_ids != PAD


def naive_padded(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature):
    """Full [B, P+T, V] logits with cumsum positions, log_softmax, gather; entropy -(p log p).sum,
    impurity 1 - (p^2).sum (in float64)."""
    ids = torch.cat([prompt_ids, response_ids], 1)
    attn = torch.cat([prompt_mask, response_mask], 1).long()
    pos = torch.clamp(torch.cumsum(attn, 1) - 1, min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits  # [B, P+T, V]
    P, T = prompt_ids.shape[1], response_ids.shape[1]
    logp = torch.log_softmax(logits[:, P - 1 : P + T - 1].double() / temperature, -1)  # [B, T, V]
    lp = logp.gather(-1, response_ids[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    imp = 1.0 - logp.exp().square().sum(-1)
    zero = torch.zeros((), dtype=lp.dtype)
    return tuple(torch.where(response_mask, x, zero) for x in (lp, ent, imp))


def naive_unpadded_row(model, prompt, response, temperature):
    """One row, no padding, default positions 0..L-1."""
    ids = torch.cat([prompt, response])[None]
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # [Tb, V]
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, response[:, None])[:, 0]


@pytest.fixture(scope="module")
def model():
    return build_tiny_qwen3(seed=0)


def test_build_sequences_layout():
    prompt_ids = torch.tensor([[0, 0, 5], [6, 7, 8]])
    response_ids = torch.tensor([[9, 10, 0], [11, 0, 0]])
    ids, attn, pos = build_sequences(prompt_ids, prompt_ids != 0, response_ids, response_ids != 0)
    assert ids.tolist() == [[0, 0, 5, 9, 10, 0], [6, 7, 8, 11, 0, 0]]
    assert attn.tolist() == [[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]
    assert pos.tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 3, 3]]


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(prompt_mask=torch.tensor([[True, False]])), "left-padded"),
        (dict(prompt_mask=torch.tensor([[True, True]]).long()), "prompt_mask"),
        (dict(response_ids=torch.tensor([[3, 4, 5]])), "response_mask"),
        (dict(response_ids=torch.tensor([[3], [4]]), response_mask=torch.tensor([[True], [True]])), "batch"),
        (dict(prompt_ids=torch.tensor([[3.0, 4.0]])), "prompt_ids"),
    ],
)
def test_build_sequences_rejects_bad_input(bad, match):
    args = dict(
        prompt_ids=torch.tensor([[3, 4]]),
        prompt_mask=torch.tensor([[True, True]]),
        response_ids=torch.tensor([[5, 6]]),
        response_mask=torch.tensor([[True, True]]),
    )
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        build_sequences(**args)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 3, 4, 1024])
def test_logprobs_and_entropy_match_naive(model, temperature, chunk_size):
    batch = make_batch()
    with torch.no_grad():
        out = Policy(model).response_logprobs(
            *batch, temperature=temperature, compute_entropy=True, chunk_size=chunk_size
        )
        ref_lp, ref_ent, ref_imp = naive_padded(model, *batch, temperature)
    assert out.logprobs.dtype == out.entropy.dtype == out.impurity.dtype == torch.float32
    assert out.logprobs.shape == out.entropy.shape == out.impurity.shape == batch[2].shape
    assert (out.logprobs.double() - ref_lp).abs().max() < 1e-5
    assert (out.entropy.double() - ref_ent).abs().max() < 1e-5
    assert (out.impurity.double() - ref_imp).abs().max() < 1e-6
    mask = batch[3]
    assert torch.all(out.logprobs[~mask] == 0) and torch.all(out.entropy[~mask] == 0)
    assert torch.all(out.impurity[~mask] == 0)
    # The impurity is below its entropy bound 1 - exp(-H) (Jensen: sum p^2 = E[p] >= exp(E[log p])).
    assert torch.all(out.impurity[mask] <= -torch.expm1(-out.entropy[mask]) + 1e-6)
    assert torch.all(out.logprobs[mask] < 0)
    # Uniform over 99 tokens bounds the entropy; a random init is close to it.
    assert torch.all(out.entropy[mask] <= torch.log(torch.tensor(99.0)) + 1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_padding_and_positions_match_each_row_alone(model, temperature):
    prompt_ids, prompt_mask, response_ids, response_mask = make_batch(seed=1)
    with torch.no_grad():
        out = Policy(model).response_logprobs(
            prompt_ids, prompt_mask, response_ids, response_mask, temperature=temperature
        )
        for b in range(prompt_ids.shape[0]):
            ref = naive_unpadded_row(
                model, prompt_ids[b, prompt_mask[b]], response_ids[b, response_mask[b]], temperature
            )
            assert torch.allclose(out.logprobs[b, response_mask[b]].double(), ref, rtol=0, atol=1e-5)


def test_entropy_off_by_default(model):
    out = Policy(model).response_logprobs(*make_batch())
    assert out.entropy is None and out.impurity is None


def test_gradients_match_naive_and_chunks_bound_the_head():
    model = build_tiny_qwen3(seed=2)
    batch = make_batch(seed=2)
    policy = Policy(model)  # before the hook: construction probes the head once
    calls = []
    handle = model.lm_head.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    out = policy.response_logprobs(*batch, temperature=0.7, compute_entropy=True, chunk_size=4)
    (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
    handle.remove()
    # 9 valid tokens -> chunks of 4, 4, 1 in forward, each recomputed once in backward (checkpointing).
    assert int(batch[3].sum()) == 9
    assert calls[:3] == [4, 4, 1] and sorted(calls[3:]) == [1, 4, 4]
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref_lp, ref_ent, _ = naive_padded(model, *batch, 0.7)
    (ref_lp.sum() + 0.1 * ref_ent.sum()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_all_masked_batch_gives_zeros_and_a_graph(model):
    prompt_ids, prompt_mask, response_ids, _ = make_batch()
    response_mask = torch.zeros_like(response_ids, dtype=torch.bool)
    out = Policy(model).response_logprobs(prompt_ids, prompt_mask, response_ids, response_mask)
    assert torch.all(out.logprobs == 0) and out.logprobs.requires_grad
    out.logprobs.sum().backward()  # must not raise: every rank can always call backward


def test_bad_temperature_and_chunk_size(model):
    with pytest.raises(ValueError, match="temperature"):
        Policy(model).response_logprobs(*make_batch(), temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        Policy(model).response_logprobs(*make_batch(), chunk_size=0)


def test_token_ids_from_config(model):
    policy = Policy(model)
    assert (policy.pad_token_id, policy.eos_token_id) == (0, 2)


def test_full_state_dict_has_buffers_and_reproduces_logits(model):
    named = Policy(model).full_state_dict()
    names = [n for n, _ in named]
    assert len(names) == len(set(names))
    assert set(model.state_dict()) <= set(names)  # includes lm_head.weight beside the tied embedding
    assert "lm_head.weight" in names
    assert {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"} <= set(names)
    assert all(t.device.type == "cpu" and not t.requires_grad for _, t in named)
    # Snapshots, not views of the live parameters.
    tensors = dict(named)
    assert tensors["model.norm.weight"].data_ptr() != model.model.norm.weight.data_ptr()

    fresh = build_tiny_qwen3(seed=7)
    with torch.no_grad():
        fresh.model.rotary_emb.inv_freq.mul_(2.0)  # a stale buffer must be overwritten too
    load_named_tensors(fresh, named)
    ids = torch.randint(3, 99, (2, 9))
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, model(input_ids=ids).logits)


def test_load_named_tensors_rejects_unknown_or_misshaped(model):
    fresh = build_tiny_qwen3(seed=1)
    with pytest.raises(ValueError, match="not a parameter"):
        load_named_tensors(fresh, [("model.nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        load_named_tensors(fresh, [("model.norm.weight", torch.zeros(3))])


def test_from_pretrained_local_only(model, tmp_path):
    path = save_tiny_model(model, build_char_tokenizer(), tmp_path / "m")
    policy = Policy.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    batch = make_batch()
    with torch.no_grad():
        a = Policy(model).response_logprobs(*batch).logprobs
        b = policy.response_logprobs(*batch).logprobs
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="local model directory"):
        Policy.from_pretrained(tmp_path / "missing")


def test_decoder_layers_and_fresh_model(model):
    policy = Policy(model)
    layers = policy.decoder_layers()
    assert layers == list(model.model.layers) and len(layers) == 4
    fresh = policy.fresh_model()
    assert fresh is not model and type(fresh) is type(model)
    assert fresh.config._attn_implementation == "eager"
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in fresh.parameters())
    load_named_tensors(fresh, policy.full_state_dict())
    ids = torch.randint(3, 99, (2, 6))
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, model(input_ids=ids).logits)
