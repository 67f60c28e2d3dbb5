"""What a torchmetrics metric's call allocates, measured on a real copy of the metric on the CPU.

The dry run does not run the metrics of the fake copy (:mod:`~lightning_sac.dryrun.values.placeholders`): their
validation and their dynamic-shape ops cannot run on fake predictions. What such a call allocates is still part
of the step's memory, and not always small: ``MulticlassAccuracy(num_classes=C)`` counts its stat scores in a
``bincount`` of ``C**2`` bins (2 MiB at 512 classes), and under deterministic algorithms
(``Trainer(deterministic=True)``) torchmetrics' bincount compares every prediction with every bin instead: an
int64 ``(N, C**2)`` matrix of bins, the comparison's boolean one and the int64 copy of it that the sum's kernel
makes (136 MiB for 512 predictions of 128 classes).

So the call is measured. A copy of the metric with its states (the fake copy's, which are the user's metric's as
planning found them) runs the same method on real CPU tensors of the arguments' shapes, strides and dtypes, all
zeros (valid class indices and targets, predictions inside ``[0, 1]``), under torch.profiler's allocator events,
with the deterministic-algorithms setting of the step, since the deterministic path allocates differently. The
measurement is cached per metric type, public configuration and state shapes, method, argument layouts and that
setting. Two numbers come back: how far the call's allocations rose above what was live before it, and the bytes
the metric's states grew by (a ``cat`` state's copy of its input; a sum state replaced by another adds none). A state
that keeps an argument itself (a ``cat`` state appending the predictions) allocates nothing: the argument's
position comes back, so that the dry run keeps it alive to the end of the step as the metric does.

Limits:

* For a CUDA target planned from the CPU, the CPU's measurement is an estimate of the GPU's allocations, and
  torchmetrics' CUDA path can differ (without deterministic algorithms, bincount on CUDA is a native kernel with
  allocations of its own); the CUDA caching allocator's rounding is applied to the total, not per block.
* Zeros take the paths of valid inputs, but a path chosen by value is the zeros' path: binary predictions
  outside ``[0, 1]`` (logits) get a sigmoid, a copy of the predictions the measurement does not see.
* The copy synchronizes nothing across processes (``compute``'s gather of the ranks' states would wait for ranks
  that run no dry run), so what the gather allocates is not counted.
* Under a torch.profiler that is already recording (the user's own, around the fit), a second profiler would end
  the first one's session, so the call is measured from the storages its ops create instead: the kernels'
  internal scratch is missed (the sum's int64 copy above: 72 of the 136 MiB are seen).
* A call that fails on zeros (a metric whose inputs must be something else) is not measured: it counts nothing.
"""

from __future__ import annotations

import copy
import functools
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.profiler import ProfilerActivity
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_sac.dryrun.measured import QuietProfile, peak_from_events, window_memory_events

__all__ = ["MetricMemory", "metric_memory"]

_PLAIN = (int, float, bool, str, type(None))


@dataclass(frozen=True)
class MetricMemory:
    """What one call of a metric's method allocates on the CPU (see the module docstring).

    Attributes:
        peak_bytes: How far the call's allocations rose above what was live before it.
        kept_bytes: Bytes the metric's states grew by in the call, besides the arguments they keep.
        kept_args: Positions, in ``tree_flatten((args, kwargs))``, of the arguments whose storage the metric's
            states hold after the call.
    """

    peak_bytes: int
    kept_bytes: int
    kept_args: tuple[int, ...] = ()


_MEASURED: dict[Any, MetricMemory | None] = {}


def metric_memory(metric: nn.Module, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> MetricMemory | None:
    """What ``metric.<method>(*args, **kwargs)`` allocates, measured once per signature; ``None`` if it failed.

    Args:
        metric: A torchmetrics ``Metric`` with its own methods (not the dry run's stand-ins), whose states are
            real or fake tensors; neither it nor its states are changed.
        method: ``"update"``, ``"forward"`` or ``"compute"``.
        args: The call's positional arguments (fake, real or not tensors).
        kwargs: Its keyword arguments.
    """
    flat, spec = tree_flatten((args, kwargs))
    key = (
        _configuration(metric),
        method,
        tuple(_layout(x) for x in flat),
        str(spec),
        torch.are_deterministic_algorithms_enabled(),
    )
    if key not in _MEASURED:
        _MEASURED[key] = _measure(metric, method, flat, spec)
    return _MEASURED[key]


def _layout(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), tuple(x.stride()), int(x.storage_offset()), x.dtype
    return x if isinstance(x, _PLAIN) else type(x).__qualname__


def _state_layout(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    if isinstance(value, (list, tuple)):
        return tuple(_state_layout(v) for v in value)
    return type(value).__qualname__


def _states(module: nn.Module) -> list[Any]:
    """The current values of a metric's states (torchmetrics keeps their names as the keys of ``_defaults``)."""
    return [getattr(module, name) for name in getattr(module, "_defaults", {})]


def _configuration(metric: nn.Module) -> Any:
    """The metric and its child metrics: type, public settings (``num_classes``, ``average``) and state layouts."""
    return tuple(
        (
            type(m),
            tuple(sorted((k, v) for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, _PLAIN))),
            tuple(_state_layout(v) for v in _states(m)),
        )
        for m in metric.modules()
    )


def _zeros(x: torch.Tensor) -> torch.Tensor:
    """Zeros of ``x``'s layout on the CPU: valid class indices and targets, predictions inside ``[0, 1]``."""
    shape, stride, offset = tuple(x.shape), tuple(x.stride()), int(x.storage_offset())
    # The extent the strides reach, then a view of it: broadcast (stride 0) layouts cannot be made otherwise.
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) if x.numel() else 0
    return torch.zeros(extent + offset, dtype=x.dtype).as_strided(shape, stride, offset)


