"""Which modules of a sharded model are FSDP units, and what each one shards, read from the model itself.

FSDP2 (``fully_shard``) turns each sharded module into an ``FSDPModule`` whose parameters are ``DTensor`` shards;
FSDP1 (``FullyShardedDataParallel``, as Lightning's ``FSDPStrategy`` wraps) puts each unit's parameters into one
flat parameter. Either way, what the memory model needs per unit is here: its fqn in the unsharded model (FSDP1's
``_fsdp_wrapped_module`` segments removed), the bytes of its shard on one rank (padding included), of its
gathered parameters and of its gradients before reduce-scatter, whether it reshards after forward, and which
units it prefetches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "FSDPUnit",
    "ShardedLayout",
    "clean_fqn",
    "is_fsdp_hook",
    "is_sharded",
    "sharded_layout",
    "unsharded_structure",
]

_WRAPPED = "_fsdp_wrapped_module"


def is_fsdp_hook(hook: object) -> bool:
    """Whether a module hook is one of FSDP's (a bound method of FSDP's per-module state)."""
    owner = getattr(hook, "__self__", None)
    return owner is not None and type(owner).__module__.startswith("torch.distributed.fsdp")


def clean_fqn(fqn: str) -> str:
    """``fqn`` without FSDP1's (and the checkpoint wrapper's) wrapper segments: the unsharded model's name."""
    parts = [p for p in fqn.split(".") if p not in (_WRAPPED, "_checkpoint_wrapped_module")]
    return ".".join(parts)


def _fsdp2_module_cls() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule


def _fsdp1_cls() -> type | None:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return None
    return FullyShardedDataParallel


def is_sharded(model: nn.Module) -> str | None:
    """``"fsdp2"`` or ``"fsdp1"`` when some module of ``model`` is an FSDP unit of that kind, else ``None``."""
    fsdp2, fsdp1 = _fsdp2_module_cls(), _fsdp1_cls()
    for m in model.modules():
        if fsdp2 is not None and isinstance(m, fsdp2):
            return "fsdp2"
        if fsdp1 is not None and isinstance(m, fsdp1):
            return "fsdp1"
    return None


def unsharded_structure(model: nn.Module) -> list[tuple[str, str]]:
    """``(fqn, class name)`` of every module as the model was before sharding (what its profile names).

    FSDP1's wrappers are left out (the module each wraps takes its name), and FSDP2's ``FSDP<Class>`` classes
    are named by their own class.
    """
    fsdp2, fsdp1 = _fsdp2_module_cls(), _fsdp1_cls()
    out = []
    for name, m in model.named_modules():
        if fsdp1 is not None and isinstance(m, fsdp1):
            continue
        cls = type(m)
        if fsdp2 is not None and isinstance(m, fsdp2):
            cls = next(c for c in cls.__mro__[1:] if not issubclass(c, fsdp2))
        out.append((clean_fqn(name), cls.__name__))
    return out


