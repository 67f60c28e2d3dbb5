"""Stand-ins for what the dry run cannot know, recorded where they were used: scalar reads and metrics.

A training step reads scalars for its logs (``self.log("loss", loss.item())``, ``float(acc)``) and feeds
torchmetrics metrics (``self.acc(preds, y)``, ``self.acc.update(...)``). The loss and the predictions derive
from the weights, which the dry run has only as fake tensors, so their values do not exist there. Values that
derive only from the real batch are real and read exactly (:mod:`lightning_sac.dryrun.values.real_values`); for
the others:

* A scalar read of a fake value (``aten._local_scalar_dense``: ``.item()``, ``float(t)``, ``int(t)``,
  ``bool(t)``, ``if t:``, ``.tolist()``) returns a placeholder instead of aborting the dry run. Its value is
  chosen so that code reading a healthy step's numbers runs on: **1** (``1.0``, ``1``) for numbers, finite,
  non-zero, positive and exact in every dtype, so that logging arithmetic works (``1 / x``, ``math.log(x)``,
  ``int(x)``, ``f"{x:.3f}"``; ``0`` divides by zero, NaN and inf break ``int()`` and turn every comparison
  false or true); **False** for booleans, since a yes/no question about weight-derived values is almost always
  a check for trouble (``if torch.isnan(loss):``, ``if (probs < 0).any(): raise``), whose healthy answer is no.
* A torchmetrics ``Metric`` of the fake copy (``forward``, that is ``metric(...)``, ``update`` and
  ``compute``) does not run: its validation and its dynamic-shape ops (``unique``, ``bincount``) cannot run on
  fake predictions, and its states must not take fake values. ``update`` does nothing; ``forward`` and
  ``compute`` return a fake 0-d float tensor (reading it is a placeholder again). The user's metrics are never
  touched: the dry run works on a copy of the module, whose metric states are copies. What the call allocates
  is measured on a real copy of the metric (:mod:`~lightning_sac.dryrun.values.metric_memory`) and counted at
  the call: its peak as a transient, the states it grew and the arguments they keep until the step ends.

Why metric calls and not, in general, every dynamic-output-shape op on fake values outside autograd: such an op
(``nonzero`` of a router's mask, ``unique`` of selected experts) often decides which rows the gradient-carrying
computation runs on, and a made-up output size would silently profile another step. A metric is for reading:
torchmetrics runs it without autograd, so its value does not feed the loss's graph and skipping it changes no
activation; every other such op still stops the dry run with a :class:`~lightning_sac.errors.ProfilingError`
naming it.

A placeholder that decides what the step computes (``if (h > 0).any(): h = h * 2``, a length read from a
weight-derived tensor) would make the profile describe a step that training may not run. So a dry run that used
scalar placeholders is run again with other ones (:data:`OTHER`: ``2``, ``True``;
:func:`~lightning_sac.dryrun.values.stand_in_check.record_checked`): when
the second computes other ops or other sizes, the step depends on values the dry run does not have, and it stops
with a :class:`~lightning_sac.errors.ProfilingError` naming the place (a boolean read first: that is the
decision). A second run that raises (``if torch.isnan(loss): raise``, a step skipped on ``True``) stops where
training would, so there is no other step to plan for; a first run that raises while the second completes
(``if not torch.isfinite(loss): raise``) is the unhealthy answer, and the second is the profile.

Limit: two values per read can miss a decision at another threshold (``if loss.item() > 5``: 1 and 2 agree).
Every place a placeholder was used is listed (:attr:`~lightning_sac.dryrun.data.ModelProfile.placeholders`:
op, module, source line) and AutoSAC says so once.
"""

from __future__ import annotations

import linecache
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from lightning_sac.dryrun.values.metric_memory import metric_memory
from lightning_sac.errors import _machinery

__all__ = [
    "HEALTHY",
    "METRIC_METHODS",
    "OTHER",
    "UNMEASURED",
    "Placeholders",
    "placeholder_message",
    "placeholder_value",
]

#: The stand-ins of the dry run: read by a healthy step's logging code without trouble (module docstring).
HEALTHY = "healthy"
#: The stand-ins of the second run that checks the first took no decision on them: ``2`` and ``True``.
OTHER = "other"

#: The methods of a torchmetrics ``Metric`` the dry run replaces on the fake copy.
METRIC_METHODS: tuple[str, ...] = ("forward", "update", "compute")

_LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default
#: A metric call's site value when its allocations could not be measured (:mod:`metric_memory`), so not counted.
UNMEASURED = "its allocations not measured (the call fails on zeros of its inputs' shapes)"


def _torchmetrics() -> Any:
    """The torchmetrics module if something imported it, else ``None`` (a model with a metric has imported it).

    Not imported here: it imports transformers and scipy, seconds at every start of ``lightning-sac``.
    """
    return sys.modules.get("torchmetrics")


def _libraries() -> tuple[str, ...]:
    # The user's line is the one that called the metric, not torchmetrics' own code (a MetricCollection's loop).
    torchmetrics = _torchmetrics()
    return () if torchmetrics is None else (os.path.dirname(torchmetrics.__file__) + os.sep,)


