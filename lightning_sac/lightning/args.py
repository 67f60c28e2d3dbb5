"""AutoSAC's arguments, checked when the callback is built: a wrong one fails there, not minutes into ``fit``.

Each error names the argument, what it got and the forms it accepts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from torch import nn

from lightning_sac.devices import DeviceSpec, get_device_spec
from lightning_sac.plan import BACKENDS

_SUPPORTED = (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy, FSDPStrategy)

__all__ = ["check_autosac_args", "check_strategy"]

_ESTIMATES = ("roofline", "benchmark")


def _number(name: str, value: object, accepted: str) -> float:
    # bool is an int subclass: True would silently mean 1.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"AutoSAC: {name} must be {accepted}, got {value!r} ({type(value).__name__}).")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"AutoSAC: {name} must be {accepted}, got {value!r}.")
    return float(value)


def _flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"AutoSAC: {name} must be True or False, got {value!r} ({type(value).__name__}).")


def _check_budget(budget_gb: object, budget_fraction: object) -> None:
    if (budget_gb is None) == (budget_fraction is None):
        raise ValueError(
            f"AutoSAC needs exactly one of budget_gb or budget_fraction, got budget_gb={budget_gb!r} and "
            f"budget_fraction={budget_fraction!r}. E.g. AutoSAC(budget_gb=40) or AutoSAC(budget_fraction=0.9)."
        )
    if budget_gb is not None:
        _number("budget_gb", budget_gb, "a finite positive number of GiB, e.g. budget_gb=40 (not a string)")
    if budget_fraction is not None:
        fraction = _number("budget_fraction", budget_fraction, "a number in (0, 1], e.g. budget_fraction=0.9")
        if fraction > 1:
            raise ValueError(
                f"AutoSAC: budget_fraction must be a number in (0, 1] (a fraction of the device's memory), got "
                f"{budget_fraction!r}. For a budget in GiB use budget_gb."
            )


def _check_device(device: object) -> None:
    if device is None or isinstance(device, DeviceSpec):
        return
    if not isinstance(device, str):
        raise TypeError(
            f"AutoSAC: device must be a device name (str), a DeviceSpec or None (the trainer's device), got "
            f"{device!r} ({type(device).__name__})."
        )
    if device.strip().lower() == "auto":
        return
    try:
        get_device_spec(device)
    except ValueError as err:
        raise ValueError(f"AutoSAC: device={device!r}: {err}") from err


def _check_candidates(candidates: object) -> None:
    if candidates is None:
        return
    if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Sequence):
        raise TypeError(
            f"AutoSAC: candidates must be a list of module classes or fqn glob patterns (e.g. "
            f"[TransformerBlock] or ['model.layers.*']), got {candidates!r}."
        )
    for c in candidates:
        if not (isinstance(c, str) or (isinstance(c, type) and issubclass(c, nn.Module))):
            raise TypeError(
                f"AutoSAC: each candidate must be an nn.Module subclass or an fqn glob pattern (str), got {c!r}."
            )


def check_autosac_args(
    *,
    budget_gb: object,
    budget_fraction: object,
    device: object,
    estimate: object,
    candidates: object,
    backend: object,
    n_segments: object,
    solver_time_limit_s: object,
    plan_path: object,
    flags: dict[str, object],
    example_batch: object,
    example_batch_fn: Callable[[], Any] | None,
) -> None:
    """Check every argument of :class:`~lightning_sac.AutoSAC`.

    Raises:
        TypeError: An argument of the wrong type.
        ValueError: A value out of range, an unknown name, or a combination that is not allowed.
    """
    _check_budget(budget_gb, budget_fraction)
    _check_device(device)
    if estimate not in _ESTIMATES:
        raise ValueError(f"AutoSAC: estimate must be one of {_ESTIMATES}, got {estimate!r}.")
    if backend not in BACKENDS:
        raise ValueError(f"AutoSAC: backend must be one of {BACKENDS}, got {backend!r}.")
    _check_candidates(candidates)
    if isinstance(n_segments, bool) or not isinstance(n_segments, int) or n_segments < 1:
        raise ValueError(f"AutoSAC: n_segments must be a positive int (lines per trade-off fit), got {n_segments!r}.")
    _number("solver_time_limit_s", solver_time_limit_s, "a finite positive number of seconds")
    if plan_path is not None and not isinstance(plan_path, (str, os.PathLike)):
        raise TypeError(f"AutoSAC: plan_path must be a path (str or os.PathLike) or None, got {plan_path!r}.")
    for name, value in flags.items():
        _flag(name, value)
    if example_batch is not None and example_batch_fn is not None:
        raise ValueError("AutoSAC: pass example_batch or example_batch_fn, not both.")
    if example_batch_fn is not None and not callable(example_batch_fn):
        raise TypeError(f"AutoSAC: example_batch_fn must be a function returning a batch, got {example_batch_fn!r}.")


def check_strategy(strategy: Any) -> None:
    """Refuse a strategy AutoSAC does not plan for, before anything runs.

    Raises:
        ValueError: Not single-device, DDP, FSDP2 and tensor parallelism (``ModelParallelStrategy``; which TP
            styles are planned is checked on the model, :func:`lightning_sac.sharding.check_tensor_parallel`) or
            FSDP1 (``FSDPStrategy``).
    """
    if isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy, _SUPPORTED):
        raise ValueError(
            f"AutoSAC supports single-device, DDP, FSDP and tensor-parallel training (FSDP2 and tensor parallelism "
            f"through ModelParallelStrategy, FSDP1 through FSDPStrategy); got {type(strategy).__name__}. Use one of "
            "those, or remove AutoSAC."
        )
