"""All-or-nothing weight sync into an engine's private model: validate everything, then load.

A sync carries the trainer's full weights and buffers as ``(name, tensor)`` pairs (e.g.
``Policy.full_state_dict()``). :func:`validate_sync` checks the WHOLE sync before anything is
written: every name is a parameter or buffer of the engine's model, every shape matches, and every
floating-point value is finite *after the cast to the engine's dtype* (a float32 value beyond the
bfloat16 range becomes inf in a bf16 engine). A rejected sync raises ValueError naming the tensor
and leaves the model untouched; quantized layers would otherwise be left half re-quantized, and a
NaN weight would only surface later as an out-of-range sampled token. :func:`load_validated` then
copies, and :func:`requantize` re-derives the cached low-precision weights (``QuantLinear.refresh``).

Names not sent keep their current value (a partial sync is allowed).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn


def check_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of a ``sync_weights`` argument, checked; ValueError naming the argument.

    The container is checked at once: a dict (a ``state_dict``: pass ``state_dict.items()``), a tensor, a
    string or anything not iterable is refused. Each item is checked as it is consumed (the pairs may come
    from a generator that gathers one tensor at a time): a ``(str, torch.Tensor)`` pair, else the item is
    named (``named_tensors[3]``).
    """
    if isinstance(named_tensors, Mapping):
        raise ValueError(
            "sync_weights(named_tensors) takes (name, tensor) pairs, got a "
            f"{type(named_tensors).__name__} (a state_dict?): pass named_tensors=state_dict.items()"
        )
    if isinstance(named_tensors, (str, bytes, torch.Tensor)) or not isinstance(named_tensors, Iterable):
        raise ValueError(
            f"sync_weights(named_tensors) takes an iterable of (name, tensor) pairs, got {type(named_tensors).__name__}"
        )

    def pairs() -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(named_tensors):
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise ValueError(
                    f"sync_weights: named_tensors[{i}] must be a (name, tensor) pair, got {type(item).__name__}"
                    + (f" of length {len(item)}" if isinstance(item, (tuple, list, str)) else "")
                )
            name, value = item
            if not isinstance(name, str):
                raise ValueError(
                    f"sync_weights: named_tensors[{i}] has a {type(name).__name__} name, not a str"
                )
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"sync_weights: {name} must be a torch.Tensor, got {type(value).__name__} (named_tensors[{i}])"
                )
            yield name, value

    return pairs()


def sync_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> tensor of every parameter and buffer of ``model`` (tied or shared ones under each name)."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    return targets


def _shown(names: list[str], limit: int = 10) -> str:
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")


def non_finite(checks: Sequence[tuple[str, torch.Tensor, torch.dtype]]) -> list[str]:
    """The names of the ``(name, tensor, dtype)`` whose tensor has a NaN/inf once cast to ``dtype``, in order.

    A float32 value beyond the bfloat16 range becomes inf in a bf16 engine, hence the cast (one tensor at a
    time: peak extra memory one tensor). The tensors stay where they are (the trainer's GPU in a
    device-resident sync), and the flags of each device are read back at once: one device synchronization
    per device, not one per tensor.
    """
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for _, tensor, dtype in checks:
        flags.setdefault(tensor.device, []).append(torch.isfinite(tensor.detach().to(dtype)).all())
    finite = {device: iter(torch.stack(f).tolist()) for device, f in flags.items()}
    return [name for name, tensor, _ in checks if not next(finite[tensor.device])]


def validate_sync(
    model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Check a whole sync against ``model``; return ``(target, value)`` pairs to :func:`load_validated`.

    Raises ValueError, before anything is written, on: names the model does not have (all of them
    listed), a value that is not a tensor, a shape mismatch, or a floating-point value with a NaN/inf
    once cast to the target's dtype (the first offending tensor named; :func:`non_finite`).
    """
    incoming = list(check_named_tensors(named_tensors))
    targets = sync_targets(model)
    unknown = sorted({name for name, _ in incoming} - set(targets))
    if unknown:
        raise ValueError(
            f"sync_weights got {len(unknown)} names the engine's model does not have: {_shown(unknown)}"
        )
    pairs = []
    for name, value in incoming:
        target = targets[name]
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"sync_weights: {name} must be a torch.Tensor, got {type(value).__name__}")
        if value.shape != target.shape:
            raise ValueError(
                f"sync_weights: {name} has shape {tuple(value.shape)}, the engine's model has {tuple(target.shape)}"
            )
        pairs.append((target, value))
    bad = non_finite(
        [(name, value, targets[name].dtype) for name, value in incoming if targets[name].is_floating_point()]
    )
    if bad:
        target, value = targets[bad[0]], dict(incoming)[bad[0]]
        count = int((~torch.isfinite(value.detach().to(target.dtype))).sum())
        raise ValueError(
            f"sync_weights: {bad[0]} has {count} non-finite value(s) (NaN/inf) as {target.dtype}; "
            "the sync was rejected and the engine keeps its previous weights"
        )
    return pairs


@torch.no_grad()
def load_validated(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each value into its target, cast to the target's dtype and device (``copy_`` converts both at once:
    no intermediate copy)."""
    for target, value in pairs:
        target.copy_(value)


def requantize(layers: Iterable[nn.Module]) -> None:
    """Re-derive the cached low-precision weights of ``layers`` (``QuantLinear.refresh``) after a load."""
    for layer in layers:
        layer.refresh()
