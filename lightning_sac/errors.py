"""Exceptions raised by lightning-sac, each saying what was expected, what was got and how to fix it."""

from __future__ import annotations

__all__ = ["BudgetError", "LightningSACError", "ProfilingError"]


class LightningSACError(RuntimeError):
    """Base class of every error lightning-sac raises on purpose."""


class ProfilingError(LightningSACError):
    """The fake-tensor dry run of a training step could not run.

    Attributes:
        op: Name of the aten operator that failed, e.g. ``"aten.nonzero.default"``, or ``None`` when the failure
            was not in an operator.
        module: Fully qualified name of the innermost module running when it failed (``""`` is the root).
    """

    def __init__(self, message: str, *, op: str | None = None, module: str | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.module = module


class BudgetError(LightningSACError):
    """The memory budget is below the lowest peak any checkpointing plan reaches.

    Attributes:
        minimum_bytes: The minimum achievable peak on one device, bytes.
        unconstrained_bytes: The peak without checkpointing, bytes.
    """

    def __init__(self, message: str, *, minimum_bytes: int, unconstrained_bytes: int) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
        self.unconstrained_bytes = unconstrained_bytes
