"""Policy(head_dtype=...): the LM head's projection in fp32 from low-precision weights, by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
from ais_lightning.policy import Policy
from ais_lightning.rollout import SamplingConfig, TorchRolloutEngine
from ais_lightning.rollout.base import RolloutBatch


def _peaked(dtype: torch.dtype):
    """The tiny model with logits up to ~30 (its final norm scaled), where the head's rounding shows."""
    model = build_tiny_qwen3(seed=0)
    with torch.no_grad():
        model.model.norm.weight.mul_(40.0)
    return model.to(dtype)


def _batch() -> RolloutBatch:
    """Two left-padded prompts x 2 responses of 5 random tokens: mostly unlikely ones, whose log-probs carry
    the rounding of their own logit (a sampled token of this peaked model has p ~ 1 and hides it)."""
    tok = build_char_tokenizer()
    engine = TorchRolloutEngine(_peaked(torch.float32), precision="fp32")
    batch = engine.generate(
        [tok.encode("12+7="), tok.encode("3+4=")], SamplingConfig(n=2, max_new_tokens=5, seed=0)
    )
    gen = torch.Generator().manual_seed(0)
    random = torch.randint(3, tok.vocab_size, batch.response_ids.shape, generator=gen)
    return dataclasses.replace(batch, response_ids=random, response_mask=torch.ones_like(batch.response_mask))


def _by_hand(model, batch: RolloutBatch, head_float32: bool) -> torch.Tensor:
    """Each response token's log-prob from the model's decoder and its head (model dtype or fp32), row by row
    without padding.  # [B, T]"""
    out = torch.zeros(batch.response_ids.shape)
    for i in range(batch.response_ids.shape[0]):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i]].tolist()
        response = batch.response_ids[i][batch.response_mask[i]].tolist()
        with torch.no_grad():
            hidden = model.model(torch.tensor([prompt + response])).last_hidden_state[0]  # [L, H]
            w = model.lm_head.weight
            logits = F.linear(hidden.float(), w.float()) if head_float32 else model.lm_head(hidden).float()
        rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)].log_softmax(-1)
        out[i, : len(response)] = rows.gather(-1, torch.tensor(response)[:, None])[:, 0]
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_head_is_the_fp32_projection_of_the_model_dtype_hidden_states(dtype):
    batch = _batch()
    mask = batch.response_mask
    model = _peaked(dtype)
    for head in (None, "float32"):
        policy = Policy(model, build_char_tokenizer(), head_dtype=head)
        assert policy.head_float32 == (head == "float32")
        with torch.no_grad():
            ours = policy.batch_logprobs(batch).logprobs
        expected = _by_hand(model, batch, head_float32=head == "float32")
        other = _by_hand(model, batch, head_float32=head != "float32")
        assert (ours - expected)[mask].abs().max() < 1e-4  # left padding rounds a little differently
        assert (ours - other)[mask].abs().max() > 1e-3, "the head's precision is what the option changes"


def test_fp32_head_backpropagates_into_the_low_precision_weight():
    policy = Policy(_peaked(torch.float16), build_char_tokenizer(), head_dtype="float32")
    batch = _batch()
    out = policy.batch_logprobs(batch).logprobs
    out[batch.response_mask].sum().backward()
    grad = policy.model.lm_head.weight.grad
    assert grad is not None and grad.dtype == torch.float16 and torch.isfinite(grad).all()
    assert (
        policy.model.lm_head.weight.dtype == torch.float16
    )  # the weight keeps its dtype (not TRL's fp32 copy)


def test_bad_head_dtype_is_refused():
    with pytest.raises(ValueError, match="head_dtype must be one of"):
        Policy(build_tiny_qwen3(seed=0), build_char_tokenizer(), head_dtype="fp32")
