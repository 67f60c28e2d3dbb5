"""The unsharded fake copy of a sharded model: what the dry run profiles under FSDP2 and FSDP1.

The dry run must see the model's own compute on parameters of their global shapes, without FSDP: its
collectives need the other ranks, and its gathers, frees and reduce-scatters are the sharded memory model's
business (:mod:`lightning_sac.solver.sharded_memory`), not the recorder's. So the copy is of the modules as they were
before sharding: FSDP2's ``FSDP<Class>`` modules become their own class again without FSDP's hooks and state,
FSDP1's wrappers are replaced by the modules they wrap, and every parameter (a ``DTensor`` shard, or a view into
FSDP1's flat parameter) becomes a fake tensor of its global shape and dtype. The user's model is never touched.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_sac.errors import ProfilingError
from lightning_sac.sharding.layout import is_fsdp_hook
from lightning_sac.sharding.tensor_parallel import (
    TensorParallelModule,
    add_collective_stand_ins,
    is_tp_hook,
    tensor_parallel_modules,
    tp_local_shape,
)

__all__ = ["unsharded_memo"]

_STATE_KEY_PREFIX = "__composable_api_state_key"
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _own_class(module: nn.Module) -> type:
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__[1:] if not issubclass(c, FSDPModule))


def _is_parallel_hook(hook: object) -> bool:
    return is_fsdp_hook(hook) or is_tp_hook(hook)


def _stripped(module: nn.Module) -> nn.Module:
    """A shallow stand-in for a module FSDP2 or a TP style changed: its own class, without their state and hooks."""
    from torch.distributed.fsdp import FSDPModule

    cls = _own_class(module) if isinstance(module, FSDPModule) else type(module)
    proxy: nn.Module = object.__new__(cls)
    state = {k: v for k, v in module.__dict__.items() if not k.startswith(_STATE_KEY_PREFIX)}
    dropped = {k for k, h in module._forward_pre_hooks.items() if _is_parallel_hook(h)}
    dropped |= {k for k, h in module._forward_hooks.items() if _is_parallel_hook(h)}
    for name in _HOOK_DICTS:
        hooks = state[name]
        if isinstance(hooks, OrderedDict):
            state[name] = OrderedDict((k, v) for k, v in hooks.items() if k not in dropped)
        else:  # a set of hook ids
            state[name] = type(hooks)(k for k in hooks if k not in dropped)
    for key in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
        state.pop(key, None)
    proxy.__dict__.update(state)
    return proxy


def _fsdp1_global_params(outer: nn.Module) -> dict[int, tuple[torch.Size, torch.dtype, bool]]:
    """Per FSDP1 original parameter (a view into its flat parameter), its global shape, dtype and requires_grad.

    The dtype is the one FSDP1 computes in: its mixed precision's ``param_dtype`` when set (FSDP1 gathers cast
    copies and the step computes on them, without autocast: Lightning's ``FSDPPrecision`` autocasts only CUDA).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    shapes: dict[int, tuple[torch.Size, torch.dtype, bool]] = {}
    for m in outer.modules():
        if not isinstance(m, FullyShardedDataParallel) or m._handle is None:
            continue
        flat = m._handle.flat_param
        if not m._handle._use_orig_params:
            raise ProfilingError(
                "AutoSAC profiles FSDP1 models with use_orig_params=True (Lightning's FSDPStrategy default); this "
                "model was wrapped with use_orig_params=False. Pass FSDPStrategy(use_orig_params=True)."
            )
        mp = m.mixed_precision
        dtype = (mp.param_dtype if mp is not None else None) or flat.dtype
        for info, shape in zip(flat._param_infos, flat._shapes, strict=True):
            shapes[id(getattr(info.module, info.param_name))] = (shape, dtype, flat.requires_grad)
        for shared in flat._shared_param_infos:
            param = getattr(shared.module, shared.param_name)
            prim = getattr(shared.prim_module, shared.prim_param_name)
            if id(prim) in shapes:
                shapes[id(param)] = shapes[id(prim)]
    return shapes