@dataclass
class FSDPUnit:
    """One FSDP unit: a module whose parameters (those no nested unit manages) are gathered and freed together.

    Attributes:
        fqn: The unit's module in the unsharded model (``""`` for the root).
        shard_bytes: Bytes of its parameters' shard on one rank, in their own dtype, padding included.
        gathered_bytes: Bytes of its gathered parameters, in the compute dtype (``param_dtype`` under mixed
            precision), as FSDP allocates them for forward and backward.
        buffer_bytes: Bytes of the flat all-gather buffer FSDP fills before it copies out the parameters (FSDP2,
            which frees it right after); 0 for FSDP1, which gathers into the flat parameter itself.
        grad_bytes: Bytes of its unsharded gradients before reduce-scatter (in the reduce dtype).
        grad_shard_bytes: Bytes of its sharded gradients on one rank (the parameters' dtype).
        param_bytes: Bytes of its parameters unsharded in their own dtype (what the dry run holds for them).
        trainable: Whether any of its parameters requires grad.
        reshard_after_forward: Whether its parameters are freed after forward (and gathered again for backward).
        forward_prefetch: Units whose parameters it gathers when its forward begins.
        backward_prefetch: Units whose parameters it gathers when its backward begins; ``None``: the next unit
            in backward order (FSDP2's and FSDP1's ``BACKWARD_PRE`` default).
        scatter_bytes: Bytes of the reduce-scatter's input, a copy of its gradients that exists at the end of its
            backward; ``None``: ``grad_bytes``. 0 for a unit FSDP does not shard (FSDP1's ``NO_SHARD``, which it
            uses on one rank: its parameters are used in place and its gradients all-reduced in place).
        compute_grad_bytes: Bytes of its unsharded gradients as autograd makes them, in the compute dtype (FSDP2:
            each parameter's as its backward reaches it, as the dry run counts them); ``None``: ``grad_bytes``.
        post_forward_bytes: Bytes of its parameters it keeps from the end of its forward until its backward
            gathers them again when ``reshard_after_forward`` is an int smaller than its shard group (FSDP2's
            ``FSDPParam.to_sharded_post_forward``: the gathered parameters resharded over that many ranks, in the
            compute dtype); 0 otherwise.
        offload: Its parameter shards, gradient shards and their optimizer state live in host memory (FSDP2's
            ``CPUOffloadPolicy``, FSDP1's ``CPUOffload(offload_params=True)``): the device holds its parameters
            only while they are gathered, and its optimizer steps on the host.
    """

    fqn: str
    shard_bytes: int
    gathered_bytes: int
    buffer_bytes: int
    grad_bytes: int
    grad_shard_bytes: int
    param_bytes: int
    trainable: bool = True
    reshard_after_forward: bool = True
    forward_prefetch: list[str] = field(default_factory=list)
    backward_prefetch: list[str] | None = None
    scatter_bytes: int | None = None
    compute_grad_bytes: int | None = None
    post_forward_bytes: int = 0
    offload: bool = False


def inside_a_unit(fqn: str, units: Iterable[FSDPUnit]) -> bool:
    """Whether module ``fqn`` lies inside another of ``units``; a unit inside none is a root of its own forward."""
    return any(u.fqn != fqn and (u.fqn == "" or fqn.startswith(u.fqn + ".")) for u in units)


@dataclass
class ShardedLayout:
    """The FSDP units of a model and the world they are sharded over.

    Attributes:
        kind: ``"fsdp2"`` or ``"fsdp1"``.
        world_size: Ranks each unit is sharded over.
        units: The units, in module pre-order.
    """

    kind: str
    world_size: int
    units: list[FSDPUnit]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardedLayout:
        """Rebuild from :meth:`to_dict`."""
        return cls(d["kind"], d["world_size"], [FSDPUnit(**u) for u in d["units"]])


def _nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * dtype.itemsize


def _shard_bytes(param: Any) -> int:
    """Bytes of an FSDP2 parameter's shard on one rank, padded as FSDP allocates it."""
    return _nbytes(param.padded_sharded_param_size.numel(), param.sharded_param.dtype)


def _fsdp2_units(model: nn.Module, names: dict[int, str]) -> ShardedLayout:
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    units: list[FSDPUnit] = []
    world = 1
    by_state: dict[int, str] = {}
    prefetch: list[tuple[FSDPUnit, Any]] = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        by_state[id(state)] = clean_fqn(names[id(m)])
        for group in state._fsdp_param_groups:
            params = group.fsdp_params
            mesh: Any = group.mesh_info
            world = max(world, mesh.shard_mesh_size)
            mp = group.mp_policy
            shard = sum(_shard_bytes(p) for p in params)
            compute = [mp.param_dtype or p.sharded_param.dtype for p in params]
            gathered = sum(_nbytes(p._orig_size.numel(), d) for p, d in zip(params, compute, strict=True))
            # The all-gather's flat output; on one rank FSDP2 gathers nothing and copies the shards straight into
            # the unsharded parameters (FSDPParamGroup.unshard and wait_for_unshard for world size 1).
            padded = sum(
                _nbytes(p.padded_sharded_param_size.numel() * mesh.shard_mesh_size, d)
                for p, d in zip(params, compute, strict=True)
            )
            padded = padded if mesh.shard_mesh_size > 1 else 0
            trainable = [p for p in params if p.sharded_param.requires_grad]
            reduce = [
                mp.reduce_dtype or d for d, p in zip(compute, params, strict=True) if p.sharded_param.requires_grad
            ]
            # A root (a unit inside no other unit) keeps its parameters gathered from forward to backward when
            # resharding is left to FSDP.
            fqn = clean_fqn(names[id(m)])
            is_root = not inside_a_unit(fqn, units)
            reshard = group.post_forward_mesh_info is not None and not (is_root and state._auto_reshard_after_forward)
            # reshard_after_forward=N < the shard group: each rank keeps 1/N of the gathered parameters after forward.
            post_mesh = group.post_forward_mesh_info
            post = post_mesh.shard_mesh_size if reshard and post_mesh is not None else mesh.shard_mesh_size
            kept = padded // post if post < mesh.shard_mesh_size else 0  # the all-gather's output over N ranks
            unit = FSDPUnit(
                fqn=fqn,
                shard_bytes=shard,
                gathered_bytes=gathered,
                buffer_bytes=padded,
                grad_bytes=sum(_nbytes(p._orig_size.numel(), d) for p, d in zip(trainable, reduce, strict=True)),
                compute_grad_bytes=sum(
                    _nbytes(p._orig_size.numel(), d)
                    for p, d in zip(params, compute, strict=True)
                    if p.sharded_param.requires_grad
                ),
                grad_shard_bytes=sum(_shard_bytes(p) for p in trainable),
                param_bytes=sum(_nbytes(p._orig_size.numel(), p.sharded_param.dtype) for p in params),
                trainable=bool(trainable),
                reshard_after_forward=reshard,
                post_forward_bytes=kept,
                offload=isinstance(group.offload_policy, CPUOffloadPolicy),
            )
            units.append(unit)
            prefetch.append((unit, state))
    for unit, state in prefetch:
        unit.forward_prefetch = [by_state[id(s)] for s in state._states_to_forward_prefetch if id(s) in by_state]
        explicit = state._states_to_backward_prefetch
        if explicit:
            unit.backward_prefetch = [by_state[id(s)] for s in explicit if id(s) in by_state]
    return ShardedLayout("fsdp2", world, units)


