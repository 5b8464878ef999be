"""Mixture-of-experts routing: recorded by the rollout engine, replayed by the trainer (rollout routing replay, R3).

A top-k router picks each token's experts from its logits; a low-precision engine and the high-precision trainer
see slightly different hidden states, so their routers disagree on some tokens and the trainer scores a sample
with other experts than the ones that generated it (Ma et al., "Stabilizing MoE Reinforcement Learning by
Aligning Training and Inference Routers", arXiv 2510.11370). R3 records the engine's top-k expert ids of every
token in every MoE layer and makes the trainer's routers use them.

Conventions (shared by :class:`ais_lightning.rollout.TorchRolloutEngine` and :class:`ais_lightning.policy.Policy`):

- ``routing``: ``[B, P + T, L, k]`` integer expert ids (``uint8`` up to 256 experts, else ``int16``: see
  :func:`routing_dtype`), position ``s`` of the concatenated (left-padded prompt | response) sequence of
  :func:`ais_lightning.policy.build_sequences`, MoE layer ``l`` (routers in module order, :func:`moe_routers`),
  the router's own top-k order. The prompt is included: its routing shapes the keys and values every response
  token attends to, as in verl's and slime's R3, which record the whole sequence.
- :func:`routing_replay_mask` ``[B, P + T]``: the positions whose routing matters for a response log-prob and was
  recorded: the real prompt tokens and every response token followed by another valid one (the last valid token
  only predicts a token nobody scores, and the engine never runs it through the model).

Gate weights under replay (:func:`replay_gate_weights`): the trainer's own router probabilities taken at the
engine's expert ids (``softmax(logits)`` gathered at the replayed indices, renormalized over the k when the router
normalizes its top-k, ``norm_topk_prob``), so gradients reach the router. This follows slime
(``slime/utils/routing_replay.py``: ``probs = scores.gather(1, top_indices)``) and verl's Megatron patch
(``verl/utils/megatron/router_replay_patch.py``), which both gather the trainer's scores at the replayed indices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ais_lightning.ops import topk_sets_differ

__all__ = [
    "RoutingRecorder",
    "gate_normalization",
    "RoutingReplay",
    "moe_routers",
    "replay_gate_weights",
    "routing_dtype",
    "routing_replay_mask",
    "topk_sets_differ",
]


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k routers of ``model``'s mixture-of-experts layers, in module order (one per MoE layer).

    A router is a module with ``top_k`` and ``num_experts`` and a 2-D ``weight [E, H]`` returning
    ``(router_logits [N, E], weights [N, k], indices [N, k])`` (transformers' ``Qwen3MoeTopKRouter`` and its
    siblings). Dense models have none.
    """
    found = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            isinstance(getattr(module, "top_k", None), int)
            and isinstance(getattr(module, "num_experts", None), int)
            and isinstance(weight, torch.Tensor)
            and weight.dim() == 2
            and weight.shape[0] == module.num_experts
        ):
            found.append(module)
    return found


def routing_dtype(num_experts: int) -> torch.dtype:
    """The compact integer dtype of expert ids: ``uint8`` for up to 256 experts, else ``int16`` (up to 32768)."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    raise ValueError(f"num_experts={num_experts} does not fit the int16 routing record")


def routing_replay_mask(prompt_mask: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Positions of the ``[B, P + T]`` sequence whose recorded routing is replayed (module docstring).  # [B, P+T]

    ``prompt_mask [B, P]`` (left-padded), ``response_mask [B, T]`` (right-padded), both bool.
    """
    followed = torch.zeros_like(response_mask)  # [B, T]: token t is followed by a valid token t + 1
    followed[:, :-1] = response_mask[:, 1:]
    return torch.cat([prompt_mask, followed & response_mask], dim=1)


