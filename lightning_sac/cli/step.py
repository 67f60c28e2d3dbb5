"""The training step ``lightning-sac plan`` dry-runs: which optimizer and which loss, and how the header names them.

The optimizer's state and the loss's backward are part of the step's peak (AdamW's two moments are twice the fp32
parameters), so the command plans a real step by default and says which one. Who decides, first to last:

- the optimizer: ``--optimizer`` when given; else the factory's ``optimizer_factory``; else AdamW with torch's
  defaults. ``--optimizer none`` plans forward and backward alone.
- the loss: ``--loss`` when given; else the factory's ``loss_fn``; else the output's ``.loss`` when it has one (a
  Hugging Face model given ``labels``). An output with neither stops with exit code 2 and asks for ``--loss sum``:
  planning ``output.sum()`` silently would plan a step that never runs in training.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_sac.cli.args import Made, UsageError

__all__ = ["LOSSES", "OPTIMIZERS", "StepLoss", "StepOptimizer", "TrainingStep", "add_step_arguments", "training_step"]

#: ``--optimizer``'s choices: torch's optimizers with their defaults, or none.
OPTIMIZERS = ("adamw", "adam", "sgd", "none")
#: ``--loss``'s choices: the model's own loss, or the sum of its first floating-point output.
LOSSES = ("output.loss", "sum")

_TORCH_OPTIMIZERS: dict[str, Any] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--optimizer`` and ``--loss`` to ``plan``'s parser."""
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=None,
        help="the optimizer whose state the step holds, with torch's defaults (none: forward and backward only); "
        "default: the factory's optimizer_factory, else adamw",
    )
    parser.add_argument(
        "--loss",
        choices=LOSSES,
        default=None,
        help="output.loss: the model's own loss (a Hugging Face model given labels); sum: the sum of the first "
        "floating-point output; default: the factory's loss_fn, else output.loss, which the output must have",
    )


def _own_loss(output: Any) -> torch.Tensor | None:
    own = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(own, torch.Tensor) and own.numel() == 1 and own.is_floating_point():
        return own
    return None


def _kind(output: Any) -> str:
    # A fake tensor in the dry run is a tensor in training.
    return "Tensor" if isinstance(output, torch.Tensor) else type(output).__name__


def _first_float(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((t for v in values if (t := _first_float(v)) is not None), None)


@dataclass
class StepLoss:
    """The loss the dry run calls on the model's output; it remembers which loss it took, for the header.

    Attributes:
        flag: ``--loss`` as typed, or ``None``.
        factory_fn: The factory's ``loss_fn``, or ``None``.
        used: What the last call took (``"output.loss"``, ``"output.sum()"``, ``"the factory's loss_fn"``).
    """

    flag: str | None = None
    factory_fn: Any = None
    used: str = ""

    def __call__(self, output: Any) -> torch.Tensor:
        """The scalar loss of ``output``.

        Raises:
            UsageError: ``--loss output.loss`` (or no loss chosen) and the output has no ``.loss``, or ``--loss
                sum`` and it has no floating-point tensor.
        """
        if self.flag is None and self.factory_fn is not None:
            self.used = "the factory's loss_fn"
            return self.factory_fn(output)
        if self.flag == "sum":
            first = _first_float(output)
            if first is None:
                raise UsageError(
                    f"--loss sum: the model returned a {_kind(output)} with no floating-point tensor to "
                    "sum; return (model, example_inputs, loss_fn) from the factory instead"
                )
            self.used = "output.sum()" if isinstance(output, torch.Tensor) else "sum of the first float output"
            return first.sum()
        own = _own_loss(output)
        if own is not None:
            self.used = "output.loss"
            return own
        if self.flag == "output.loss":
            raise UsageError(
                f"--loss output.loss: the model returned a {_kind(output)} with no scalar .loss (a Hugging "
                "Face model has one when its batch holds labels); add labels to the batch, type --loss sum, or "
                "return (model, example_inputs, loss_fn) from the factory"
            )
        raise UsageError(
            f"the factory returns no loss_fn and the model's output (a {_kind(output)}) has no .loss, so "
            "there is no loss to plan the backward of: type --loss sum to plan output.sum() (the sum of the first "
            "floating-point output), or return (model, example_inputs, loss_fn) from the factory"
        )

    def describe(self) -> str:
        """``loss = ...`` for the header."""
        instead = " (by --loss instead of the factory's loss_fn)" if self.flag and self.factory_fn is not None else ""
        return f"loss = {self.used or 'not called'}{instead}"


@dataclass
class StepOptimizer:
    """The optimizer factory the dry run calls; it remembers the class it built, for the header.

    Attributes:
        flag: ``--optimizer`` as typed, or ``None``.
        factory_fn: The factory's ``optimizer_factory``, or ``None``.
        built: Names of the optimizer classes built, in order.
    """

    flag: str | None = None
    factory_fn: Any = None
    built: list[str] = field(default_factory=list)

    @property
    def choice(self) -> str:
        """``"factory"``, or a key of :data:`OPTIMIZERS`."""
        if self.flag is not None:
            return self.flag
        return "factory" if self.factory_fn is not None else "adamw"

    def __call__(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer of ``params``."""
        choice = self.choice
        optimizer = self.factory_fn(params) if choice == "factory" else _TORCH_OPTIMIZERS[choice](params)
        self.built.append(type(optimizer).__name__)
        return optimizer

    def describe(self) -> str:
        """The optimizer's part of the header."""
        choice = self.choice
        if choice == "factory":
            return f"the factory's optimizer_factory ({self.built[-1] if self.built else 'not called'})"
        instead = ", by --optimizer instead of the factory's optimizer_factory" if self.factory_fn else ""
        if choice == "none":
            return f"no optimizer (--optimizer none: no optimizer state, no optimizer step{instead})"
        return f"{_TORCH_OPTIMIZERS[choice].__name__} (torch defaults{instead})"


@dataclass
class TrainingStep:
    """The step to dry-run: the optimizer factory and the loss to pass to ``profile_model``.

    Attributes:
        optimizer: Builds the optimizer and names it.
        loss: Computes the loss and names it.
    """

    optimizer: StepOptimizer
    loss: StepLoss

    @property
    def optimizer_factory(self) -> StepOptimizer | None:
        """What ``profile_model`` takes as ``optimizer_factory``: ``None`` for ``--optimizer none``."""
        return None if self.optimizer.choice == "none" else self.optimizer

    def describe(self) -> str:
        """The header's line, e.g. ``training step: AdamW (torch defaults), loss = output.loss``."""
        return f"training step: {self.optimizer.describe()}, {self.loss.describe()}"


def training_step(made: Made, optimizer: str | None = None, loss: str | None = None) -> TrainingStep:
    """The step to plan for the factory's model, from what it returned and the ``--optimizer`` and ``--loss`` flags.

    Args:
        made: What the factory returned.
        optimizer: ``--optimizer`` (a key of :data:`OPTIMIZERS`), or ``None`` when not given.
        loss: ``--loss`` (one of :data:`LOSSES`), or ``None`` when not given.
    """
    return TrainingStep(StepOptimizer(optimizer, made.optimizer_factory), StepLoss(loss, made.loss_fn))