def _fsdp1_units(model: nn.Module, names: dict[int, str]) -> ShardedLayout:
    from torch.distributed.fsdp import FullyShardedDataParallel

    units: list[FSDPUnit] = []
    world = 1
    for m in model.modules():
        if not isinstance(m, FullyShardedDataParallel) or m._handle is None:
            continue
        handle = m._handle
        flat = handle.flat_param
        sharded = handle.uses_sharded_strategy
        world = max(world, m.world_size)
        local = flat._sharded_size.numel() if sharded else flat._unpadded_unsharded_size.numel()
        unsharded = local * m.world_size if sharded else local  # the flat parameter padded to the world size
        orig = flat.dtype
        mp = m.mixed_precision
        compute = (mp.param_dtype or orig) if mp is not None else orig
        reduce = (mp.reduce_dtype or compute) if mp is not None else orig
        trainable = flat.requires_grad
        units.append(
            FSDPUnit(
                fqn=clean_fqn(names.get(id(m), "")),
                shard_bytes=_nbytes(local, orig),
                # Unsharded without mixed precision, FSDP computes on the flat parameter itself.
                gathered_bytes=_nbytes(unsharded, compute) if sharded or compute != orig else 0,
                buffer_bytes=0,
                grad_bytes=_nbytes(unsharded, reduce) if trainable else 0,
                grad_shard_bytes=_nbytes(local, orig) if trainable else 0,
                param_bytes=sum(_nbytes(s.numel(), orig) for s in flat._shapes),
                trainable=trainable,
                # The root (the outermost unit) keeps its flat parameter gathered from forward to backward.
                reshard_after_forward=bool(units) and handle._sharding_strategy.name == "FULL_SHARD",
                backward_prefetch=None if m.backward_prefetch is not None else [],
                scatter_bytes=None if sharded else 0,
                offload=m.cpu_offload.offload_params,
            )
        )
    return ShardedLayout("fsdp1", world, units)


def sharded_layout(model: nn.Module, wrapper: nn.Module | None = None) -> ShardedLayout | None:
    """The FSDP layout of ``model``, or ``None`` when it is not sharded.

    Args:
        model: The model as the training step runs it (a LightningModule whose submodules are sharded).
        wrapper: What wraps it, when FSDP1's root unit wraps the model itself (Lightning's ``trainer.strategy
            .model``); its units are named relative to ``model``.
    """
    outer = wrapper if wrapper is not None else model
    kind = is_sharded(outer)
    if kind is None:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    if wrapper is not None and wrapper is not model:
        names[id(wrapper)] = ""
    return _fsdp2_units(outer, names) if kind == "fsdp2" else _fsdp1_units(outer, names)
