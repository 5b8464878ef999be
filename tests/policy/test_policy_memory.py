"""What the policy keeps in memory: the chunked head's backward and the weights handed to the engines.

The numbers are the same bit for bit; only what autograd records, and what is copied, changes.
"""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import ais_lightning.policy.scoring as scoring_module
from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
from ais_lightning.policy import Policy, chunked_response_logprobs, load_named_tensors

V, H = 40, 8


def _head_inputs(seed: int = 0):
    """A head, hidden states ``[3, 5, H]`` and responses with two padded positions."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
    hidden = torch.randn(3, 5, H, generator=g)
    tokens = torch.randint(0, V, (3, 5), generator=g)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    return head, hidden, tokens, mask


def _run(entropy_grad: bool, loss_of=lambda out: out.logprobs.sum(), chunk_size: int = 4):
    head, hidden, tokens, mask = _head_inputs()
    hidden.requires_grad_(True)
    out = chunked_response_logprobs(
        head, hidden, tokens, mask, temperature=0.7, compute_entropy=True, chunk_size=chunk_size,
        entropy_grad=entropy_grad,
    )  # fmt: skip
    loss_of(out).backward()
    return out, hidden.grad, head.weight.grad


def test_values_only_entropy_keeps_logprobs_entropies_and_gradients_bit_for_bit():
    """pi_old's entropy is a metric and a corrector input: computed without autograd, the log-probs, the
    entropies, the impurities and the gradients of the log-probs are exactly those of the recorded pass."""
    (recorded, h_rec, w_rec), (values, h_val, w_val) = _run(True), _run(False)
    for name in ("logprobs", "entropy", "impurity"):
        assert torch.equal(getattr(recorded, name), getattr(values, name)), name
    assert torch.equal(h_rec, h_val) and torch.equal(w_rec, w_val)
    assert values.logprobs.requires_grad
    assert not values.entropy.requires_grad and not values.impurity.requires_grad
    assert recorded.entropy.requires_grad and not recorded.impurity.requires_grad, "impurity: values only"


def test_entropy_gradient_is_the_full_logits_one_when_asked():
    """An entropy bonus still differentiates the entropy (entropy_grad=True, the default)."""
    _, h_grad, w_grad = _run(True, loss_of=lambda out: (out.logprobs + 0.3 * out.entropy).sum())
    head, hidden, tokens, mask = _head_inputs()
    hidden.requires_grad_(True)
    logp = torch.log_softmax(head(hidden) / 0.7, -1)  # [B, T, V]
    lp = logp.gather(-1, tokens[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    (torch.where(mask, lp + 0.3 * ent, 0.0)).sum().backward()
    torch.testing.assert_close(h_grad, hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w_grad, head.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_backward_keeps_no_entropy_tensors_of_finished_chunks(monkeypatch, entropy_grad):
    """Each checkpointed chunk recomputes in backward what its forward recorded. Entropy tensors recorded for
    a loss that never differentiates them are recomputed, never consumed, and stay alive until the whole
    backward ends: one ``[chunk, V]`` log-softmax per chunk. Values-only entropies leave none."""
    real = scoring_module.tempered_log_softmax
    made: list[StorageWeakRef] = []  # checkpoint keeps recomputed tensors as detached aliases: watch storages
    in_backward = []

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        if in_backward:
            made.append(StorageWeakRef(out.untyped_storage()))
        return out

    monkeypatch.setattr(scoring_module, "tempered_log_softmax", recording)
    head, hidden, tokens, mask = _head_inputs()
    hidden.requires_grad_(True)
    out = chunked_response_logprobs(
        head, hidden, tokens, mask, compute_entropy=True, chunk_size=4, entropy_grad=entropy_grad
    )
    alive_at_the_end: list[int] = []
    hidden.register_hook(lambda g: alive_at_the_end.append(sum(not r.expired() for r in made)))
    in_backward.append(True)
    out.logprobs.sum().backward()
    chunks = -(-int(mask.sum()) // 4)
    assert alive_at_the_end == [chunks if entropy_grad else 0]


def _tied_policy() -> Policy:
    policy = Policy(build_tiny_qwen3(seed=0), build_char_tokenizer())
    model = policy.model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "tiny Qwen3 ties them"
    return policy


def test_tied_weights_share_one_snapshot_that_never_aliases_the_model():
    policy = _tied_policy()
    named = dict(policy.full_state_dict())
    live = {p.untyped_storage().data_ptr() for p in policy.model.parameters()}
    live |= {b.untyped_storage().data_ptr() for b in policy.model.buffers()}
    assert not live & {t.untyped_storage().data_ptr() for t in named.values()}
    assert named["lm_head.weight"] is named["model.embed_tokens.weight"], "one copy for the tied pair"
    for name, value in policy.model.state_dict().items():
        assert torch.equal(named[name], value), name


def test_state_without_snapshot_is_the_live_weights_and_loads_the_same_engine_model():
    """``snapshot=False`` (the weight sync's): no copy of an unsharded CPU model, the same tensors to load."""
    policy = _tied_policy()
    views = policy.full_state_dict(snapshot=False)
    params = dict(policy.model.named_parameters(remove_duplicate=False))
    for name, value in views:
        if name in params:
            assert value.untyped_storage().data_ptr() == params[name].untyped_storage().data_ptr(), name
            assert not value.requires_grad
    assert [n for n, _ in views] == [n for n, _ in policy.full_state_dict()]
    a, b = policy.fresh_model(), policy.fresh_model()
    load_named_tensors(a, views)
    load_named_tensors(b, policy.full_state_dict())
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_the_engine_sync_keeps_the_weights_on_the_policys_device():
    """What ``GRPOModule`` hands its engines (``device=None``) stays on the policy's device: on a GPU, no copy of the
    whole model into pageable host memory on every rank and back into the engine. Shown with a policy on the
    ``meta`` device, which cannot be copied to the CPU at all; a checkpoint's default (``device="cpu"``) still
    gets CPU tensors."""
    with torch.device("meta"):
        policy = Policy(build_tiny_qwen3(seed=0))
    named = policy.full_state_dict(snapshot=False, device=None)
    assert named and all(t.device.type == "meta" for _, t in named)
    assert dict(named)["lm_head.weight"] is dict(named)["model.embed_tokens.weight"]  # still one tensor, tied
    assert all(t.device.type == "meta" for _, t in policy.full_state_dict(device=None))  # snapshots too
    with pytest.raises(
        NotImplementedError, match="meta"
    ):  # a CPU copy of it is what the sync no longer makes
        policy.full_state_dict(snapshot=False)