def unsharded_memo(
    model: nn.Module,
    outer: nn.Module | None,
    make_fake: Callable[[torch.Size, torch.dtype], torch.Tensor],
    memo: dict[int, Any],
) -> None:
    """Fill ``memo`` (a ``copy.deepcopy`` memo holding the parameters' fakes) so that copying ``model`` unshards it.

    Args:
        model: The model (whose submodules may be FSDP units).
        outer: An FSDP1 wrapper around ``model`` itself (Lightning's ``trainer.strategy.model``), if any.
        make_fake: Makes a (contiguous) fake tensor of a shape and dtype.
        memo: The memo; parameters of global shapes, and the copies of FSDP modules, are added.
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    scope = outer if outer is not None else model
    flat_shapes = _fsdp1_global_params(scope)
    compute = _fsdp2_compute(model)
    for p in model.parameters():
        if isinstance(p, DTensor):
            # FSDP2's unsharded parameter (TP-local under tensor parallelism), or a TP-only parameter's local shape
            shape, dtype = compute[id(p)] if id(p) in compute else (tp_local_shape(p), p.dtype)
            memo[id(p)] = nn.Parameter(make_fake(shape, dtype), requires_grad=p.requires_grad)
        elif id(p) in flat_shapes:
            shape, dtype, grad = flat_shapes[id(p)]
            memo[id(p)] = nn.Parameter(make_fake(shape, dtype), requires_grad=grad)
    # FSDP1's mixed precision keeps floating buffers in its buffer_dtype.
    buffer_dtype = _fsdp1_buffer_dtype(scope)
    if buffer_dtype is not None:
        for b in model.buffers():
            if b.is_floating_point():
                memo[id(b)] = make_fake(b.shape, buffer_dtype)
    # Children before parents: a parent's copy finds its sharded children already copied in the memo.
    tensor_parallel = {id(m): tp.style for tp, m in _tp_modules(model)}
    for m in reversed(list(model.modules())):
        if isinstance(m, FSDPModule):
            memo[id(m)] = copy.deepcopy(_stripped(m), memo)
            _cast_as_fsdp2(memo[id(m)], m._get_fsdp_state()._mp_policy)
        elif isinstance(m, FullyShardedDataParallel):
            memo[id(m)] = copy.deepcopy(m._fsdp_wrapped_module, memo)
        if id(m) in tensor_parallel:  # its TP hooks dropped above; its collectives' buffers stood in for
            if not isinstance(m, (FSDPModule, FullyShardedDataParallel)):
                memo[id(m)] = copy.deepcopy(_stripped(m), memo)
            add_collective_stand_ins(memo[id(m)], tensor_parallel[id(m)])


def _tp_modules(model: nn.Module) -> list[tuple[TensorParallelModule, nn.Module]]:
    modules = dict(model.named_modules())
    return [(tp, modules[tp.fqn]) for tp in tensor_parallel_modules(model)]


def _fsdp2_compute(model: nn.Module) -> dict[int, tuple[torch.Size, torch.dtype]]:
    """Per FSDP2 parameter (its sharded ``DTensor``), the shape and dtype its unit gathers and computes it in.

    The shape is the parameter's own, or under tensor parallelism its TP-local one (FSDP2 shards a TP ``DTensor``'s
    local tensor and gathers it back). ``MixedPrecisionPolicy(param_dtype=...)`` gathers the parameters cast
    (torchtitan's bf16 with fp32 shards): the step's matmuls, and what autograd saves for them, are in that dtype.
    """
    from torch.distributed.fsdp import FSDPModule

    out: dict[int, tuple[torch.Size, torch.dtype]] = {}
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        for group in m._get_fsdp_state()._fsdp_param_groups:
            for p in group.fsdp_params:
                dtype = group.mp_policy.param_dtype or p.sharded_param.dtype
                out[id(p.sharded_param)] = (p._orig_size, dtype)
    return out


def _cast_floating(dtype: torch.dtype) -> Callable[[Any], Any]:
    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x

    return cast


def _cast_as_fsdp2(copy_of_unit: nn.Module, mp: Any) -> None:
    """Cast the copy's inputs and output as its FSDP2 unit's mixed precision does (its hooks are not copied).

    With ``cast_forward_inputs`` (the default) each unit casts the floating-point tensors among its forward's
    arguments to ``param_dtype`` before running; with ``output_dtype`` it casts its output's.
    """
    from torch.utils._pytree import tree_map

    if mp.param_dtype is not None and mp.cast_forward_inputs:
        to_param = _cast_floating(mp.param_dtype)

        def cast_inputs(module: nn.Module, args: Any, kwargs: Any) -> Any:
            return tree_map(to_param, args), tree_map(to_param, kwargs)

        copy_of_unit.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    if mp.output_dtype is not None:
        to_output = _cast_floating(mp.output_dtype)
        copy_of_unit.register_forward_hook(lambda module, args, out: tree_map(to_output, out))


def _fsdp1_buffer_dtype(outer: nn.Module) -> torch.dtype | None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    for m in outer.modules():
        if isinstance(m, FullyShardedDataParallel):  # the root's policy casts the model's buffers
            mp = m.mixed_precision
            return None if mp is None else mp.buffer_dtype
    return None
