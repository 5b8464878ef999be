"""Full weights out of a model, sharded or not, and into another: what an engine's weight sync needs.

:func:`full_state_dict` gathers every parameter and buffer of a model (plain, FSDP2 ``fully_shard``ed or
inside an FSDP1 ``FullyShardedDataParallel`` root) as full tensors (on the CPU, or where they are) named as in
``model.state_dict()``;
:func:`load_named_tensors` copies such pairs into a model in place.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["full_state_dict", "is_fsdp_module", "load_named_tensors"]

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")
"""Name fragments that activation-checkpoint / FSDP1 / torch.compile wrappers add to buffer names."""


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _copies(
    named: Iterable[tuple[str, torch.Tensor]], device: torch.device | str | None, snapshot: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """``named`` with every tensor detached and on ``device`` (None: where it is), each distinct tensor copied once.

    ``snapshot``: tensors already on ``device`` are cloned (they never alias the originals); False: such a tensor
    is passed as is (no copy; only for a consumer that copies it at once). Names sharing one tensor (a tied
    ``lm_head.weight`` and ``embed_tokens.weight``) share one copy, as the originals share one storage.
    """
    target = None if device is None else torch.device(device)
    copies: dict[tuple[Any, ...], torch.Tensor] = {}
    out = []
    for name, t in named:
        t = t.detach()
        key = (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())
        if key not in copies:
            moves = target is not None and t.device != target
            copies[key] = t.to(target) if moves else (t.clone() if snapshot else t)
        out.append((name, copies[key]))
    return out


def _fsdp1_modules(module: nn.Module) -> list[nn.Module]:
    """The FSDP1 (``FullyShardedDataParallel``) instances in ``module``'s tree."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return []
    return [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]