def placeholder_value(dtype: torch.dtype, which: str = HEALTHY) -> bool | int | float | complex:
    """The stand-in for a scalar read of a fake tensor of ``dtype``: :data:`HEALTHY` or :data:`OTHER`."""
    other = which == OTHER
    if dtype == torch.bool:
        return other
    number = 2 if other else 1
    if dtype.is_complex:
        return complex(number)
    return float(number) if dtype.is_floating_point else number


@dataclass
class _Choice:
    """Which stand-ins the dry runs started in a :func:`_stand_ins` block use, and how many reads they answered."""

    which: str
    scalar_reads: int = 0
    sites: list[dict[str, Any]] = field(default_factory=list)  # the last run's, kept when it raises


_CHOICE: ContextVar[_Choice | None] = ContextVar("lightning_sac_stand_ins", default=None)


@contextmanager
def _stand_ins(which: str) -> Iterator[_Choice]:
    choice = _Choice(which)
    token = _CHOICE.set(choice)
    try:
        yield choice
    finally:
        _CHOICE.reset(token)


def _source_line() -> str:
    """``file:line in function: code`` of the innermost frame outside torch, lightning-sac, stdlib, torchmetrics.

    Walks the frames without reading their locals or the other frames' source (a ``.tolist()`` reads a scalar
    per element).
    """
    libraries = _libraries()
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (_machinery(filename) or filename.startswith(libraries)):
            code = linecache.getline(filename, frame.f_lineno).strip()
            return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}: {code}"
        frame = frame.f_back  # type: ignore[assignment]
    return "an unknown source line"


