"""How the bias of the uncorrected policy gradient grows with a drift of the trainer's own updates and with rollout
noise, on exact softmax policies (the argument of docs/async.md, "AIS under staleness").

For random contexts (``--contexts`` softmax policies over ``--actions`` actions with random logits and rewards)
the behaviour policy pi_v generates and the trained policy pi is

- **drift**: pi_v's logits moved by ``eps`` times the exact policy-gradient step of the context (what the trainer's
  own updates do between the version that generated a row and the one trained), or
- **noise**: the trainer's logits plus i.i.d. Gaussian noise of scale ``sigma`` on the rollout's side (docs/ais.md
  assumption A3), the bias of the *expected* gradient averaged over antithetic draws.

Printed per scale: the median relative bias |E_pi_v[A grad log pi] - E_pi[A grad log pi]| / |E_pi[A grad log pi]|,
the median 2 KL / G (AIS's severity beta for noise) and its square root (AIS's staleness severity), and the bias over
each. A drift's bias follows sqrt(2 KL / G) (first order: doubling eps doubles it); noise's follows 2 KL / G
(second order: doubling sigma quadruples it).

    python tools/staleness_bias.py --contexts 400 --actions 12 --seed 0
"""

from __future__ import annotations

import argparse

import torch


def relative_bias(behaviour: torch.Tensor, pi: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """Per context (``[N]``): the relative bias of the uncorrected gradient in logit space, sampled by ``behaviour``
    (``[N, K]`` probabilities) while training ``pi``."""
    score = torch.eye(pi.shape[-1], dtype=pi.dtype)[None] - pi[:, None, :]  # [N, K(a), K] grad_z log pi(a)
    target = torch.einsum("na,na,nak->nk", pi, rewards, score)
    sampled = torch.einsum("na,na,nak->nk", behaviour, rewards, score)
    return (sampled - target).norm(dim=-1) / target.norm(dim=-1)


def severity(behaviour: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """2 KL(behaviour || pi) / G(pi) per context (``[N]``)."""
    kl = (behaviour * (behaviour.log() - pi.log())).sum(-1)
    return 2.0 * kl / (1.0 - (pi * pi).sum(-1))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, default=400)
    parser.add_argument("--actions", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pairs", type=int, default=400, help="antithetic noise draws per scale")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    z = 2.0 * torch.randn(args.contexts, args.actions, generator=gen, dtype=torch.float64)  # [N, K]
    rewards = torch.randn(args.contexts, args.actions, generator=gen, dtype=torch.float64)
    pv = z.softmax(-1)
    step = pv * (rewards - (pv * rewards).sum(-1, keepdim=True))  # the exact policy-gradient step in logits
    print("| drift eps | bias | 2KL/G | sqrt(2KL/G) | bias / sqrt(2KL/G) | bias / (2KL/G) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for eps in (0.025, 0.05, 0.1, 0.2):
        pi = (z + eps * step).softmax(-1)
        b, s = relative_bias(pv, pi, rewards).median(), severity(pv, pi).median()
        print(f"| {eps} | {b:.4f} | {s:.2e} | {s.sqrt():.4f} | {b / s.sqrt():.2f} | {b / s:.1f} |")
    print()
    print("| noise sigma | bias of the expected gradient | 2KL/G | bias / sqrt(2KL/G) | bias / (2KL/G) |")
    print("| --- | --- | --- | --- | --- |")
    pi = z.softmax(-1)
    score = torch.eye(args.actions, dtype=z.dtype)[None] - pi[:, None, :]
    target = torch.einsum("na,na,nak->nk", pi, rewards, score)
    for sigma in (0.05, 0.1, 0.2, 0.4):
        acc, sev = torch.zeros_like(z), torch.zeros(args.contexts, dtype=z.dtype)
        for _ in range(args.pairs):
            eta = sigma * torch.randn(z.shape, generator=gen, dtype=z.dtype)
            for mu in ((z + eta).softmax(-1), (z - eta).softmax(-1)):
                acc += torch.einsum("na,na,nak->nk", mu, rewards, score) - target
                sev += severity(mu, pi)
        b = ((acc / (2 * args.pairs)).norm(dim=-1) / target.norm(dim=-1)).median()
        s = (sev / (2 * args.pairs)).median()
        print(f"| {sigma} | {b:.5f} | {s:.2e} | {b / s.sqrt():.3f} | {b / s:.2f} |")


if __name__ == "__main__":
    main()
