"""LLaDA's masked-token SFT loss: the formula by hand, the noising process, the canvas, and a short SFT."""

from __future__ import annotations

import math

import pytest
import torch

from ais_lightning.models import build_tiny_diffusion
from ais_lightning.modules.sft import encode_pairs
from ais_lightning.policy import DiffusionPolicy, tiny_diffusion_policy
from ais_lightning.policy.diffusion import forward_process, masked_diffusion_loss

MASK, EOS = 99, 2


def test_masked_diffusion_loss_by_hand():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, 0.0]])
    masked = torch.tensor([[True, False, True], [False, True, False]])
    answer = torch.tensor([[True, True, True], [True, True, False]])
    p = torch.tensor([0.5, 0.25])
    # row 0: (1 + 3) / 0.5 / 3 = 8/3; row 1: 4 / 0.25 / 2 = 8; mean = 16/3
    assert masked_diffusion_loss(lp, masked, answer, p).item() == pytest.approx(16 / 3, abs=1e-6)
    with pytest.raises(ValueError, match="outside answer_mask"):
        masked_diffusion_loss(lp, masked, answer & ~masked, p)
    with pytest.raises(ValueError, match="p_mask"):
        masked_diffusion_loss(lp, masked, answer, torch.tensor([0.5]))


def test_forward_process():
    answer = torch.tensor([[True] * 6 + [False] * 2] * 400)
    masked, p = forward_process(answer, eps=0.1, generator=torch.Generator().manual_seed(0))
    masked2, p2 = forward_process(answer, eps=0.1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(masked, masked2) and torch.equal(p, p2)
    assert not masked[:, 6:].any()  # never outside the answer
    assert p.min() >= 0.1 and p.max() < 1.0
    # E[#masked / 6] = E[p] = (1 - eps)/2 + eps = 0.55; 400 rows x 6 draws: s.e. ~0.02
    assert masked[:, :6].float().mean().item() == pytest.approx(0.55, abs=0.06)
    everything, p_one = forward_process(answer, eps=1.0)
    assert torch.equal(everything, answer) and (p_one == 1).all()


def test_sft_canvas_fills_the_tail_with_eos():
    policy = DiffusionPolicy(build_tiny_diffusion(seed=0), response_length=5)
    ids = torch.tensor([[20, 21, EOS], [22, EOS, 0]])
    mask = ids != 0
    assert policy.sft_canvas(ids, mask).tolist() == [[20, 21, EOS, EOS, EOS], [22, EOS, EOS, EOS, EOS]]
    policy.response_length = 2
    with pytest.raises(ValueError, match="response_length=2"):
        policy.sft_canvas(ids, mask)
    policy.response_length = None
    assert policy.sft_canvas(ids, mask).tolist() == [[20, 21, EOS], [22, EOS, EOS]]
    with pytest.raises(ValueError, match="right-padded"):
        policy.sft_canvas(ids, torch.tensor([[False, True, True], [True, True, False]]))


def _pairs(policy, n=3):
    prompts = ["12+34=", "5+6=", "99+99="][:n]
    solutions = ["46", "11", "198"][:n]
    return encode_pairs(policy.tokenizer, prompts, solutions)


def test_sft_loss_of_a_uniform_model_by_hand():
    """Zero lm_head (tied: zero embeddings, so zero hidden states): every real token has log-prob -log 99
    (the mask token is suppressed), so the loss is mean_b(#masked_b * log 99 / p_b / T)."""
    policy = tiny_diffusion_policy(seed=0, response_length=6)
    with torch.no_grad():
        policy.model.lm_head.weight.zero_()
    loss = policy.sft_loss(*_pairs(policy), generator=torch.Generator().manual_seed(3))
    masked, p = forward_process(
        torch.ones(3, 6, dtype=torch.bool), generator=torch.Generator().manual_seed(3)
    )
    expected = (masked.sum(-1) * math.log(99) / p / 6).mean()
    assert masked.any()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_sft_loss_matches_an_independent_computation_and_never_masks_the_prompt():
    policy = tiny_diffusion_policy(seed=0, response_length=6)
    p_ids, p_mask, r_ids, r_mask = _pairs(policy)
    seen = []
    handle = policy.model.model.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    loss = policy.sft_loss(p_ids, p_mask, r_ids, r_mask, generator=torch.Generator().manual_seed(1))
    handle.remove()
    assert torch.equal(seen[0][:, : p_ids.shape[1]], p_ids)  # the prompt went in unmasked

    canvas = policy.sft_canvas(r_ids, r_mask)
    masked, p = forward_process(
        torch.ones_like(canvas, dtype=torch.bool), generator=torch.Generator().manual_seed(1)
    )
    noisy = torch.where(masked, MASK, canvas)
    ids = torch.cat([p_ids, noisy], dim=1)
    with torch.no_grad():
        logp = policy.model(ids, attention_mask=torch.cat([p_mask, torch.ones_like(masked)], 1)).log_softmax(
            -1
        )
    plen = p_ids.shape[1]
    nll = -logp[:, plen:].gather(-1, canvas[..., None]).squeeze(-1)  # [B, T]
    expected = ((nll * masked).sum(-1) / p / canvas.shape[1]).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()
    assert policy.model.lm_head.weight.grad.abs().sum() > 0


def test_short_sft_lowers_the_loss():
    """40 AdamW steps on 16 fixed additions: the loss (averaged over fixed masks) falls well below its start."""
    policy = tiny_diffusion_policy(seed=0, response_length=4)
    pairs = [(f"{a}+{b}=", str(a + b)) for a, b in [(12, 34), (5, 6), (40, 2), (7, 70), (33, 3), (9, 9)] * 3][
        :16
    ]
    batch = encode_pairs(policy.tokenizer, [p for p, _ in pairs], [s for _, s in pairs])

    def eval_loss() -> float:
        with torch.no_grad():
            return (
                sum(
                    policy.sft_loss(*batch, generator=torch.Generator().manual_seed(s)).item()
                    for s in range(8)
                )
                / 8
            )

    before = eval_loss()
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        opt.zero_grad()
        policy.sft_loss(*batch, generator=gen).backward()
        opt.step()
    after = eval_loss()
    assert after < 0.5 * before, (before, after)
