"""The device memory a trainer still allocates after its rollout engine starts, for an engine that claims a share.

vLLM takes its share of the device when it starts (``gpu_memory_utilization`` x total, checked against the memory
free then: vLLM 0.33 ``v1/worker/utils.py``, ``request_memory``) and keeps it. The GRPO module builds its engine
before the first training step (at the validation before training, or when training starts), when the
optimizer's states and the gradients do not exist yet: ``torch.optim.AdamW`` creates ``exp_avg`` and
``exp_avg_sq`` (each ``torch.zeros_like(param)``) at its first ``step`` (``torch/optim/adamw.py``,
``_init_group``), and the first backward creates the gradients. An engine whose class declares
``RESERVES_TRAINER_MEMORY`` gets those bytes as ``reserve_bytes`` (:func:`engine_memory_arguments`), so its share
comes out of what is left after them instead of the trainer's states coming out of the other half.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ais_lightning.rollout import engine_class_of

ADAMW_STATES = 2
"""State tensors ``torch.optim.AdamW`` keeps per parameter (``exp_avg``, ``exp_avg_sq``), each the parameter's
size and dtype (``amsgrad=False``, GRPOModule's optimizer)."""


def _local(param: torch.Tensor) -> torch.Tensor:
    """The part of ``param`` this rank holds: an FSDP2 DTensor's local shard, else the tensor."""
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def pending_trainer_bytes(
    parameters: Iterable[torch.Tensor],
    optimizer_state: Mapping[torch.Tensor, Any] | None = None,
    optimizer_states: int = ADAMW_STATES,
) -> int:
    """Bytes of gradients and optimizer states not allocated yet for this rank's trainable ``parameters``.

    Per parameter that requires grad: its gradient when ``param.grad`` is None, plus ``optimizer_states`` state
    tensors when ``optimizer_state`` (the optimizer's ``state``, keyed by parameter; None: no optimizer yet) has
    none for it, each the size and dtype of the rank's shard (FSDP2 shards the gradients and AdamW's states as the
    parameters).
    """
    total = 0
    for param in parameters:
        if not param.requires_grad:
            continue
        local = _local(param)
        count = (param.grad is None) + (optimizer_states if not (optimizer_state or {}).get(param) else 0)
        total += count * local.numel() * local.element_size()
    return total


def engine_memory_arguments(
    factory: Any, parameters: Iterable[torch.Tensor], optimizers: Iterable[Any] = ()
) -> dict[str, int]:
    """Extra constructor arguments for ``factory(model)``: ``{"reserve_bytes": ...}`` when the factory's engine
    class declares ``RESERVES_TRAINER_MEMORY`` (the factory's own ``reserve_bytes``, if any, plus
    :func:`pending_trainer_bytes` of ``parameters`` under the first of ``optimizers``), else nothing."""
    found = engine_class_of(factory)
    if found is None or not found[0].RESERVES_TRAINER_MEMORY:
        return {}
    arguments = found[1]
    optimizer = next(iter(optimizers), None)
    pending = pending_trainer_bytes(parameters, None if optimizer is None else optimizer.state)
    return {"reserve_bytes": int(arguments.get("reserve_bytes", 0)) + pending}


def leave_room_for_the_trainer(
    factory: Any, parameters: Iterable[torch.Tensor], optimizers: Iterable[Any] = ()
) -> Any:
    """``factory`` with :func:`engine_memory_arguments` bound (``functools.partial``), or ``factory`` itself when its
    engine claims no share of the device."""
    memory = engine_memory_arguments(factory, parameters, optimizers)
    return functools.partial(factory, **memory) if memory else factory
