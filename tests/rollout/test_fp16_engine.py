"""The torch engine at fp16 and its LM head's precision, against an independent forward of the same model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
from ais_lightning.models.head import Float32Head, check_head_dtype
from ais_lightning.rollout import SamplingConfig, TorchRolloutEngine

PROMPTS = ["12+7=", "3+4=", "905+88="]


def _peaked(dtype: torch.dtype = torch.float32):
    """The tiny model with its final norm scaled up, so its logits reach ~30 and their rounding matters (the
    untrained model's are near-uniform and hide any precision)."""
    model = build_tiny_qwen3(seed=0)
    with torch.no_grad():
        model.model.norm.weight.mul_(40.0)
    return model.to(dtype).eval()


def _independent_logprobs(model, prompt: list[int], response: list[int], head_float32: bool) -> torch.Tensor:
    """log softmax of the model's own Hugging Face forward over prompt + response (no cache, no padding), its
    head in the model dtype or in fp32 from the same hidden states; the log-prob of each response token.  # [T]"""
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt + response])).last_hidden_state[0]  # [L, H]
        w = model.lm_head.weight
        logits = F.linear(hidden.float(), w.float()) if head_float32 else model.lm_head(hidden).float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)].log_softmax(-1)  # [T, V]
    return rows.gather(-1, torch.tensor(response)[:, None])[:, 0]


def _max_errors(engine, reference, head_float32: bool) -> torch.Tensor:
    """Largest |engine log mu - independent log p| at each decode step.  # [T]"""
    tok = build_char_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    batch = engine.generate(prompts, SamplingConfig(n=2, max_new_tokens=6, seed=0))
    worst = torch.zeros(6)
    for i in range(batch.response_ids.shape[0]):
        prompt = prompts[int(batch.prompt_index[i])]
        response = batch.response_ids[i][batch.response_mask[i]].tolist()
        ours = batch.rollout_logprobs[i][: len(response)]
        err = (ours - _independent_logprobs(reference, prompt, response, head_float32)).abs()
        worst[: len(err)] = torch.maximum(worst[: len(err)], err)
    return worst


@pytest.mark.parametrize("head", [None, "float32"])
def test_fp16_engine_reproduces_an_fp16_forward(head):
    """The engine casts its copy to fp16 (the model is given in fp32) and computes its head in fp16 or fp32:
    through the model's own forward it agrees with an fp16 forward of the model to float noise, and is an order
    of magnitude or more away from the fp32 forward and from the other head precision."""
    engine = TorchRolloutEngine(_peaked(), precision="fp16", model_impl="transformers", head_dtype=head)
    assert engine.dtype == torch.float16
    fp32_head = head == "float32"
    assert _max_errors(engine, _peaked(torch.float16), fp32_head).max() < 5e-5
    assert _max_errors(engine, _peaked(torch.float16), not fp32_head).max() > 1e-3
    assert _max_errors(engine, _peaked(torch.float32), False).max() > 1e-3


def test_fp16_lean_forward_prefill_matches_and_decode_rounds_its_own_way():
    """The lean forward's first token (the packed prefill) is the fp16 forward's; its decode steps fuse the
    residual add into the GEMM (``addmm``) and the scale into the attention GEMM, which rounds once where
    Hugging Face rounds twice: within 2e-2 nats on this peaked model, not bit for bit (docs/correctors.md)."""
    engine = TorchRolloutEngine(_peaked(), precision="fp16", model_impl="lean")
    worst = _max_errors(engine, _peaked(torch.float16), False)
    assert worst[0] < 1e-4
    assert worst.max() < 2e-2


def test_fp32_head_computes_fp32_logits_from_the_engine_weights_and_follows_syncs():
    engine = TorchRolloutEngine(build_tiny_qwen3(seed=0), precision="fp16", head_dtype="float32")
    head = engine.model.get_output_embeddings()
    assert isinstance(engine.float32_head, Float32Head) and head.weight.dtype == torch.float16
    h = torch.randn(3, head.weight.shape[1]).half()
    out = head(h)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(h.float(), head.weight.float()), rtol=0, atol=0)
    # A weight sync changes the head (tied to the embedding here); the fp32 copy follows it.
    new = build_tiny_qwen3(seed=1)
    engine.sync_weights(new.named_parameters())
    torch.testing.assert_close(
        head(h), F.linear(h.float(), new.lm_head.weight.half().float()), rtol=0, atol=0
    )

    plain = TorchRolloutEngine(build_tiny_qwen3(seed=0), precision="fp16")
    assert plain.float32_head is None and plain.model.get_output_embeddings()(h).dtype == torch.float16


def test_head_dtype_values_are_checked_naming_the_argument():
    assert TorchRolloutEngine.check_args(precision="fp16", head_dtype="model")["head_dtype"] is None
    assert TorchRolloutEngine.check_args(precision="int8", head_dtype="float32")["head_dtype"] == "float32"
    with pytest.raises(ValueError, match="head_dtype of TorchRolloutEngine must be one of"):
        TorchRolloutEngine.check_args(precision="fp16", head_dtype="fp32")
    assert check_head_dtype(None) is False and check_head_dtype("auto") is False