def _real(t: torch.Tensor) -> torch.Tensor:
    """A real CPU copy of a state or buffer: its values, or zeros where only a fake tensor has it."""
    real = _zeros(t) if isinstance(t, FakeTensor) or t.is_meta else t.detach().to("cpu", copy=True)
    return nn.Parameter(real, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else real


def _never() -> bool:
    return False


def _copy(metric: nn.Module) -> nn.Module:
    """A real CPU copy of ``metric`` with its states, and without the dry run's hooks."""
    memo: dict[int, Any] = {}
    for m in metric.modules():
        for name, value in vars(m).items():
            if name.endswith(("hooks", "hooks_with_kwargs", "hooks_always_called")) and isinstance(value, dict):
                memo[id(value)] = type(value)()  # the dry run's hooks belong to the fake copy
        for t in tree_flatten([*m._parameters.values(), *m._buffers.values(), *_states(m)])[0]:
            if isinstance(t, torch.Tensor):
                memo[id(t)] = _real(t)
    probe = copy.deepcopy(metric, memo)  # torchmetrics' __getstate__ leaves update and compute out, and rewraps them
    for m in probe.modules():
        if hasattr(m, "distributed_available_fn"):
            # Only this rank runs a dry run: a gather of the states across ranks would wait for the others.
            vars(m)["distributed_available_fn"] = _never
    return probe.to("cpu")


def _storages(probe: nn.Module) -> dict[int, int]:
    """The storages the states of ``probe`` and its child metrics hold: bytes by address."""
    tensors = tree_flatten([_states(m) for m in probe.modules()])[0]
    storages = [t.untyped_storage() for t in tensors if isinstance(t, torch.Tensor)]
    return {s.data_ptr(): s.nbytes() for s in storages if s.data_ptr()}


def _measure(metric: nn.Module, method: str, flat: list[Any], spec: Any) -> MetricMemory | None:
    # Outside the dry run's modes (the fake mode among them): a real call, of which no op is recorded.
    with _disable_current_modes(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # The step's own call warns where it should (compute before update); the copy's would repeat it.
        warnings.simplefilter("ignore")
        probe = _copy(metric)
        real = [_zeros(x) if isinstance(x, torch.Tensor) else x for x in flat]
        args, kwargs = tree_unflatten(real, spec)
        before = _storages(probe)
        try:
            peak = _peak(functools.partial(getattr(probe, method), *args, **kwargs))
        except Exception:  # not valid on zeros: the call is counted as allocating nothing
            return None
        after = _storages(probe)
        inputs = {x.untyped_storage().data_ptr(): i for i, x in enumerate(real) if isinstance(x, torch.Tensor)}
        kept_args = tuple(sorted({inputs[a] for a in after.keys() - before.keys() if a in inputs}))
        # What the states grew by, from their storages: the profiler's window counts no free of a block allocated
        # before it started (a sum state's old tensor, replaced), so its net would count the new one as kept.
        grown = sum(n for a, n in after.items() if a not in inputs) - sum(before.values())
    return MetricMemory(peak, max(0, grown), kept_args)


def _peak(call: Callable[[], Any]) -> int:
    """Run ``call``: how far its allocations rose above what was live before it, in bytes."""
    if torch._C._autograd._profiler_enabled():
        with _NewStorages() as storages:
            call()
        return storages.peak
    with QuietProfile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    # Only the frees of blocks the call allocated, as _NewStorages counts: c10 also reports the free of an older
    # block whose address a block allocated under an earlier profiler once had (its size stays in c10's table),
    # QuietProfile's own 4-byte primer among them, and counting it lowered the peak by that stale size.
    return peak_from_events(window_memory_events(prof, "cpu"), 0).peak_bytes


class _NewStorages(TorchDispatchMode):
    """The bytes of the storages the ops under it create, counted until each dies, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.peak = 0
        self._live: dict[int, int] = {}
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._live:  # a view or an in-place result allocates nothing
                continue
            self._live[key] = storage.nbytes()
            # id() is unique only while the storage lives: the callback drops the key before it can be reused.
            self._refs[key] = weakref.ref(storage, functools.partial(self._free, key))
            self.total += storage.nbytes()
            self.peak = max(self.peak, self.total)
        return out

    def _free(self, key: int, _ref: object) -> None:
        self.total -= self._live.pop(key, 0)
        self._refs.pop(key, None)
