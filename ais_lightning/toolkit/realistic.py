"""A tiny Qwen3 with the weight and activation magnitudes of a real LLM, for FP8 scale checks (the GPU tests and
``tools/gpu_smoke.py``).

HF's initializer (std 0.02, as trained LLM weights are) and, per layer, three "massive activation" MLP
channels (Sun et al. 2024, "Massive Activations in Large Language Models"): their gate/up rows are 30x
larger and their down_proj columns 30x smaller, so the down_proj input reaches ~240 on those channels
while the matching weights are ~7e-4, below E4M3's smallest subnormal (2^-9). The final norm is
scaled 10x so the next-token distribution is peaked (mean -log-prob ~1 nat, not a near-uniform ~4.6).

With every FP8 scale left at 1.0 those weights flush to zero and the log-probs break (mean |delta| vs
fp32 ~0.64 on 512 sampled tokens, measured on CPU by emulation: :func:`scale_one_fp8`); with scales
computed from each tensor (per-tensor current scaling, the blockwise ``fp8`` recipe) the mean |delta|
is ~0.07. :data:`FP8_LOGPROB_TOLERANCE` sits between the two.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ais_lightning.models import build_tiny_qwen3

FP8_LOGPROB_TOLERANCE = 0.2
"""Mean |log pi_fp32 - log mu_fp8| over sampled tokens a correctly scaled FP8 forward stays below."""
MASSIVE_CHANNELS = (7, 100, 201)
MASSIVE_GAIN = 30.0
NORM_GAIN = 10.0


def realistic_tiny_qwen3(seed: int = 0) -> nn.Module:
    """The tiny Qwen3 of the module docstring (fp32, eval mode)."""
    model = build_tiny_qwen3(seed=seed, initializer_range=0.02).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(NORM_GAIN)
        for layer in model.model.layers:
            mlp = layer.mlp
            for c in MASSIVE_CHANNELS:
                mlp.gate_proj.weight[c].mul_(MASSIVE_GAIN)
                mlp.up_proj.weight[c].mul_(MASSIVE_GAIN)
                mlp.down_proj.weight[:, c].div_(MASSIVE_GAIN)
    return model


class _ScaleOneLinear(nn.Module):
    """A linear whose weight and input are cast to E4M3 with scale 1.0 (saturating), as DelayedScaling does
    before its first scale update."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def e4m3(t: torch.Tensor) -> torch.Tensor:
            return t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(t.dtype)

        return F.linear(e4m3(x), e4m3(self.linear.weight), self.linear.bias)


def scale_one_fp8(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose linears (not ``lm_head``) run FP8 with every scale at 1.0."""
    model = copy.deepcopy(model)
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and "lm_head" not in f"{parent_name}.{name}":
                setattr(parent, name, _ScaleOneLinear(child))
    return model


def mean_abs_logprob_delta(train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean |log pi - log mu| over the valid tokens."""
    return float((train_lp - rollout_lp)[mask].abs().mean())
