"""``AutoSAC``: plan and apply selective activation checkpointing for a Lightning ``fit``, before its first step."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_sac.apply import PlanHandle, apply_plan
from lightning_sac.devices import DeviceSpec
from lightning_sac.dryrun import MemoryTimeline, ModelProfile
from lightning_sac.lightning.args import check_autosac_args, check_strategy
from lightning_sac.lightning.batch_shapes import check_max_shapes, grow_batch, max_shapes_signature, signature_of
from lightning_sac.lightning.fit_measure import (
    StepMeasurement,
    compare_measured,
    cuda_max_allocated,
    logger_writer,
    own_writer,
)
from lightning_sac.lightning.fit_planning import broadcast_from_rank_zero, plan_message
from lightning_sac.lightning.planning import PlanningMixin
from lightning_sac.lightning.shape_plans import ShapePlan, ShapePlans, follow_batch
from lightning_sac.plan import Plan
from lightning_sac.report import PeakSeries

__all__ = ["AutoSAC"]


class AutoSAC(PlanningMixin, Callback):
    """Fit training into a memory budget: profile, plan and apply selective activation checkpointing.

    Before the first training step of ``fit`` (in ``on_train_start``: the first point where the dataloaders and
    optimizers exist), global rank 0 dry-runs the LightningModule's own ``training_step`` and the optimizer of its
    ``configure_optimizers`` on fake tensors for the target device, with the trainer's precision, solves for the
    cheapest plan within the budget, and broadcasts it; every rank applies the identical plan. The plan is
    ``callback.plan``; it is saved in checkpoints and restored on resume without profiling again. At the end of
    ``fit`` the model's modules get their own ``forward`` back.

    Variable shapes: the first plan is made for the first training batch (or ``example_batch``). Before every
    batch, the ranks agree on the dim-wise largest shapes of their batches; a batch outside what the applied plan
    was made for (a tensor dim larger than planned, or other tensors) is never run on it: AutoSAC applies a
    cached plan that covers it or plans again for it, says so, and every rank applies the identical new plan. To
    plan once for the worst case instead, pass ``max_shapes`` (or ``example_batch``/``example_batch_fn``).

    Args:
        budget_gb: Memory budget per device, GiB.
        budget_fraction: Or: the budget as a fraction of the target device's memory.
        device: Target device name or ``DeviceSpec``; default the trainer's device (its real properties on
            CUDA, the CPU otherwise). Name a GPU to plan for it from a machine without one.
        estimate: ``"roofline"`` or ``"benchmark"`` (CPU only).
        candidates: Module classes or fqn glob patterns allowed as checkpoint units; default every non-leaf one.
        backend: ``"sac"`` (``torch.utils.checkpoint``) or ``"graph"`` (:mod:`lightning_sac.apply.graph.backend`).
        n_segments: Lines of each module's trade-off fit.
        solver_time_limit_s: HiGHS time limit.
        plan_path: A JSON file: reused when the model structure, batch shapes and settings match, written
            otherwise, and rewritten with the new plan at each re-plan for a larger batch.
        strict: ``True``: a budget below the minimum or a step the profiler cannot run stops ``fit`` before any
            step. ``False``: warn, then apply the minimum-memory plan, or train without a plan.
        example_batch: The batch to plan for, instead of the first training batch.
        example_batch_fn: Or a function returning it.
        max_shapes: The largest shape of each tensor of a batch, mirroring the batch, e.g.
            ``{"input_ids": (8, 512), "attention_mask": (8, 512), "labels": (8, 512)}`` for a dict batch or
            ``((8, 512), (8,))`` for a tuple; a key left out (or ``None``) keeps the tensor's shape. AutoSAC plans
            once for the example batch grown to these shapes (each grown dim repeats the tensor's last entry, so
            ids stay ids and a padded row stays padded); a batch still larger is planned for when it comes.
        log_figures: Log the plan's figures to TensorBoard (scalars and the plan table are always logged).
        measure: Profile the second real optimizer step (a whole accumulation cycle; the optimizer's state
            exists by then) with torch.profiler, changing nothing of the step, and log its memory timeline and
            peak beside the prediction; warn when it exceeds the budget (and when it cannot be measured).
        replace_existing: The model checkpoints itself with Hugging Face's ``gradient_checkpointing``: let the plan
            replace it (those flags are off while the plan is applied). Otherwise modules the model already
            checkpoints are planned around, and AutoSAC says so.
        report_only: Profile and plan as usual, print the peak without a plan and the plan it would apply (on
            rank 0, at Lightning's info level), and apply nothing: the model trains with its own forwards, no
            module is wrapped, no batch shape is planned for again and no step is measured. The plan is still
            ``callback.plan``, written to ``plan_path`` and logged to TensorBoard.
    """

    def __init__(
        self,
        budget_gb: float | None = None,
        *,
        budget_fraction: float | None = None,
        device: str | DeviceSpec | None = None,
        estimate: str = "roofline",
        candidates: Sequence[Any] | None = None,
        backend: str = "sac",
        n_segments: int = 2,
        solver_time_limit_s: float = 30.0,
        plan_path: str | os.PathLike[str] | None = None,
        strict: bool = True,
        example_batch: Any = None,
        example_batch_fn: Callable[[], Any] | None = None,
        max_shapes: Any = None,
        log_figures: bool = True,
        measure: bool = True,
        replace_existing: bool = False,
        report_only: bool = False,
    ) -> None:
        check_autosac_args(
            budget_gb=budget_gb,
            budget_fraction=budget_fraction,
            device=device,
            estimate=estimate,
            candidates=candidates,
            backend=backend,
            n_segments=n_segments,
            solver_time_limit_s=solver_time_limit_s,
            plan_path=plan_path,
            flags={
                "strict": strict,
                "log_figures": log_figures,
                "measure": measure,
                "replace_existing": replace_existing,
                "report_only": report_only,
            },
            example_batch=example_batch,
            example_batch_fn=example_batch_fn,
        )
        self.budget_gb = budget_gb
        self.budget_fraction = budget_fraction
        self.device = device
        self.estimate = estimate
        self.candidates = candidates
        self.backend = backend
        self.n_segments = n_segments
        self.solver_time_limit_s = solver_time_limit_s
        self.plan_path = Path(plan_path) if plan_path is not None else None
        self.strict = strict
        self.example_batch = example_batch
        self.example_batch_fn = example_batch_fn
        check_max_shapes(max_shapes)
        self.max_shapes = max_shapes
        #: Every plan of the fit by the batch shapes it was made for (see :mod:`lightning_sac.lightning.shape_plans`).
        self.shape_plans = ShapePlans()
        self.log_figures = log_figures
        self.measure = measure
        self.replace_existing = replace_existing
        self.report_only = report_only
        self.plan: Plan | None = None
        self.profile: ModelProfile | None = None  # the dry run's profile, when this fit profiled
        self.measured: MemoryTimeline | None = None  # the first planned step, measured
        self.profiled = False  # whether this fit profiled (False when the plan came from a checkpoint or file)
        self._restored: Plan | None = None
        self._handle: PlanHandle | None = None
        self._writer: Any = None
        self._measurement = StepMeasurement()
        self._peaks = PeakSeries()  # the points of the TensorBoard peak series, on global rank 0

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        check_strategy(trainer.strategy)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._peaks = PeakSeries()
        batch = self._example_batch(trainer)
        if self.max_shapes is not None:
            batch = grow_batch(batch, max_shapes_signature(batch, self.max_shapes))

        def make() -> dict[str, Any]:  # on global rank 0
            cached = self._cached_shape_plan(pl_module, batch, trainer)
            plan = cached.plan if cached else self._reuse(pl_module, batch, trainer)
            plan = plan or self._make_plan(trainer, pl_module, batch)
            self.shape_plans.start(cached.signature if cached else signature_of(batch), plan)
            payload: dict[str, Any] = {"plan": None if plan is None else plan.to_json(), "profiled": self.profiled}
            payload["shape_plans"] = self.shape_plans.state_dict()  # every rank follows shapes with this cache
            return payload

        broadcast = functools.partial(trainer.strategy.broadcast, src=0)
        payload = broadcast_from_rank_zero(trainer.is_global_zero, make, broadcast)
        self.profiled = payload["profiled"]
        self.plan = None if payload["plan"] is None else Plan.from_json(payload["plan"])
        self.shape_plans.load_state_dict(payload["shape_plans"])
        if self.plan is None:
            return
        if not self.report_only:
            self._handle = apply_plan(pl_module, self.plan, backend=self.backend)
        if self.plan_path is not None and trainer.is_global_zero:
            self.plan_path.write_text(self.plan.to_json(indent=1))
        rank_zero_info(plan_message(self.plan, self.backend, report_only=self.report_only))
        if trainer.is_global_zero:
            writer = self._summary_writer(trainer)
            self._peaks.plan(writer, self.plan, self.profile, trainer.global_step, figures=self.log_figures)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.report_only:  # nothing applied: no shape to follow, no planned step to measure
            return
        self._follow_shapes(trainer, pl_module, batch, batch_idx)  # first: the batch must run on a plan made for it
        measuring = self.measure and not self._measurement.failed and self.measured is None
        if measuring and self.plan is not None and trainer.is_global_zero:
            # The second optimizer step of the fit: the optimizer's state exists by then, as the prediction assumes.
            self._measurement.batch_start(trainer, pl_module, batch)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._measurement.running and self.plan is not None:
            self._end_measured_batch(trainer)
        if self.plan is not None and trainer.is_global_zero:
            # Points of the budget and prediction lines at Lightning's logging cadence, after the measured one.
            # (The Trainer sets log_every_n_steps in its logger connector, out of its annotations' sight.)
            step, every_n = trainer.global_step - 1, getattr(trainer, "log_every_n_steps", 50)
            self._peaks.step_end(self._summary_writer(trainer), self.plan, step, every_n)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.plan is not None and trainer.is_global_zero and trainer.global_step > 0:
            writer, step = self._summary_writer(trainer), trainer.global_step - 1
            self._peaks.fit_end(writer, self.plan, step, cuda_max_allocated_bytes=cuda_max_allocated(trainer))

    def _end_measured_batch(self, trainer: pl.Trainer) -> None:
        """Read the measured step once its last micro-batch ended; log it and say whether the plan held."""
        assert self.plan is not None
        try:
            measured = self._measurement.batch_end(trainer)
        except Exception as err:  # noqa: BLE001 - the measurement is a check beside training, never its end
            self._measurement.abandon(failed=True)
            rank_zero_warn(
                f"AutoSAC could not measure the planned step ({type(err).__name__}: {err}). Training goes on with "
                "the plan; its prediction is not compared with a measurement."
            )
            return
        if measured is None:
            return
        self.measured = measured
        step = trainer.global_step - 1  # the measured optimizer step, indexed as Lightning logs train_loss
        cuda = cuda_max_allocated(trainer)
        writer = self._summary_writer(trainer)
        self._peaks.measured(writer, self.plan, step, measured, figures=self.log_figures, cuda_max_allocated_bytes=cuda)
        device = trainer.strategy.root_device
        self.compare_measured(self.measured.peak_bytes, device.type, self._target(trainer).is_cuda)

    def compare_measured(self, measured_bytes: int, device_type: str, target_is_cuda: bool) -> None:
        """Warn when a measured peak on the planned device exceeds the budget: the plan did not hold."""
        assert self.plan is not None
        compare_measured(self.plan, measured_bytes, device_type, target_is_cuda)

    def _summary_writer(self, trainer: pl.Trainer) -> Any:
        """The trainer's TensorBoard writer when it has a TensorBoardLogger, otherwise our own."""
        writer = logger_writer(trainer)
        if writer is None and self._writer is None:
            self._writer = own_writer(trainer)
        return writer if writer is not None else self._writer

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning calls no teardown hook of callbacks when fit raises: the user's modules get their own forward
        # back here, so that the model they keep after the exception is the model they built.
        self._restore()

    def _restore(self) -> None:
        """Remove the plan from the model, stop a measurement under way and close our writer."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._measurement.abandon()  # when fit ended inside the measured step
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    @override
    def state_dict(self) -> dict[str, Any]:
        # The applied plan, and every plan of the fit by shape: a resumed fit reuses whichever covers its batches.
        return {
            "plan": None if self.plan is None else self.plan.to_json(),
            "shape_plans": self.shape_plans.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        text = state_dict.get("plan")
        self._restored = None if text is None else Plan.from_json(text)
        self.shape_plans.load_state_dict(state_dict.get("shape_plans", {}))

    # ------------------------------------------------------------------ variable shapes
    def _follow_shapes(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        """Before a batch outside the applied plan's shapes on any rank: apply a cached plan or plan again."""
        if self.shape_plans.current is None:  # training without a plan: AutoSAC said so already
            return

        def make_plan(example: Any) -> Plan | None:
            # Global rank 0 only. The dry run must see the model's own forwards, and must not move the run's
            # random numbers (dropout masks, shuffling) away from a plain fit's.
            if self._handle is not None:
                self._handle.remove()
                self._handle = None
            devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
            with torch.random.fork_rng(devices=devices):
                return self._make_plan(trainer, pl_module, example, replanning=True)

        change = follow_batch(self.shape_plans, trainer, batch, batch_idx, make_plan)
        if change is None:
            return
        if change.failed:
            rank_zero_warn(change.message)
        elif change.message:
            rank_zero_info(change.message)
        if self._handle is not None:
            self._handle.remove()
        self.plan = change.entry.plan
        self._handle = apply_plan(pl_module, self.plan, backend=self.backend)
        if not change.planned:
            return
        self.profiled = True
        rank_zero_info(plan_message(self.plan, self.backend))
        if trainer.is_global_zero:
            if self.plan_path is not None:
                self.plan_path.write_text(self.plan.to_json(indent=1))
            writer = self._summary_writer(trainer)
            self._peaks.plan(writer, self.plan, self.profile, trainer.global_step, figures=self.log_figures)

    def _cached_shape_plan(self, pl_module: pl.LightningModule, batch: Any, trainer: pl.Trainer) -> ShapePlan | None:
        """A restored plan whose shapes cover ``batch``'s, after dropping those made for another run."""
        dropped = self.shape_plans.retain(lambda e: self._matches(e.plan, pl_module, e.signature.meta_batch(), trainer))
        if dropped:
            rank_zero_warn(f"AutoSAC: restored plans that do not fit this run are dropped: {'; '.join(dropped)}.")
        cached = self.shape_plans.covering(signature_of(batch))
        if cached is not None:
            rank_zero_info(
                f"AutoSAC: reusing the plan made for {cached.signature.describe()} (from the checkpoint or an earlier "
                "fit), which covers the first batch; no profiling needed."
            )
        return cached
