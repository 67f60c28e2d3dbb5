"""Exceptions raised by lightning-sac, each saying what was expected, what was got and how to fix it."""

from __future__ import annotations

import os
import sysconfig
import traceback

import torch

__all__ = ["BudgetError", "LightningSACError", "ProfilingError", "user_source_line"]

# Frames in these folders are machinery, not the code a user can change (installed packages live under the
# standard library's folder too, so site-packages is told apart).
_MACHINERY = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def _machinery(filename: str) -> bool:
    if filename.startswith(_MACHINERY) or filename.startswith("<"):
        return True
    return filename.startswith(_STDLIB) and "-packages" + os.sep not in filename


def user_source_line() -> str:
    """Where the model's code (or a library's modeling code) made the current call: ``file:line in function: code``.

    The innermost frame of the current stack outside torch, lightning-sac and Python's standard library.
    """
    for frame in reversed(traceback.extract_stack()):
        if _machinery(frame.filename):
            continue
        return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return "an unknown source line"


class LightningSACError(RuntimeError):
    """Base class of every error lightning-sac raises on purpose."""


class ProfilingError(LightningSACError):
    """The fake-tensor dry run of a training step could not run.

    Attributes:
        op: Name of the aten operator that failed, e.g. ``"aten.nonzero.default"``, or ``None`` when the failure
            was not in an operator.
        module: Fully qualified name of the innermost module running when it failed (``""`` is the root).
        source: ``file:line in function: code`` of the model's code that called the op, when known.
    """

    def __init__(
        self, message: str, *, op: str | None = None, module: str | None = None, source: str | None = None
    ) -> None:
        super().__init__(message)
        self.op = op
        self.module = module
        self.source = source


class BudgetError(LightningSACError):
    """The memory budget is below the lowest peak any checkpointing plan reaches.

    Attributes:
        minimum_bytes: The minimum achievable peak on one device, bytes: the least budget a plan fits in (for a
            CUDA target the tensors' peak plus what the device holds besides, :mod:`lightning_sac.plan.reserve`).
        unconstrained_bytes: The peak without checkpointing, bytes, counted the same way.
    """

    def __init__(self, message: str, *, minimum_bytes: int, unconstrained_bytes: int) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
        self.unconstrained_bytes = unconstrained_bytes
