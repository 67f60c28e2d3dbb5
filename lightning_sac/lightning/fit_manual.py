"""Lightning's manual optimization on the fake copy of a LightningModule, for AutoSAC's dry run of its step.

A manually optimizing ``training_step`` reaches its optimizers and Lightning's loop through ``self.trainer``:
``self.optimizers()`` reads the strategy's ``LightningOptimizer`` wrappers, ``self.manual_backward(loss)`` calls the
strategy's ``backward``, ``toggle_optimizer`` / ``untoggle_optimizer`` walk ``self.trainer.optimizers`` and set
``requires_grad`` (which changes what backward computes and keeps), and ``opt.step()`` goes to the strategy's
``optimizer_step``. On the fake copy, ``self.trainer`` is a stand-in over the real trainer that answers these with
the fake copy's own optimizers (built by its ``configure_optimizers``, so they hold the fake parameters) and a
strategy stand-in whose backward and optimizer step run on the fake tensors and tell the recorder the phase.
Lightning's own methods (``optimizers``, ``toggle_optimizer``, ``toggled_optimizer``, ``LightningOptimizer.step``
and ``toggle_model``) run unchanged on top, so the dry run is the step ``fit`` runs, and nothing of it reaches the
real trainer's optimizers, the user's hooks and callbacks, or the loggers.

What the stand-ins leave out, as nothing of it changes memory: the precision plugin's loss scaling (a scalar), the
``on_before_backward`` / ``on_after_backward`` / ``on_before_optimizer_step`` hooks, and DDP's gradient sync.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer, do_nothing_closure
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn

__all__ = ["ManualDryRun"]


class _DryRunStrategy:
    """The strategy as a manual step on the fake copy sees it: backward and optimizer steps on fake tensors."""

    def __init__(
        self,
        strategy: Any,
        module: pl.LightningModule,
        optimizers: Sequence[torch.optim.Optimizer],
        on_phase: Callable[[str], None],
    ) -> None:
        self._strategy = strategy
        self._on_phase = on_phase
        self.lightning_module = module
        self._lightning_optimizers = [self._wrap(o) for o in optimizers]

    def _wrap(self, optimizer: torch.optim.Optimizer) -> LightningOptimizer:
        wrapped = LightningOptimizer(optimizer)
        wrapped._strategy = self  # type: ignore[assignment]  # the stand-in, as Lightning sets the strategy
        return wrapped

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``self.manual_backward(loss, ...)``: ``loss.backward(...)`` in the recorder's backward phase."""
        self._on_phase("backward")
        try:
            closure_loss.backward(*args, **kwargs)
        finally:
            self._on_phase("forward")
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """``opt.step(closure)``: the optimizer's step (its hooks move the recorder to the optimizer phase and back).

        A closure's forward and backward (LBFGS calls it several times) run in their own phases.
        """
        optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if closure is do_nothing_closure:
            return optimizer.step(**kwargs)

        def run_closure() -> Any:
            self._on_phase("forward")
            try:
                return closure()
            finally:
                self._on_phase("optimizer")

        return optimizer.step(closure=run_closure, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._strategy, name)


class _DryRunTrainer:
    """The trainer as a manual step on the fake copy sees it.

    Its optimizers, schedulers and strategy are the fake copy's; everything else (epoch, step counters, precision
    plugin) is the real trainer's.
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        strategy: _DryRunStrategy,
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: list[LRSchedulerConfig],
    ) -> None:
        self._trainer = trainer
        self.strategy = strategy
        self.optimizers = list(optimizers)
        self.lr_scheduler_configs = schedulers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)


class ManualDryRun:
    """Builds a manually optimizing module's optimizers on its fake copy and runs its step there.

    ``make_optimizers`` and ``run`` are :func:`~lightning_sac.profile_step`'s ``make_optimizer`` and
    ``manual_step``.

    Args:
        trainer: The real trainer (its attributes other than optimizers and strategy are read, never changed).
        call_step: Calls the fake copy's ``training_step`` on the inputs (with the dry run's stubs, e.g. logging).
    """

    def __init__(self, trainer: pl.Trainer, call_step: Callable[[nn.Module, Any], Any]) -> None:
        self.trainer = trainer
        self.call_step = call_step
        # Per fake copy (a dry run can make two), the schedulers its configure_optimizers returned.
        self._schedulers: dict[int, list[LRSchedulerConfig]] = {}

    def make_optimizers(self, module: nn.Module) -> list[torch.optim.Optimizer]:
        """The optimizers of the fake copy's ``configure_optimizers``, parsed as Lightning parses them."""
        from lightning.pytorch.core.optimizer import _configure_optimizers

        conf = module.configure_optimizers()  # type: ignore[operator]
        if conf is None:  # Lightning trains with a mock optimizer that does nothing
            self._schedulers[id(module)] = []
            return []
        optimizers, schedulers, _ = _configure_optimizers(conf)
        configs = [
            LRSchedulerConfig(s["scheduler"]) if isinstance(s, dict) else LRSchedulerConfig(s) for s in schedulers
        ]
        self._schedulers[id(module)] = configs
        return cast("list[torch.optim.Optimizer]", optimizers)

    def run(
        self,
        module: nn.Module,
        inputs: Any,
        optimizers: Sequence[torch.optim.Optimizer],
        on_phase: Callable[[str], None],
    ) -> None:
        """Run the fake copy's ``training_step``, which backpropagates and steps its optimizers itself."""
        assert isinstance(module, pl.LightningModule)
        with self._attached(module, optimizers, on_phase):
            self.call_step(module, inputs)

    @contextmanager
    def _attached(
        self, module: pl.LightningModule, optimizers: Sequence[torch.optim.Optimizer], on_phase: Callable[[str], None]
    ) -> Iterator[None]:
        strategy = _DryRunStrategy(self.trainer.strategy, module, optimizers, on_phase)
        stand_in = _DryRunTrainer(self.trainer, strategy, optimizers, self._schedulers.get(id(module), []))
        # Every step of an optimizer is in the optimizer phase, through Lightning's wrapper or not
        # (self.optimizers(use_pl_optimizer=False)).
        handles = []
        for o in optimizers:
            handles.append(o.register_step_pre_hook(lambda *_: on_phase("optimizer")))
            handles.append(o.register_step_post_hook(lambda *_: on_phase("forward")))
        real = module._trainer
        module.trainer = stand_in  # type: ignore[assignment]  # also sets it on child LightningModules
        try:
            yield
        finally:
            module.trainer = real
            for h in handles:
                h.remove()
