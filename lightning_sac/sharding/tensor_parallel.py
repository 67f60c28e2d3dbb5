"""Tensor parallelism (``parallelize_module``): which modules a model splits, and each parameter's shape on one rank.

``parallelize_module`` turns a module's parameters into ``DTensor`` shards over the tensor-parallel mesh and
registers the style's forward hooks on it (``distribute_module``): a pre-hook that wraps the inputs as ``DTensor``
and an output hook that redistributes the output (a row-parallel linear's partial sums are all-reduced there) and
hands back local tensors. Between the hooks a module computes on the rank's own shard. The dry run profiles exactly
that: a plain copy whose parameters have their per-rank shapes and whose TP hooks are dropped
(:mod:`lightning_sac.sharding.unsharded`), so every matmul, activation and saved tensor has the rank's local
shape. The planned module counts the hooks' ops (views to and from ``DTensor``, the collectives) as not its own
compute, as it does FSDP's (:mod:`lightning_sac.apply.fsdp_hooks`).

What the copy reproduces is checked here, before anything runs: column-parallel linears taking the whole input and
handing back their output sharded on the last dim, and row-parallel linears taking that and handing back the
all-reduced output, both as local tensors (``ColwiseParallel()`` and ``RowwiseParallel()`` with their default
layouts, as torchtitan's plan puts them inside each layer). Sequence parallelism, input/output preparation and
vocabulary-parallel embeddings change what a rank holds between the layers (a T-th of the sequence, gathered
copies), which the copy does not model yet: a model that uses them is refused with what to change.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
from torch import nn

from lightning_sac.errors import ProfilingError
from lightning_sac.sharding.brackets import enter_parallel_hook, exit_parallel_hook

__all__ = [
    "DECLARED_STYLES",
    "TensorParallelModule",
    "add_collective_stand_ins",
    "check_tensor_parallel",
    "declared_tensor_parallel",
    "is_tp_hook",
    "tensor_parallel_modules",
    "tp_local_shape",
]

_TP_CODE = "torch/distributed/tensor/"
#: The styles :func:`declared_tensor_parallel` (the command line's ``--tp``) splits a linear by.
DECLARED_STYLES = ("colwise", "rowwise")
_SUPPORTED = ("ColwiseParallel", "RowwiseParallel")


def is_tp_hook(hook: object) -> bool:
    """Whether a module hook is one a tensor-parallel style registered (``distribute_module``'s hooks)."""
    fn = getattr(hook, "__func__", hook)
    code = getattr(fn, "__code__", None)
    return code is not None and _TP_CODE in code.co_filename.replace("\\", "/")


@dataclass(frozen=True)
class TensorParallelModule:
    """One module a tensor-parallel style was applied to.

    Attributes:
        fqn: The module's name in the model.
        style: The style's class name (``ColwiseParallel``, ``RowwiseParallel``, ...).
        layouts: The style's input and output layouts as ``repr`` strings, in the order its hooks hold them.
    """

    fqn: str
    style: str
    layouts: tuple[str, ...]


def _style_of(hook: object) -> tuple[str, tuple[str, ...]] | None:
    """The style class name and layouts a TP hook applies: its closure holds the style's bound partial."""
    for cell in getattr(hook, "__closure__", None) or ():
        fn = cell.cell_contents
        if isinstance(fn, functools.partial):
            owner = getattr(fn.func, "__qualname__", "").split(".")[0]
            return owner, tuple(repr(a) for a in fn.args)
    return None


def tensor_parallel_modules(model: nn.Module) -> list[TensorParallelModule]:
    """Every module of ``model`` a tensor-parallel style was applied to, in module order (empty: no TP)."""
    out: list[TensorParallelModule] = []
    for fqn, module in model.named_modules():
        styles = [
            _style_of(h)
            for table in (module._forward_pre_hooks, module._forward_hooks)
            for h in table.values()
            if is_tp_hook(h)
        ]
        found = [s for s in styles if s is not None]
        if found:
            out.append(TensorParallelModule(fqn, found[0][0], tuple(x for _, layouts in found for x in layouts)))
    return out


# The default layouts of the two styles the copy reproduces (input, desired input, output, use_local_output).
_DEFAULTS = {
    "ColwiseParallel": ("(Replicate(),)", "(Replicate(),)", "(Shard(dim=-1),)", "True"),
    "RowwiseParallel": ("(Shard(dim=-1),)", "(Shard(dim=-1),)", "(Replicate(),)", "True"),
}


def check_tensor_parallel(model: nn.Module) -> list[TensorParallelModule]:
    """The model's TP modules, when the dry run reproduces each rank's compute for all of them.

    Raises:
        ProfilingError: A TP style the per-rank copy does not reproduce, naming the module and what to change.
    """
    modules = dict(model.named_modules())
    found = tensor_parallel_modules(model)
    for tp in found:
        module = modules[tp.fqn]
        if tp.style not in _SUPPORTED or not isinstance(module, nn.Linear) or tp.layouts != _DEFAULTS[tp.style]:
            raise ProfilingError(
                f"AutoSAC plans tensor parallelism of linear layers with ColwiseParallel() and RowwiseParallel() at "
                f"their default layouts (the whole input in, the all-reduced output out, local tensors between); "
                f"module {tp.fqn!r} ({type(module).__name__}) has {tp.style} with layouts {', '.join(tp.layouts)}. "
                "Sequence parallelism, PrepareModuleInput/Output and vocabulary-parallel embeddings are not modelled "
                "yet: parallelize only the linears inside each layer (as torchtitan's per-layer plan without "
                "SequenceParallel does), or remove AutoSAC."
            )
    return found


def tp_local_shape(param: torch.Tensor) -> torch.Size:
    """The shape of a ``DTensor`` parameter of a TP-only model on one rank (even shards only).

    Raises:
        ProfilingError: A shard of another shape on some rank: the ranks' plans would differ.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.shape
    shape = list(param.shape)
    for dim, placement in enumerate(param.placements):
        if placement.is_shard():
            axis = placement.dim % len(shape)  # type: ignore[attr-defined]
            n = param.device_mesh.size(dim)
            if shape[axis] % n:
                raise ProfilingError(
                    f"A tensor-parallel parameter of shape {tuple(param.shape)} is split unevenly over {n} ranks "
                    f"(dim {axis}); AutoSAC plans every rank alike and needs even shards: pick sizes divisible by "
                    "the tensor-parallel size."
                )
            shape[axis] //= n
    return torch.Size(shape)


class _ReducedInBackward(torch.autograd.Function):
    """``DTensor.from_local`` of a column-parallel linear's whole input, as memory sees it.

    Forward: a view. Backward: the input's gradient is a partial sum on each rank, which the style all-reduces into
    a new buffer of the input's shape (``funcol.all_reduce`` clones, then reduces in place); the partial one is
    freed when the all-reduced one is handed on.
    """

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.clone(memory_format=torch.contiguous_format)


def _reduce_grad_in_backward(module: nn.Module, args: tuple[object, ...]) -> tuple[object, ...]:
    x, *rest = args
    return (_ReducedInBackward.apply(x), *rest) if isinstance(x, torch.Tensor) else args


def _all_reduce_output(module: nn.Module, args: object, out: object) -> object:
    # A row-parallel linear's output is a partial sum, all-reduced into a new buffer (funcol.all_reduce clones);
    # its backward hands the whole gradient back as it is (DTensor keeps a partial's gradient replicated).
    return out.clone(memory_format=torch.contiguous_format) if isinstance(out, torch.Tensor) else out


def add_collective_stand_ins(copy_of_module: nn.Module, style: str) -> None:
    """Give a copied TP linear (its TP hooks dropped) the buffers its style's collectives allocate on one rank.

    The stand-ins run between :func:`~lightning_sac.sharding.enter_parallel_hook` and its exit, as the real hooks
    do at apply time, so the dry run records their memory but numbers none of their ops as the module's.
    """
    copy_of_module.register_forward_pre_hook(enter_parallel_hook)
    if style == "ColwiseParallel":
        copy_of_module.register_forward_pre_hook(_reduce_grad_in_backward)
    copy_of_module.register_forward_pre_hook(exit_parallel_hook)
    if style == "RowwiseParallel":
        copy_of_module.register_forward_hook(enter_parallel_hook)
        copy_of_module.register_forward_hook(_all_reduce_output)
        copy_of_module.register_forward_hook(exit_parallel_hook)


def declared_tensor_parallel(model: nn.Module, styles: dict[str, str], size: int) -> nn.Module:
    """The model as one of ``size`` tensor-parallel ranks computes it, for a model that is not parallelized.

    What ``parallelize_module`` with ``ColwiseParallel()``/``RowwiseParallel()`` would make of each named linear, as
    :func:`~lightning_sac.sharding.unsharded_memo` copies a parallelized one: a column-parallel linear's weight and
    bias keep ``1/size`` of their output rows, a row-parallel one's weight ``1/size`` of its input columns (its
    bias whole), and the styles' collectives' buffers are stood in for. The other parameters and the buffers are
    the model's own (shared, not copied); the model itself is not changed.

    Args:
        model: The model.
        styles: ``{module fqn: "colwise" or "rowwise"}``; each module an ``nn.Linear``.
        size: The tensor-parallel size.

    Raises:
        ValueError: A named module that is not a linear, a style not known, or a size that does not divide a
            split dimension.
    """
    modules = dict(model.named_modules())
    memo: dict[int, object] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    for fqn, style in styles.items():
        linear = modules.get(fqn)
        if not isinstance(linear, nn.Linear) or style not in DECLARED_STYLES:
            raise ValueError(
                f"tensor parallelism of {fqn!r} as {style!r}: only linear layers (nn.Linear) split 'colwise' or "
                f"'rowwise' are modelled, {fqn!r} is {type(linear).__name__ if linear is not None else 'no module'}"
            )
        dim = 0 if style == "colwise" else 1
        for name, param in linear.named_parameters(recurse=False):
            if name == "bias" and style == "rowwise":
                continue  # a row-parallel linear's bias is replicated
            shape = list(param.shape)
            axis = dim if param.dim() > 1 else 0
            if shape[axis] % size:
                raise ValueError(
                    f"{fqn}.{name} of shape {tuple(param.shape)} does not split evenly over {size} tensor-parallel "
                    f"ranks (dim {axis}); pick a tensor-parallel size that divides it"
                )
            shape[axis] //= size
            local = torch.empty(shape, dtype=param.dtype, device=param.device)
            memo[id(param)] = nn.Parameter(local, requires_grad=param.requires_grad)
    copied = copy.deepcopy(model, memo)
    kept = dict(copied.named_modules())
    for fqn, style in styles.items():
        add_collective_stand_ins(kept[fqn], "ColwiseParallel" if style == "colwise" else "RowwiseParallel")
    return copied
