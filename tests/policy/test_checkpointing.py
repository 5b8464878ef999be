"""Activation checkpointing of the policy: the same gradients from less saved activation memory."""

import pytest
import torch
import transformers as T

from ais_lightning.models import build_tiny_qwen3
from ais_lightning.policy import Policy
from tests.architectures import ARCHITECTURES, build

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

PROMPT_IDS = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
RESPONSE_IDS = torch.tensor([[12, 13, 14, 15, 16, 17], [18, 19, 20, 21, 0, 0]])
BATCH = (PROMPT_IDS, PROMPT_IDS != 0, RESPONSE_IDS, RESPONSE_IDS != 0)


def _loss_and_saved_bytes(policy):
    """The loss's gradients and the bytes autograd kept for backward outside checkpointed regions."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    policy.train()
    policy.model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = policy.response_logprobs(*BATCH, temperature=0.7, compute_entropy=True)
    (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters()}
    return grads, sum(saved)


@pytest.mark.parametrize("name", [None, "gpt2", "gemma2"])
def test_same_gradients_from_fewer_saved_activations(name):
    make = (lambda: build_tiny_qwen3(seed=3)) if name is None else (lambda: build(name))
    plain_grads, plain_bytes = _loss_and_saved_bytes(Policy(make()))
    policy = Policy(make(), gradient_checkpointing=True)
    assert all(layer.gradient_checkpointing for layer in policy.decoder_layers())
    grads, saved_bytes = _loss_and_saved_bytes(policy)
    for key, grad in plain_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-5, atol=1e-7, msg=key)
    assert saved_bytes < 0.5 * plain_bytes, (saved_bytes, plain_bytes)  # each layer keeps only its input


class _NoCheckpointing(T.LlamaForCausalLM):
    supports_gradient_checkpointing = False


def test_a_model_without_support_is_named():
    cls, kwargs = ARCHITECTURES["llama"]
    with pytest.raises(ValueError, match="gradient_checkpointing: _NoCheckpointing does not support"):
        Policy(_NoCheckpointing(cls(**kwargs)), gradient_checkpointing=True)


def test_a_pretrained_model_trains_in_training_mode(tmp_path):
    """from_pretrained returns eval mode, in which Hugging Face skips checkpointing; the policy trains."""
    from ais_lightning.models import build_char_tokenizer, save_tiny_model

    path = save_tiny_model(build_tiny_qwen3(seed=0), build_char_tokenizer(), tmp_path / "tiny")
    assert not T.AutoModelForCausalLM.from_pretrained(path).training
    policy = Policy.from_pretrained(path, gradient_checkpointing=True)
    assert all(m.training for m in policy.model.modules())
    _, saved_bytes = _loss_and_saved_bytes(policy)
    _, plain_bytes = _loss_and_saved_bytes(Policy.from_pretrained(path))
    assert saved_bytes < 0.5 * plain_bytes
