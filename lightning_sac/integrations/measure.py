"""A loop's planned step measured with torch.profiler's allocator events, for the integrations' ``measure=True``.

As AutoSAC measures a fit (:mod:`lightning_sac.lightning.fit_measure`): the profiler starts at the first
optimizer step, so every block the measured (second) step frees was allocated under it and its free is in the
record; the measured peak is the bytes alive when the measured step begins plus the highest net allocation inside
its window. A loop outside Lightning does not hand its batch to callbacks, so the batch's bytes are read from the
tensors the model's forward receives inside the window (the loop fetched them before the window began).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from lightning_sac.dryrun import MemoryTimeline, tensors_of, unique_bytes
from lightning_sac.lightning import started_step_profiler, step_state_tensors, window_timeline

__all__ = ["LoopMeasurement"]

_WINDOW = "lightning_sac_measured_step"


class LoopMeasurement:
    """Measures one optimizer step of a loop: :meth:`start` before the first, :meth:`begin`/:meth:`end` around one.

    Attributes:
        failed: Reading the profile failed; the measurement is not tried again.
    """

    def __init__(self) -> None:
        self._profiler: Any = None
        self._window: Any = None
        self._hook: Any = None
        self._state: list[torch.Tensor] = []
        self._batch: list[torch.Tensor] = []
        self.failed = False

    @property
    def running(self) -> bool:
        """Whether the profiler runs."""
        return self._profiler is not None

    @property
    def in_window(self) -> bool:
        """Whether the measured step's window is open."""
        return self._window is not None

    def start(self) -> None:
        """Start the profiler (before the step ahead of the measured one)."""
        self._profiler = started_step_profiler()

    def begin(self, model: nn.Module, optimizer: Any) -> None:
        """Open the measured step's window: what is alive now, and the batch its forward passes will receive."""
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper keeps the torch optimizer
        self._state = step_state_tensors(model, [] if inner is None else [inner])

        def seen(module: nn.Module, args: Any, kwargs: Any) -> None:
            self._batch += tensors_of((args, kwargs))

        self._hook = model.register_forward_pre_hook(seen, with_kwargs=True)
        self._window = record_function(_WINDOW)
        self._window.__enter__()

    def end(self, device: str) -> MemoryTimeline:
        """Close the window and read the measured step's memory; the profiler stops.

        Raises:
            Exception: Whatever reading the profile raised; the profiler is stopped first.
        """
        self._window.__exit__(None, None, None)
        self._window = None
        self._hook.remove()
        self._hook = None
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        baseline = unique_bytes([*self._state, *self._batch])
        self._state, self._batch = [], []
        return window_timeline(prof, device, baseline, _WINDOW)

    def abandon(self, failed: bool = False) -> None:
        """Stop profiling without a result (training ended, or the measurement failed: then it is not retried)."""
        self.failed = self.failed or failed
        if self._window is not None:
            self._window.__exit__(None, None, None)
            self._window = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None