def _prefix_in(root: nn.Module, module: nn.Module) -> str | None:
    """The state-dict prefix of ``module`` inside ``root`` (wrapper names removed, ``""`` for the root
    itself, with a trailing dot otherwise), or None when ``module`` is not in ``root``'s tree."""
    for name, sub in root.named_modules():
        if sub is module:
            name = _clean_name(name + ".") if name else ""
            return name
    return None


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether ``module`` is sharded by FSDP2 (``fully_shard``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(module, FSDPModule)


@torch.no_grad()
def full_state_dict(
    model: nn.Module,
    rank0_only: bool = False,
    fsdp_root: nn.Module | None = None,
    snapshot: bool = True,
    device: torch.device | str | None = "cpu",
) -> list[tuple[str, torch.Tensor]]:
    """Full (unsharded) copies of all parameters and buffers, named as in ``model.state_dict()``, on ``device``.

    Includes everything ``model.state_dict()`` holds (``lm_head.weight`` beside a tied
    ``model.embed_tokens.weight``) plus the non-persistent buffers it leaves out (rotary ``inv_freq``,
    verl #5688), so an engine's copy of the model can be made identical with :func:`load_named_tensors`.
    Sharded models are gathered with ``torch.distributed.checkpoint.state_dict.get_model_state_dict``;
    it is a collective, so call it on every rank. With ``rank0_only`` (``cpu_offload=True`` there: lower
    peak device memory) only rank 0 gets the tensors and other ranks get ``[]``; by default every rank
    gets them. The tensors are snapshots: they never alias the live parameters. ``snapshot=False`` skips
    that copy for tensors already on the CPU (an unsharded CPU model's are then its live parameters and
    buffers, detached): for a consumer that copies them at once, as every engine's ``sync_weights`` does.
    Names that share a tensor (a tied ``lm_head.weight``) share one copy.

    ``device``: where the tensors are returned, the CPU by default (a checkpoint, a consumer in another
    process). None leaves them where the gather puts them, the model's device: an engine on the trainer's GPU
    then gets them without a round trip through pageable host memory (a copy of the whole model per rank) and
    back. The FSDP2 gather (``cpu_offload=False``) materializes the full tensors on the device either way.

    FSDP2 (``fully_shard``, DTensor parameters) needs nothing more. FSDP1 (``FullyShardedDataParallel``
    units inside the model, e.g. Lightning's ``FSDPStrategy`` auto-wrapping the decoder layers) needs
    ``fsdp_root``: the outermost FSDP1 module around ``model`` (Lightning: ``trainer.strategy.model``).
    The state dict is then taken from the root and cut down to ``model``. Calling
    ``state_dict()`` on the inner model instead lazily initialises every wrapped layer as an FSDP root
    (its state-dict pre-hook runs ``_lazy_init``), which makes the real root's first forward fail
    FSDP's "Non-root FSDP instance's `_is_root` should not have been set" assertion (torch
    ``distributed/fsdp/_runtime_utils.py``), and with several ranks returns the root-owned embedding,
    norm and head as flat 1-D shards. Without ``fsdp_root`` an FSDP1 model raises ValueError.

    Callable inside ``torch.inference_mode`` (Lightning validates under it unless the process group is gloo
    or the strategy FSDP1, and GRPO syncs its engines at validation start): the gather runs outside it, under
    ``no_grad``, and returns normal tensors. Gathering FSDP2 DTensors inside it fails in
    ``get_model_state_dict`` ("Cannot set version_counter for inference tensor").
    """
    with torch.inference_mode(False), torch.no_grad():
        return _full_state_dict(model, rank0_only, fsdp_root, snapshot, device)


def _full_state_dict(
    model: nn.Module,
    rank0_only: bool,
    fsdp_root: nn.Module | None,
    snapshot: bool,
    device: torch.device | str | None,
) -> list[tuple[str, torch.Tensor]]:
    if _fsdp1_modules(model):
        state = _fsdp1_state_dict(model, fsdp_root, rank0_only)
        if rank0_only and not state:
            return []
    elif any(_is_dtensor(t) for t in model.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
        state = get_model_state_dict(model, options=options)
        if rank0_only and not state:
            return []
    else:
        state = model.state_dict()
    named = list(state.items())
    seen = set(state)
    for name, buf in model.named_buffers():
        name = _clean_name(name)
        if name not in seen:
            named.append((name, buf))
            seen.add(name)
    return _copies(named, device, snapshot)


def _fsdp1_state_dict(
    model: nn.Module, fsdp_root: nn.Module | None, rank0_only: bool
) -> dict[str, torch.Tensor]:
    """The full state dict of ``model`` taken from its FSDP1 root (see :func:`full_state_dict`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if fsdp_root is None:
        raise ValueError(
            "fsdp_root is required: policy.model is sharded by FSDP1 (FullyShardedDataParallel); pass the "
            "outermost FSDP module around the policy (Lightning: trainer.strategy.model). Calling "
            "state_dict() on the inner model would initialise each wrapped layer as an FSDP root and "
            "break the real root's first forward"
        )
    prefix = _prefix_in(fsdp_root, model)
    if prefix is None or not _fsdp1_modules(fsdp_root) or fsdp_root is not _fsdp1_modules(fsdp_root)[0]:
        raise ValueError(
            f"fsdp_root must be the outermost FullyShardedDataParallel module containing policy.model, got "
            f"{type(fsdp_root).__name__}"
        )
    # FSDP1 under get_model_state_dict: FULL_STATE_DICT, offload_to_cpu = rank0_only = cpu_offload
    # (torch distributed/checkpoint/state_dict.py, _verify_options).
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    full = get_model_state_dict(fsdp_root, options=options)
    return {_clean_name(k)[len(prefix) :]: v for k, v in full.items() if _clean_name(k).startswith(prefix)}


@torch.no_grad()
def load_named_tensors(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy ``(name, tensor)`` pairs (e.g. from :meth:`Policy.full_state_dict`) into ``model`` in place.

    Covers parameters, persistent and non-persistent buffers (which ``load_state_dict`` skips).
    Raises ValueError on an unknown name or a shape mismatch; values are cast to the target's dtype.
    """
    targets = {_clean_name(n): p for n, p in model.named_parameters(remove_duplicate=False)}
    targets.update({_clean_name(n): b for n, b in model.named_buffers(remove_duplicate=False)})
    for name, value in named_tensors:
        if name not in targets:
            raise ValueError(f"named_tensors has {name!r}, which is not a parameter or buffer of the model")
        target = targets[name]
        if target.shape != value.shape:
            raise ValueError(
                f"{name}: shape {tuple(value.shape)} does not match the model's {tuple(target.shape)}"
            )
        target.copy_(value.to(device=target.device, dtype=target.dtype))


def shard_by_layers(policy: nn.Module, mesh: Any) -> None:
    """FSDP2: ``fully_shard`` every decoder layer of ``policy`` (``policy.decoder_layers()``), then ``policy`` itself,
    over ``mesh`` (Lightning ``ModelParallelStrategy``'s ``device_mesh["data_parallel"]``); nothing when ``policy`` is
    sharded already (Lightning calls ``configure_model`` once per ``fit`` / ``validate``)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(policy, FSDPModule):
        return
    for layer in policy.decoder_layers():
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)
