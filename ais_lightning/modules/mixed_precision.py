"""FP16 training: fp16 parameters and compute, fp32 master weights in the optimizer, a dynamic loss scale.

Who uses it: :class:`ais_lightning.modules.GRPOModule` (and ``SFTModule``, the warm start) build their AdamW through
:func:`build_optimizer`, which returns a :class:`MasterWeightOptimizer` when the policy's parameters are float16
(``policy.dtype=float16``) and the plain optimizer otherwise; the modules then scale the loss before backward
(:meth:`MasterWeightOptimizer.scale_loss`), take the unscaled gradients for clipping
(:meth:`MasterWeightOptimizer.grad_params`) and report a skipped step (:meth:`MasterWeightOptimizer.record_overflow`).

Why fp32 master weights rather than pure fp16 (as ``policy.dtype=bfloat16`` is pure bf16): AdamW on fp16 parameters
keeps its moments in fp16 too. Its ``eps`` (1e-8) is below fp16's smallest subnormal (6e-8) and rounds to 0, and a
squared gradient under ~2.4e-4 underflows to 0, so ``m / (sqrt(v) + eps)`` divides by zero; and an update of
``lr`` ~1e-6 on a weight of ~1e-2 is below half an fp16 step (2^-11 relative) and rounds away. So the model keeps
fp16 parameters (its forward and backward run in fp16, exactly as an fp16 rollout engine computes, which is the
point of arXiv 2510.26788), while the optimizer steps fp32 copies and writes them back rounded: DeepSpeed's fp16
mode, which OpenRLHF's ``--ds.param_dtype fp16`` turns on, and FSDP's ``MixedPrecision(param_dtype=float16)``.

Why a loss scale: fp16's range ends at 6e-8 (subnormal), where many gradients of a small per-token loss lie.
:class:`DynamicLossScale` is ``torch.amp.GradScaler``'s rule (the same defaults and the same scale sequence, checked
against it in the tests), with the overflow decision passed in, so that every rank takes the decision all ranks
agreed on (GRPO's ``_all_ranks_finite``) and the scale stays identical across ranks. Its state is part of the
optimizer's state dict (with the master weights), so a checkpoint resumes it exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["DynamicLossScale", "MasterWeightOptimizer", "build_optimizer", "master_optimizer"]


class DynamicLossScale:
    """A dynamic loss scale: ``torch.amp.GradScaler``'s update rule with the overflow decision passed in.

    A step with non-finite gradients multiplies the scale by ``backoff_factor`` (and is skipped by the caller);
    ``growth_interval`` finite steps in a row multiply it by ``growth_factor``. Defaults are GradScaler's.

    Example:
        >>> scale = DynamicLossScale(init_scale=8.0, growth_interval=2)
        >>> scale.update(finite=False); scale.scale
        4.0
        >>> scale.update(finite=True); scale.update(finite=True); scale.scale
        8.0
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a finite number > 0, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.growth_tracker = 0
        """Finite steps since the last change of the scale."""

    def update(self, finite: bool) -> None:
        """After a step: back off on an overflow (``finite=False``), grow after ``growth_interval`` good steps."""
        if not finite:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = self.scale * self.growth_factor
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "growth_tracker": self.growth_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"scale", "growth_tracker"} - set(state)
        if missing:
            raise ValueError(f"loss-scale state is missing {sorted(missing)}")
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        for key in ("growth_factor", "backoff_factor", "growth_interval"):
            if key in state:
                setattr(self, key, type(getattr(self, key))(state[key]))


_HYPER_SKIP = ("params",)