def replay_gate_weights(router_logits: torch.Tensor, index: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Gate weights of the experts ``index [N, k]`` from the trainer's own ``router_logits [N, E]``.  # [N, k]

    ``softmax(logits)`` (in float32, as transformers' routers) gathered at ``index``, divided by its sum over the
    k when ``normalize`` (``norm_topk_prob``); cast back to the logits' dtype. Differentiable in the logits.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [N, E]
    weights = probs.gather(-1, index.long())  # [N, k]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype)


@torch.no_grad()
def gate_normalization(router: nn.Module) -> bool | None:
    """Whether ``router``'s gate weights are its softmax probabilities at its top-k renormalized over the k (True:
    Qwen3-MoE with ``norm_topk_prob``, Mixtral) or not (False: OLMoE, Qwen2-MoE without it), found on a 4-token
    probe; None when neither reproduces them (sigmoid or grouped routers, DeepSeek-V3's: replay is refused).
    Without a probe (meta or sharded weights) the router's ``norm_topk_prob`` (default True) is trusted."""
    weight = router.weight
    if weight.is_meta or type(weight).__name__ == "DTensor":
        return bool(getattr(router, "norm_topk_prob", True))
    probe = torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(0))
    logits, gates, index = router(probe.to(device=weight.device, dtype=weight.dtype))
    for normalize in (
        bool(getattr(router, "norm_topk_prob", True)),
        not getattr(router, "norm_topk_prob", True),
    ):
        ours = replay_gate_weights(logits, index, normalize)
        if torch.allclose(ours.float(), gates.float(), rtol=1e-4, atol=1e-6):
            return normalize
    return None


_RECORDER_ATTR = "_ais_routing_recorder"
_REPLAY_ATTR = "_ais_routing_replay"
"""Router attributes the hooks find their owner under, ``(owner, layer)`` (not closures: a deep copy of the model,
e.g. a reference policy, then hooks its own copy of the owner)."""


def _record_hook(module: nn.Module, args: tuple, output: tuple) -> None:
    recorder, layer = getattr(module, _RECORDER_ATTR)
    if recorder.active:
        recorder._last[layer] = output[2].detach()  # [N, k]


def _replay_hook(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
    replay, layer = getattr(module, _REPLAY_ATTR)
    return replay._route(module, layer, output)


def _attach(router: nn.Module, attr: str, owner: tuple, hook) -> None:  # noqa: ANN001
    """Point ``router``'s ``hook`` at ``owner``; the hook is registered once per router (a model wrapped again, by a
    second policy or engine, hands its router to the newest owner instead of running two hooks)."""
    setattr(router, attr, owner)
    if not any(h is hook for h in router._forward_hooks.values()):
        router.register_forward_hook(hook)


class RoutingRecorder:
    """Forward hooks on ``routers`` that keep the expert ids of their last forward while :meth:`capture` is on.

    The engine runs a forward inside ``capture()`` and reads :meth:`take`: ``[N, L, k]`` ids of the ``N`` tokens of
    that forward (flattened ``[batch, sequence]`` row-major, as transformers' MoE blocks flatten them).
    """

    def __init__(self, routers: list[nn.Module]) -> None:
        self.routers = list(routers)
        self.active = False
        self._last: list[torch.Tensor | None] = [None] * len(self.routers)
        for layer, router in enumerate(self.routers):
            _attach(router, _RECORDER_ATTR, (self, layer), _record_hook)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        self.active = True
        self._last = [None] * len(self.routers)
        try:
            yield
        finally:
            self.active = False

    def take(self) -> torch.Tensor:
        """The last captured forward's ids, ``[N, L, k]`` (ValueError when a router did not run)."""
        if any(t is None for t in self._last):
            missing = [i for i, t in enumerate(self._last) if t is None]
            raise ValueError(f"routing was not recorded for MoE layers {missing} in the last forward")
        return torch.stack(self._last, dim=1)  # type: ignore[arg-type]


@dataclass
class ReplayPlan:
    """One forward's routing: what to replay (None = the trainer's own routing) and what happened."""

    index: torch.Tensor | None
    """``[N, L, k]`` expert ids to replay (flattened ``[B, S]`` rows), or None."""
    mask: torch.Tensor | None
    """``[N]`` bool: rows replayed (elsewhere the trainer's own routing), or None."""
    own: list[torch.Tensor | None] = field(default_factory=list)
    """Per layer, ``[N, k]`` the trainer's own top-k (what its router picked before any replay)."""
    used: list[torch.Tensor | None] = field(default_factory=list)
    """Per layer, ``[N, k]`` the experts the forward actually used."""
    shape: tuple[int, int] = (0, 0)
    """``(B, S)`` of the forward's input ids (``N = B * S``)."""


class RoutingReplay:
    """Forward hooks on a trainer model's ``routers`` that replay recorded expert ids inside :meth:`replay`.

    Outside :meth:`replay` the routers are untouched. Inside, each router's output ``(logits, weights, indices)``
    is replaced on the replayed rows by the recorded indices and :func:`replay_gate_weights` of the trainer's
    logits; the trainer's own and the used top-k of every layer are kept in :attr:`last` (``[B, S, L, k]``
    each, :meth:`last_routing`) for the routing-disagreement metric and for tests.
    """

    def __init__(self, routers: list[nn.Module]) -> None:
        self.routers = list(routers)
        self.plan: ReplayPlan | None = None
        self.last: ReplayPlan | None = None
        self.normalize = [gate_normalization(r) for r in self.routers]
        """Per MoE layer, how its gate weights are recomputed under replay (:func:`gate_normalization`; None: the
        router is not one replay reproduces)."""
        for layer, router in enumerate(self.routers):
            _attach(router, _REPLAY_ATTR, (self, layer), _replay_hook)

    def _route(self, module: nn.Module, layer: int, output: tuple) -> tuple | None:
        """The router's output under the active plan (None: unchanged)."""
        plan = self.plan
        if plan is None:
            return None
        logits, _, own = output  # [N, E], [N, k], [N, k]
        plan.own[layer] = own.detach()
        if plan.index is None:
            plan.used[layer] = own.detach()
            return None
        if plan.index.shape[0] != own.shape[0] or plan.index.shape[-1] != own.shape[-1]:
            raise ValueError(
                f"routing has {plan.index.shape[0]} rows of top-{plan.index.shape[-1]} for MoE layer {layer}, "
                f"whose router ran on {own.shape[0]} tokens of top-{own.shape[-1]}"
            )
        target = plan.index[:, layer].to(device=own.device, dtype=own.dtype)  # [N, k]
        index = torch.where(plan.mask.to(own.device)[:, None], target, own)  # [N, k]
        normalize = self.normalize[layer]
        if normalize is None:
            raise ValueError(
                f"routing replay: {type(module).__name__} (MoE layer {layer}) does not weight its experts by softmax "
                "probabilities at its top-k, which replay recomputes"
            )
        plan.used[layer] = index.detach()
        return logits, replay_gate_weights(logits, index, normalize), index

    @contextlib.contextmanager
    def replay(
        self, routing: torch.Tensor | None, mask: torch.Tensor | None, shape: tuple[int, int]
    ) -> Iterator[None]:
        """Replay ``routing [B, S, L, k]`` on the positions ``mask [B, S]`` in the forwards run inside (None:
        record the trainer's own routing only); ``shape = (B, S)`` of the forward's input ids."""
        b, s = shape
        index = flat_mask = None
        if routing is not None:
            if (
                routing.dim() != 4
                or tuple(routing.shape[:2]) != (b, s)
                or routing.shape[2] != len(self.routers)
            ):
                raise ValueError(
                    f"routing must be [B, P + T, L, k] = [{b}, {s}, {len(self.routers)}, k] (the sequence's positions, "
                    f"the model's {len(self.routers)} MoE layers), got {list(routing.shape)}"
                )
            if mask is None or tuple(mask.shape) != (b, s) or mask.dtype != torch.bool:
                raise ValueError(f"the routing replay mask must be a [{b}, {s}] bool tensor")
            index = routing.reshape(b * s, *routing.shape[2:])  # [N, L, k]
            flat_mask = mask.reshape(-1)  # [N]
        n = len(self.routers)
        plan = ReplayPlan(index, flat_mask, own=[None] * n, used=[None] * n, shape=(b, s))
        self.plan = plan
        try:
            yield
        finally:
            self.plan = None
            if all(t is not None for t in plan.own):
                self.last = plan

    def checkpoint_contexts(
        self,
    ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """``context_fn`` of torch's non-reentrant activation checkpointing: a checkpointed layer is recomputed in
        backward under the replay plan that was active at its forward (so it routes to the same experts), whatever
        ran in between."""
        return contextlib.nullcontext(), self._under(self.plan)

    @contextlib.contextmanager
    def _under(self, plan: ReplayPlan | None) -> Iterator[None]:
        previous, self.plan = self.plan, plan
        try:
            yield
        finally:
            self.plan = previous

    def last_routing(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(own, used)``, each ``[B, S, L, k]``, of the last forward run inside :meth:`replay` (None before)."""
        if self.last is None:
            return None
        b, s = self.last.shape
        own = torch.stack(self.last.own, dim=1).reshape(b, s, len(self.routers), -1)  # type: ignore[arg-type]
        used = torch.stack(self.last.used, dim=1).reshape(b, s, len(self.routers), -1)  # type: ignore[arg-type]
        return own, used