class Placeholders:
    """Gives the dry run its stand-ins and records where it used them. Enter it around the dry run.

    On entering, every torchmetrics metric of ``model`` (the fake copy) gets recording stand-ins for
    :data:`METRIC_METHODS`; on leaving, its own methods back. :class:`~lightning_sac.dryrun.values.real_values.
    RealValuesMode` calls :meth:`scalar` for a scalar read that fake tensors cannot answer.

    Args:
        model: The fake copy of the model the dry run steps.

    Attributes:
        allocated: Where a metric call's measured memory is counted (the recorder's
            :meth:`~lightning_sac.dryrun.recorder.StepRecorder.allocated_outside_ops`, set while it records):
            ``allocated(peak_bytes, kept_bytes)``. ``None``: not counted (the unrecorded warm-up).
        sites: One dict per place a stand-in was used, in the order first used: ``kind`` (``"scalar"`` or
            ``"metric"``), ``op`` (``"aten._local_scalar_dense.default"``, ``"MulticlassAccuracy.update"``),
            ``module`` (fqn of the module whose code made the read, or of the metric; ``""`` is the root),
            ``source`` (``file:line in function: code``) and ``value`` (the stand-in, as text). JSON-safe.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._choice = _CHOICE.get() or _Choice(HEALTHY)
        self.sites: list[dict[str, Any]] = []
        self._choice.sites = self.sites
        self._seen: set[tuple[str, str, str, str]] = set()
        self.allocated: Callable[[int, int], None] | None = None
        self._saved: list[tuple[nn.Module, str, Any, Any]] = []  # metric, method, its own, the stand-in
        self._kept: list[torch.Tensor] = []  # fake arguments a metric's states keep, as they keep the real ones
        # The modules whose forward is running, innermost last: a read's module. Hooks, not the Python stack:
        # reading a frame's locals would keep its tensors alive after the code drops them.
        self._running: list[str] = []
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> Placeholders:
        torchmetrics = _torchmetrics()
        for fqn, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._enter_module(fqn)))
            self._handles.append(module.register_forward_hook(self._leave_module, always_call=True))
            if torchmetrics is not None and isinstance(module, torchmetrics.Metric):
                for name in METRIC_METHODS:
                    # ``update`` and ``compute`` are already instance attributes (torchmetrics wraps them in
                    # ``__init__``); ``forward`` is the class's. Either way the copy's own dict is what changes.
                    own = module.__dict__.get(name)
                    self._saved.append((module, name, own, self._metric_stand_in(fqn, module, name)))
        self._swap(stand_ins=True)
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._swap(stand_ins=False)
        self._saved.clear()
        self._kept.clear()

    def _swap(self, stand_ins: bool) -> None:
        """Give every metric the dry run's stand-ins, or its own methods back."""
        for module, name, own, stand_in in reversed(self._saved):
            method = stand_in if stand_ins else own
            if method is None:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = method

    def scalar(self, func: Any, tensor: torch.Tensor) -> bool | int | float | complex:
        """Record a scalar read of the fake ``tensor`` by ``func`` and return its stand-in."""
        value = placeholder_value(tensor.dtype, self._choice.which)
        self._choice.scalar_reads += 1
        self._record("scalar", str(func), self._running[-1] if self._running else "", repr(value))
        return value

    def stand_in(self, op: str, value: str) -> bool:
        """Record a stand-in given to a host read by ``op`` (:mod:`~lightning_sac.dryrun.values.host_reads`).

        Returns:
            Whether this run gives the healthy stand-ins (else the check run's other ones).
        """
        self._choice.scalar_reads += 1
        self._record("array", op, self.where()[0], value)
        return self._choice.which == HEALTHY

    def where(self) -> tuple[str, str]:
        """The module running now (``""``: the root) and the model's source line calling into the dry run."""
        return (self._running[-1] if self._running else ""), _source_line()

    def handles(self, func: Any) -> bool:
        """Whether a data-dependent failure of ``func`` on fake tensors gets a stand-in (scalar reads only)."""
        return func is _LOCAL_SCALAR_DENSE

    def _enter_module(self, fqn: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._running.append(fqn)

        return hook

    def _leave_module(self, module: nn.Module, args: Any, output: Any) -> None:
        # Returns None (a forward hook's return value replaces the output); empty when a pre-hook before ours
        # raised, and the error on the way out is that one.
        if self._running:
            self._running.pop()

    def _record(self, kind: str, op: str, module: str, value: str) -> None:
        source = _source_line()
        key = (kind, op, module, source)
        if key not in self._seen:
            self._seen.add(key)
            self.sites.append({"kind": kind, "op": op, "module": module, "source": source, "value": value})

    def _metric_stand_in(self, fqn: str, metric: nn.Module, name: str) -> Any:
        op = f"{type(metric).__name__}.{name}"

        def stand_in(*args: Any, **kwargs: Any) -> torch.Tensor | None:
            measured = self._count_metric_call(metric, name, args, kwargs)
            if name == "update":
                self._record("metric", op, fqn, f"not run; {measured}")
                return None
            self._record("metric", op, fqn, f"a fake 0-d tensor; {measured}")
            return self._fake_scalar(args, kwargs)

        return stand_in

    def _count_metric_call(self, metric: nn.Module, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """Count what the call allocates, measured on a real copy of ``metric``; say what was counted."""
        # The copy is made with torchmetrics' own methods, for the metrics inside it too (a wrapper's).
        self._swap(stand_ins=False)
        try:
            measured = metric_memory(metric, name, args, kwargs)
        finally:
            self._swap(stand_ins=True)
        if measured is None:
            return UNMEASURED
        if self.allocated is not None:  # the recorded step (the warm-up before it is not counted)
            self.allocated(measured.peak_bytes, measured.kept_bytes)
            flat = tree_flatten((args, kwargs))[0]
            self._kept.extend(flat[i] for i in measured.kept_args)
        return f"allocates {measured.peak_bytes / 2**20:.2f} MiB at its peak (measured on a CPU copy)"

    def _fake_scalar(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """A 0-d float tensor of unknown value: made from a fake tensor, so that ops on it stay fake.

        A new tensor made from nothing would count as a real value (an op that reads no fake tensor runs for
        real), and reading it would give an exact-looking number nobody computed.
        """
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        source: torch.Tensor | None = next((t for t in tensors if isinstance(t, FakeTensor)), None)
        if source is None:
            source = next(self.model.parameters(), None)
        if source is None:  # no fake tensor in a model without weights: nothing of it is fake either
            return torch.zeros((), dtype=torch.get_default_dtype())
        return source.new_zeros((), dtype=torch.get_default_dtype())


def placeholder_message(sites: list[dict[str, Any]]) -> str:
    """What to tell the user about the stand-ins of a dry run (``sites`` as :attr:`Placeholders.sites`)."""
    lines = [f"  - {s['op']} in {s['module'] or '<root>'!r} at {s['source']} (stand-in: {s['value']})" for s in sites]
    text = (
        f"AutoSAC: the dry run of the training step used stand-ins at {len(sites)} place(s) for values it does not "
        "have (scalar reads of weight-derived values; arrays read on the host within host_read_stand_ins(); "
        "torchmetrics metrics, which it does not run):\n" + "\n".join(lines)
    )
    metrics = [s for s in sites if s["kind"] == "metric"]
    unmeasured = [s["op"] for s in metrics if UNMEASURED in s["value"]]
    if len(unmeasured) < len(metrics):
        text += (
            "\nWhat each metric call allocates (torchmetrics' bincount of num_classes**2 bins, or an (N, "
            "num_classes**2) matrix under Trainer(deterministic=True)) was measured on a copy of the metric on this "
            "machine's CPU, on zeros of its inputs' shapes, and is in the plan; for a GPU it is an estimate, as "
            "torchmetrics' CUDA path can differ."
        )
    if unmeasured:
        text += (
            f"\nWhat {', '.join(unmeasured)} allocate is NOT counted: the call fails on zeros of its inputs' shapes. "
            "Leave that headroom in the budget, or update such metrics outside training_step (on_train_batch_end)."
        )
    if any(s["kind"] in ("scalar", "array") for s in sites):
        text += (
            "\nA second dry run with other answers (2, True, arrays 0, 1, 2, ...) computed the same step, so these "
            "reads decided nothing there; a decision at another threshold (`if loss.item() > 5`) cannot be seen that "
            "way. If one of them decides what the step computes, the plan is for another step than the one training "
            "runs: make that decision from the batch, or check the plan with AutoSAC(measure=True)."
        )
    return text