class MasterWeightOptimizer(torch.optim.Optimizer):
    """Steps fp32 master copies of low-precision parameters with an inner optimizer, then writes them back.

    Args:
        params: the model's parameters (float16; any dtype works), as for any optimizer; ``param_groups`` hold
            them, so learning-rate schedules and ``group["lr"] = ...`` act as usual (copied to the inner
            optimizer at every step).
        optimizer: builds the inner optimizer from parameter groups of fp32 master tensors, e.g.
            ``functools.partial(torch.optim.AdamW, lr=1e-5)``.
        loss_scale: the dynamic loss scale (default :class:`DynamicLossScale` with GradScaler's defaults).

    One step: ``zero_grad()``; ``scale_loss(loss).backward()`` (the fp16 gradients are scaled); optionally
    ``unscale_()`` and clip :meth:`grad_params` (the fp32 master gradients, unscaled); ``step()``. ``step`` moves
    the gradients to the masters (``unscale_``) if that was not done, skips the update and backs off the scale when
    one is not finite, else steps the masters and copies them, rounded, into the parameters. A step without any
    gradient (an "empty" step that only counts) changes nothing, the scale included; a caller that decides to skip
    a step itself (e.g. on an all-ranks decision) calls :meth:`record_overflow` and then zeroes the gradients.

    ``state_dict()`` holds the inner optimizer's state, the master weights and the loss scale: loading it restores
    all three and writes the masters, rounded, into the parameters (the masters are the weights).

    Example:
        >>> import functools
        >>> w = torch.nn.Parameter(torch.full((2,), 1.0, dtype=torch.float16))
        >>> sgd = functools.partial(torch.optim.SGD, lr=1e-4)
        >>> opt = MasterWeightOptimizer([w], sgd, DynamicLossScale(init_scale=1024.0))
        >>> for _ in range(3):
        ...     opt.zero_grad()
        ...     opt.scale_loss(w.float().sum()).backward()  # d/dw = 1
        ...     opt.step()
        >>> opt.masters()[0].detach()  # 1 - 3e-4 in fp32; fp16's spacing under 1.0 is 2^-11 = 4.9e-4
        tensor([0.9997, 0.9997])
        >>> w.data  # the masters rounded; pure fp16 SGD rounds each 1e-4 step away and stays at 1.0
        tensor([0.9995, 0.9995], dtype=torch.float16)
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer: Callable[..., torch.optim.Optimizer],
        loss_scale: DynamicLossScale | None = None,
    ) -> None:
        super().__init__(params, defaults={})
        inner_groups = []
        for group in self.param_groups:
            masters = [p.detach().to(torch.float32, copy=True).requires_grad_(True) for p in group["params"]]
            inner_groups.append(
                {**{k: v for k, v in group.items() if k not in _HYPER_SKIP}, "params": masters}
            )
        self.inner = optimizer(inner_groups)
        """The optimizer of the fp32 master weights."""
        if len(self.inner.param_groups) != len(self.param_groups):
            raise ValueError("the inner optimizer must keep the parameter groups it is given")
        for group, inner in zip(self.param_groups, self.inner.param_groups):  # its defaults filled in
            group.update({k: v for k, v in inner.items() if k not in _HYPER_SKIP})
        self.loss_scale = loss_scale if loss_scale is not None else DynamicLossScale()
        """The dynamic loss scale (its state is in :meth:`state_dict`)."""

    # ------------------------------------------------------------ parameters
    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, fp32 master) of every parameter, group by group."""
        return [
            (p, m)
            for group, inner in zip(self.param_groups, self.inner.param_groups)
            for p, m in zip(group["params"], inner["params"])
        ]

    def masters(self) -> list[torch.Tensor]:
        """The fp32 master weights, in parameter order."""
        return [m for _, m in self._pairs()]

    def grad_params(self) -> list[torch.Tensor]:
        """The fp32 masters that have a gradient, after :meth:`unscale_`: what to clip (their gradients are
        the unscaled ones the update uses)."""
        self.unscale_()
        return [m for m in self.masters() if m.grad is not None]

    # ------------------------------------------------------------ gradients
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale: backpropagate this one."""
        return loss * self.loss_scale.scale

    @torch.no_grad()
    def unscale_(self) -> None:
        """Move every parameter's (scaled) gradient to its master, in fp32 and divided by the scale; the
        parameter's own gradient is freed. Idempotent: a second call finds no parameter gradient. Call it after the
        last backward of a step (a later backward would start a new gradient)."""
        inv = 1.0 / self.loss_scale.scale
        for p, m in self._pairs():
            if p.grad is None:
                continue
            m.grad = p.grad.to(torch.float32).mul_(inv)
            p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.inner.zero_grad(set_to_none=set_to_none)

    def record_overflow(self) -> None:
        """A step skipped on non-finite gradients by the caller's decision: back off the scale, drop the gradients."""
        self.loss_scale.update(finite=False)
        self.zero_grad(set_to_none=True)

    # ------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.unscale_()
        grads = [m.grad for m in self.masters() if m.grad is not None]
        if not grads:  # an empty step: nothing to apply, the scale unchanged
            return loss
        finite = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
        if not finite:
            self.record_overflow()
            return loss
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in group.items() if k not in _HYPER_SKIP})
        self.inner.step()
        self._write_back()
        self.loss_scale.update(finite=True)
        return loss

    def _write_back(self) -> None:
        for p, m in self._pairs():
            p.copy_(m)

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "inner": self.inner.state_dict(),
            "masters": [m.detach() for m in self.masters()],
            "loss_scale": self.loss_scale.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or not {"inner", "masters", "loss_scale"} <= set(state_dict):
            raise ValueError(
                "this optimizer state has no fp32 master weights or loss scale: it was saved by a run whose policy "
                "was not float16 (policy.dtype changed between the run and its resume?)"
            )
        masters = self.masters()
        saved = list(state_dict["masters"])
        if len(saved) != len(masters) or any(s.shape != m.shape for s, m in zip(saved, masters)):
            raise ValueError(
                f"the saved master weights ({len(saved)} tensors) do not match this optimizer's parameters "
                f"({len(masters)} tensors) in number or shape"
            )
        self.inner.load_state_dict(state_dict["inner"])
        for m, s in zip(masters, saved):
            m.copy_(s)
        self.loss_scale.load_state_dict(state_dict["loss_scale"])
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            group.update({k: v for k, v in inner.items() if k not in _HYPER_SKIP})
        self._write_back()


def master_optimizer(optimizer: Any) -> MasterWeightOptimizer | None:
    """The :class:`MasterWeightOptimizer` behind ``optimizer`` (Lightning's ``LightningOptimizer`` unwrapped), else
    None."""
    raw = getattr(optimizer, "optimizer", optimizer)
    return raw if isinstance(raw, MasterWeightOptimizer) else None


def build_optimizer(
    params: Iterable[torch.Tensor], optimizer: Callable[..., torch.optim.Optimizer]
) -> torch.optim.Optimizer:
    """``optimizer(params)``, or a :class:`MasterWeightOptimizer` around it when a parameter is float16."""
    params = list(params)
    if any(p.dtype == torch.float16 for p in params):
        return MasterWeightOptimizer(params, optimizer)
    return optimizer(params)
