"""QaRL's rollout-aligned trainer forward removes the mismatch that the same quantized engine creates."""

from __future__ import annotations

import torch

from ais_lightning.diagnostics import MismatchKL
from ais_lightning.models import build_tiny_qwen3
from ais_lightning.policy import Policy
from ais_lightning.rollout import SamplingConfig, TorchRolloutEngine


def _mismatch_kl(policy: Policy, batch) -> float:
    with torch.no_grad():
        out = policy.response_logprobs(
            batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, temperature=1.0
        )
    metric = MismatchKL("k3")
    metric.update(out.logprobs, batch.rollout_logprobs, batch.response_mask)
    return float(metric.compute())


def test_aligned_forward_cuts_the_fp8_mismatch_kl_by_more_than_10x():
    torch.manual_seed(0)
    model = build_tiny_qwen3(seed=0)
    engine = TorchRolloutEngine(
        model, precision="fp8", outlier_fraction=0
    )  # an aligned run keeps none (build.py)
    prompts = [[20 + (i % 10), 14, 20 + (i * 3) % 10, 32] for i in range(16)]
    batch = engine.generate(prompts, SamplingConfig(n=4, max_new_tokens=12, seed=0))

    unaligned = _mismatch_kl(Policy(model), batch)
    aligned_policy = Policy(build_tiny_qwen3(seed=0), aligned_quantization="fp8")
    assert aligned_policy.apply_aligned_quantization()
    aligned = _mismatch_kl(aligned_policy, batch)
    assert unaligned > 1e-6, "the fp8 engine must differ from the fp32 trainer"
    assert aligned * 10 <= unaligned, (aligned, unaligned)


def test_aligned_forward_still_trains_the_master_weights():
    policy = Policy(build_tiny_qwen3(seed=0), aligned_quantization="fp8")
    policy.apply_aligned_quantization()
    prompt_ids = torch.tensor([[20, 14, 21, 32]])
    response_ids = torch.tensor([[23, 2]])
    out = policy.response_logprobs(
        prompt_ids,
        torch.ones_like(prompt_ids, dtype=torch.bool),
        response_ids,
        torch.ones(1, 2, dtype=torch.bool),
    )
    out.logprobs.sum().backward()
    q_proj = policy.model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype == torch.float32
    assert q_proj.weight.grad is not None and q_proj.weight.grad.abs().sum() > 0
