"""Values that come only from the example batch stay real during the dry run; only what touches weights is fake.

A training step takes data-dependent decisions on its inputs: Hugging Face turns an all-ones attention mask
into ``None`` and ``is_causal`` (``mask.all()``), a loss counts its labels (``(labels != -100).sum().item()``),
code selects rows with a boolean mask. On fake tensors these either raise or, worse, take another code path
than the real step, so the profile would list other ops than the ones that will run. So the dry run keeps the
example batch real (a copy) and runs an op for real whenever every tensor it reads is real: ids, masks,
labels, positions and whatever derives from them only are the real values of the real step, and
``.item()``, ``.all()``, ``nonzero`` on them answer as they will in training. An op that reads a fake tensor
(anything derived from a parameter) runs on fake tensors, as before. Real values cost real memory and time
on this machine, so an op whose output would exceed :data:`REAL_LIMIT_BYTES` stays fake, and random ops stay
fake (the user's random stream must not move).

But one: a uniform draw of a few values (``torch.rand([])``, at most :data:`STAND_IN_NUMEL`) gets real values,
the top of its range, drawn from no generator. A step that draws a scalar to take a rare branch (LayerDrop in
Wav2Vec2, HuBERT, M2M100: ``if torch.rand([]) < layerdrop: skip the layer``) is then profiled on its usual path,
every layer run, which is also the one that holds the most; a step that takes the rare branch runs fewer ops and
holds less. On a fake draw that decision could not be taken, and the dry run stopped.

A real tensor that an op with fake inputs writes to no longer holds known values; it is treated as fake from
then on (a data-dependent decision on it raises, as on any fake tensor).

A scalar read of a fake value (``loss.item()`` for a log) cannot be answered; given
:class:`~lightning_sac.dryrun.values.placeholders.Placeholders`, it gets a recorded stand-in instead of raising.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_sac.dryrun.values.kernel_layouts import layout_error, real_layout
from lightning_sac.dryrun.values.meta_fallback import fake_kernel_fallback, meta_kernel_failed
from lightning_sac.dryrun.values.placeholders import Placeholders
from lightning_sac.dryrun.values.value_shapes import run_on_batch_values
from lightning_sac.ops import flat_tensors, is_random, mutated_tensors

__all__ = ["DATA_DEPENDENT", "REAL_LIMIT_BYTES", "STAND_IN_NUMEL", "RealValuesMode", "dry_run_inputs"]

#: Largest output, bytes, that an op on real values produces for real; larger ones are fake (their values are
#: then unknown: a data-dependent decision on them raises a ProfilingError naming the op).
REAL_LIMIT_BYTES = 64 * 2**20

#: Most values a uniform draw with real arguments may have to get real ones (the top of its range).
STAND_IN_NUMEL = 64

#: What fake tensors raise for an op whose output depends on values they do not have.
DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)
_DYNAMIC_SHAPE = (DynamicOutputShapeException,)

aten = torch.ops.aten
# Uniform draws: the positions of their range's bounds in the schema, if any ([0, 1) otherwise).
_UNIFORM = {aten.rand.default: None, aten.rand_like.default: None, aten.uniform_.default: (1, 2)}
# Ops whose output shape depends on the values of their boolean index tensors only: with those real, the op runs
# on fake data with the indices the mask selects (exactly how ATen expands a boolean index).
_BOOLEAN_INDEXED = {aten.index.Tensor: 1, aten.index_put.default: 1, aten.index_put_.default: 1}
# How FakeTensorMode answers a fake tensor's device query (torch's own handler), if this torch has it.
_FAKE_DEVICE = getattr(fake_tensor, "_DISPATCH_META_HANDLERS", {}).get(torch.ops.prim.device.default)


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in flat_tensors(x))


def dry_run_inputs(x: Any, mode: FakeTensorMode, device: str, limit_bytes: int = REAL_LIMIT_BYTES) -> Any:
    """The step's inputs for the dry run: real copies of real tensors, fake tensors for meta or large ones.

    Copies, so that an in-place op of the step (``labels[labels == pad] = -100``) never writes to the user's
    batch. Nested tuples, lists and dicts (Hugging Face's ``BatchEncoding`` too) keep their structure.
    """
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            raise layout_error("An input of the training step", x.layout)
        if x.device.type == "meta" or isinstance(x, FakeTensor) or _nbytes(x) > limit_bytes:
            with mode:
                fake = torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device=device)
            return fake.requires_grad_(x.requires_grad) if x.is_floating_point() else fake
        real = x.detach().to(device, copy=True)
        return real.requires_grad_(x.requires_grad) if x.is_floating_point() else real
    if isinstance(x, Mapping):
        # A shallow copy keeps the mapping's type (OrderedDict, Hugging Face's BatchEncoding) and its methods.
        new = copy.copy(x) if isinstance(x, MutableMapping) else dict(x)
        for k, v in x.items():
            new[k] = dry_run_inputs(v, mode, device, limit_bytes)
        return new
    if isinstance(x, (tuple, list)):
        values = [dry_run_inputs(v, mode, device, limit_bytes) for v in x]
        return type(x)(*values) if hasattr(x, "_fields") else type(x)(values)
    return x


def _drop_tracebacks(err: BaseException | None) -> None:
    """Free the frames of a handled exception (and of those it was raised from) now.

    Their locals hold the fake tensors of the failed op, and a reference cycle through a frame (an ``except ... as
    e`` that keeps ``e``) would keep them alive until the garbage collector runs: the recorder, which sees a
    storage freed when its last reference goes, would count them as alive until the end of the step.
    """
    while err is not None:
        err.__traceback__ = None
        err = err.__cause__ or err.__context__


class RealValuesMode(TorchDispatchMode):
    """Runs each op for real when every tensor it reads is real, on fake tensors otherwise (module docstring).

    Enter it inside the dry run's ``FakeTensorMode`` (so that a call from here reaches the fake mode).

    Args:
        limit_bytes: Largest output produced for real.
        placeholders: Gives a scalar read of a fake value a recorded stand-in; without it, such a read raises.

    Attributes:
        enabled: Whether ops may run for real (all run on fake tensors otherwise).
    """

    def __init__(self, limit_bytes: int = REAL_LIMIT_BYTES, placeholders: Placeholders | None = None) -> None:
        super().__init__()
        self.limit_bytes = limit_bytes
        self.placeholders = placeholders
        # Off for the optimizer's step: it takes no decision on the batch, and real step counters mixed into
        # its fake updates would be converted to fake tensors anew at every op.
        self.enabled = True
        # Storages of real tensors that ops with fake inputs wrote to: their values are unknown now.
        self._unknown: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        # What ops computed for real, while ``keep_made``: those alive after the step were kept by the model's
        # code (a cache) and are not computed again by the next step (:attr:`kept`).
        self.keep_made = False
        self._made: list[weakref.ref[torch.Tensor]] = []

    def is_real(self, t: torch.Tensor) -> bool:
        """Whether ``t`` holds the real step's values."""
        if isinstance(t, FakeTensor) or t.device.type == "meta":
            return False
        storage = t.untyped_storage()
        ref = self._unknown.get(id(storage))
        return ref is None or ref() is not storage

    def kept(self) -> int:
        """How many tensors computed for real while :attr:`keep_made` are still alive."""
        return sum(ref() is not None for ref in self._made)

    def _forget(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        self._unknown[key] = weakref.ref(storage, functools.partial(self._drop, key))

    def _drop(self, key: int, _ref: object) -> None:
        self._unknown.pop(key, None)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Run ``func`` for real or on fake tensors, as the module docstring says."""
        kwargs = kwargs or {}
        if _FAKE_DEVICE is not None and func is torch.ops.prim.device.default and isinstance(args[0], FakeTensor):
            # Most ops ask their arguments' device (36,000 queries in an 80-layer Llama's step): the fake mode
            # below answers from the tensor alone, so it is asked directly, without a dispatch through it.
            return _FAKE_DEVICE(args)
        if not self.enabled:
            return self._fake(func, args, kwargs)
        tensors = flat_tensors(args) + flat_tensors(list(kwargs.values()))
        real = [not isinstance(t, FakeTensor) and self.is_real(t) for t in tensors]
        if func in _UNIFORM and all(real) and (drawn := self._top_of_range(func, args, kwargs)) is not None:
            return drawn
        if not all(real) or is_random(func, args, kwargs):
            if any(real):  # a real tensor this op writes no longer holds known values
                for t in mutated_tensors(func, args, kwargs):
                    if not isinstance(t, FakeTensor):
                        self._forget(t)
            return self._fake(func, args, kwargs)
        if mutated_tensors(func, args, kwargs):
            # In place on real tensors: its output aliases its input, so its size is known; run it for real.
            return self._real(func, args, kwargs)
        try:
            out = func(*args, **kwargs)  # on fake tensors first: the output's size, without computing it
        except Exception as err:
            # A size the values decide, or a fake kernel stricter than the real one (meta_fallback.py): run it.
            if not isinstance(err, DATA_DEPENDENT) and not meta_kernel_failed(func, err):
                raise
            _drop_tracebacks(err)
            return self._real(func, args, kwargs)
        return out if _nbytes(out) > self.limit_bytes else self._real(func, args, kwargs)

    def _fake(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``func`` on fake tensors; a boolean index or a scalar read it cannot answer is handled here.

        An op whose fake kernel lays its output out otherwise than the real one gets the real layout
        (:mod:`~lightning_sac.dryrun.values.kernel_layouts`).
        """
        try:
            return real_layout(func, args, func(*args, **kwargs))
        except _DYNAMIC_SHAPE as err:
            if func in _BOOLEAN_INDEXED:
                return self._boolean_indexed(func, args, kwargs, err)
            # A size decided by the batch's values alone (CTC's target lengths): from them (value_shapes.py).
            out = run_on_batch_values(func, args, kwargs, self.is_real, self.limit_bytes)
            if out is None:
                raise
            _drop_tracebacks(err)
            return out
        except DataDependentOutputException as err:
            if self.placeholders is None or not self.placeholders.handles(func):
                raise
            _drop_tracebacks(err)
            return self.placeholders.scalar(func, args[0])
        except Exception as err:
            # A fake kernel stricter than the real one (_grouped_mm's meta takes bfloat16 only): meta_fallback.py.
            if not meta_kernel_failed(func, err):
                raise
            _drop_tracebacks(err)
            return fake_kernel_fallback(func, args, kwargs, err)

    def _top_of_range(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
        """A few uniform values, real: the largest float below the range's top; ``None`` for a larger draw."""
        bounds = _UNIFORM[func]
        low, high = 0.0, 1.0
        if bounds is not None:
            low = float(args[bounds[0]]) if len(args) > bounds[0] else float(kwargs.get("from", 0.0))
            high = float(args[bounds[1]]) if len(args) > bounds[1] else float(kwargs.get("to", 1.0))
        target = args[0] if func._schema.is_mutable else self._fake(func, args, kwargs)
        if target.numel() > STAND_IN_NUMEL or not target.is_floating_point():
            return None
        with unset_fake_temporarily():
            top = torch.tensor(high, dtype=target.dtype)
            top = torch.nextafter(top, torch.tensor(low, dtype=target.dtype)) if high > low else top
            if func._schema.is_mutable:
                return target.fill_(top)
            return torch.full(tuple(target.shape), top.item(), dtype=target.dtype, device=target.device)

    def _real(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with unset_fake_temporarily():
            out = func(*args, **kwargs)
        if self.keep_made and not func._schema.is_mutable:
            self._made.extend(weakref.ref(t) for t in flat_tensors(out) if not isinstance(t, FakeTensor))
        return out

    def _boolean_indexed(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], err: BaseException) -> Any:
        """``x[mask]`` and ``x[mask] = v`` on fake ``x`` with a real boolean ``mask``: index with its positions."""
        position = _BOOLEAN_INDEXED.get(func)
        if position is None or len(args) <= position:
            raise err
        indices = args[position]
        expanded: list[Any] = []
        for index in indices:
            if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
                if not self.is_real(index):
                    raise err
                with unset_fake_temporarily():
                    expanded.extend(index.nonzero().unbind(1))
            else:
                expanded.append(index)
        return func(*args[:position], expanded, *args[position + 1 :], **kwargs)
