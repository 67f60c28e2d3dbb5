"""``AutoSAC``: plan and apply selective activation checkpointing for a Lightning ``fit``, before its first step."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_sac.apply import PlanHandle, apply_plan
from lightning_sac.devices import DeviceSpec, get_device_spec
from lightning_sac.errors import BudgetError, LightningSACError, ProfilingError
from lightning_sac.fit_measure import StepMeasurement, compare_measured
from lightning_sac.fit_step import FitStepSettings, profile_lightning_step
from lightning_sac.measure import MemoryTimeline
from lightning_sac.plan import Plan, fingerprint_of
from lightning_sac.profiling.data import ModelProfile
from lightning_sac.profiling.step import tensors_of
from lightning_sac.recompute import check_backend
from lightning_sac.report.tensorboard import TAG, log_measured, log_plan
from lightning_sac.solver.milp import solve_plan

__all__ = ["AutoSAC"]

_GIB = 2**30
_SUPPORTED = (SingleDeviceStrategy, DDPStrategy)


class AutoSAC(Callback):
    """Fit training into a memory budget: profile, plan and apply selective activation checkpointing.

    Before the first training step of ``fit`` (in ``on_train_start``: the first point where the dataloaders and
    optimizers exist), global rank 0 dry-runs the LightningModule's own ``training_step`` and the optimizer of its
    ``configure_optimizers`` on fake tensors for the target device, with the trainer's precision, solves for the
    cheapest plan within the budget, and broadcasts it; every rank applies the identical plan. The plan is
    ``callback.plan``; it is saved in checkpoints and restored on resume without profiling again. At the end of
    ``fit`` the model's modules get their own ``forward`` back.

    Plan with the worst-case batch. The default example is the first training batch; with variable-length data
    a longer batch later needs more memory than planned for, so pass ``example_batch`` or ``example_batch_fn``
    with the longest sequences you train on.

    Args:
        budget_gb: Memory budget per device, GiB.
        budget_fraction: Or: the budget as a fraction of the target device's memory.
        device: Target device name or ``DeviceSpec``; default the trainer's device (its real properties on
            CUDA, the CPU otherwise). Name a GPU to plan for it from a machine without one.
        estimate: ``"roofline"`` or ``"benchmark"`` (CPU only).
        candidates: Module classes or fqn glob patterns allowed as checkpoint units; default every non-leaf one.
        backend: ``"sac"`` (``torch.utils.checkpoint``) or ``"graph"`` (:mod:`lightning_sac.graph_ac`).
        n_segments: Lines of each module's trade-off fit.
        solver_time_limit_s: HiGHS time limit.
        plan_path: A JSON file: reused when the model structure, batch shapes and settings match, written
            otherwise.
        strict: ``True``: a budget below the minimum or a step the profiler cannot run stops ``fit`` before any
            step. ``False``: warn, then apply the minimum-memory plan, or train without a plan.
        example_batch: The batch to plan for, instead of the first training batch.
        example_batch_fn: Or a function returning it.
        log_figures: Log the plan's figures to TensorBoard (scalars and the plan table are always logged).
        measure: Profile the second real training step (the optimizer's state exists by then) with
            torch.profiler and log its memory timeline and peak beside the prediction; warn when it exceeds the
            budget.
        replace_existing: The model checkpoints itself with Hugging Face's ``gradient_checkpointing``: let the plan
            replace it (those flags are off while the plan is applied). Otherwise modules the model already
            checkpoints are planned around, and AutoSAC says so.
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
        log_figures: bool = True,
        measure: bool = True,
        replace_existing: bool = False,
    ) -> None:
        if (budget_gb is None) == (budget_fraction is None):
            raise ValueError(
                f"AutoSAC needs exactly one of budget_gb or budget_fraction, got budget_gb={budget_gb} and "
                f"budget_fraction={budget_fraction}."
            )
        if budget_fraction is not None and not 0 < budget_fraction <= 1:
            raise ValueError(f"budget_fraction must be in (0, 1], got {budget_fraction}.")
        check_backend(backend)
        if example_batch is not None and example_batch_fn is not None:
            raise ValueError("Pass example_batch or example_batch_fn, not both.")
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
        self.log_figures = log_figures
        self.measure = measure
        self.replace_existing = replace_existing
        self.plan: Plan | None = None
        self.profile: ModelProfile | None = None  # the dry run's profile, when this fit profiled
        self.measured: MemoryTimeline | None = None  # the first planned step, measured
        self.profiled = False  # whether this fit profiled (False when the plan came from a checkpoint or file)
        self._restored: Plan | None = None
        self._handle: PlanHandle | None = None
        self._writer: Any = None
        self._measurement = StepMeasurement()
        self._steps_seen = 0

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy, _SUPPORTED):
            raise ValueError(
                f"AutoSAC supports single-device and DDP training; got {type(strategy).__name__}. Use "
                "strategy='ddp' (or a single device), or remove AutoSAC."
            )
        if not pl_module.automatic_optimization:
            raise ValueError("AutoSAC supports automatic optimization only; this LightningModule optimizes manually.")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        batch = self._example_batch(trainer)
        payload: dict[str, Any] = {}
        if trainer.is_global_zero:
            try:
                plan = self._reuse(pl_module, batch, trainer) or self._make_plan(trainer, pl_module, batch)
                payload = {"plan": None if plan is None else plan.to_json(), "profiled": self.profiled}
            except Exception as err:
                # Every rank waits for this broadcast: tell them, then raise here with the full traceback.
                trainer.strategy.broadcast({"error": type(err).__name__, "message": str(err)}, src=0)
                raise
        payload = trainer.strategy.broadcast(payload, src=0)
        if "error" in payload:
            raise LightningSACError(
                f"AutoSAC planning failed on global rank 0: {payload['error']}: {payload['message']}"
            )
        self.profiled = payload["profiled"]
        self.plan = None if payload["plan"] is None else Plan.from_json(payload["plan"])
        if self.plan is None:
            return
        self._handle = apply_plan(pl_module, self.plan, backend=self.backend)
        if self.plan_path is not None and trainer.is_global_zero:
            self.plan_path.write_text(self.plan.to_json(indent=1))
        rank_zero_info(f"AutoSAC plan ({self.backend} backend):\n{self.plan.table()}")
        if trainer.is_global_zero:
            log_plan(self._summary_writer(trainer), self.plan, self.profile, figures=self.log_figures)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not (self.measure and self.plan is not None and trainer.is_global_zero and self.measured is None):
            return
        self._steps_seen += 1
        # The second step of the fit: the optimizer's state exists by then, as the prediction assumes.
        if not self._measurement.running and self._steps_seen == 2:
            self._measurement.start(trainer, pl_module, batch)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._measurement.running or self.plan is None:
            return
        device = trainer.strategy.root_device
        self.measured = self._measurement.stop(device)
        writer = self._summary_writer(trainer)
        log_measured(writer, self.measured, budget_bytes=self.plan.budget_bytes, figures=self.log_figures)
        if device.type == "cuda":
            writer.add_scalar(f"{TAG}/cuda_max_allocated_gib", torch.cuda.max_memory_allocated(device) / _GIB, 0)
        self.compare_measured(self.measured.peak_bytes, device.type, self._target(trainer).is_cuda)

    def compare_measured(self, measured_bytes: int, device_type: str, target_is_cuda: bool) -> None:
        """Warn when a measured peak on the planned device exceeds the budget: the plan did not hold."""
        assert self.plan is not None
        compare_measured(self.plan, measured_bytes, device_type, target_is_cuda)

    def _summary_writer(self, trainer: pl.Trainer) -> Any:
        """The trainer's TensorBoard writer when it has a TensorBoardLogger, otherwise our own."""
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                return logger.experiment
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # Not trainer.log_dir: it broadcasts, and only global rank 0 gets here.
            logger_dir = next((lg.log_dir for lg in trainer.loggers if getattr(lg, "log_dir", None)), None)
            self._writer = SummaryWriter(os.path.join(logger_dir or trainer.default_root_dir, "lightning_sac_logs"))
        return self._writer

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._measurement.abandon()  # when fit ended inside the measured step
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"plan": None if self.plan is None else self.plan.to_json()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        text = state_dict.get("plan")
        self._restored = None if text is None else Plan.from_json(text)

    # ------------------------------------------------------------------ planning
    def _example_batch(self, trainer: pl.Trainer) -> Any:
        if self.example_batch is not None:
            return self.example_batch
        if self.example_batch_fn is not None:
            return self.example_batch_fn()
        loaders: Any = trainer.train_dataloader  # the user's loader, or a collection of them
        while isinstance(loaders, (list, tuple, dict)):
            loaders = next(iter(loaders.values() if isinstance(loaders, dict) else loaders), None)
        if loaders is None:
            raise ValueError("AutoSAC found no training dataloader; pass example_batch or example_batch_fn.")
        # Starting a DataLoader iterator draws its base seed from the global generator: fork it, so that the
        # run's random numbers (shuffling, dropout) are the same with AutoSAC as without.
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            return next(iter(loaders))

    def _target(self, trainer: pl.Trainer) -> DeviceSpec:
        if self.device is not None:
            return get_device_spec(self.device)
        return get_device_spec("auto" if trainer.strategy.root_device.type == "cuda" else "cpu")

    def _settings(self, trainer: pl.Trainer, spec: DeviceSpec) -> tuple[float, int, str]:
        budget = self.budget_gb if self.budget_gb is not None else self.budget_fraction * spec.memory_gib  # type: ignore[operator]
        return float(budget), trainer.world_size, "replicated"

    def _matches(self, plan: Plan, pl_module: pl.LightningModule, batch: Any, trainer: pl.Trainer) -> str | None:
        """Why ``plan`` does not fit this run, or ``None`` when it does."""
        spec = self._target(trainer)
        budget, world_size, sharding = self._settings(trainer, spec)
        if plan.fingerprint != fingerprint_of(pl_module, (batch,)):
            return "the model structure or batch shapes changed"
        if (plan.device, plan.world_size, plan.sharding) != (spec.name, world_size, sharding):
            return "the device, world size or sharding changed"
        if plan.budget_bytes != int(budget * _GIB):
            return "the budget changed"
        return None

    def _reuse(self, pl_module: pl.LightningModule, batch: Any, trainer: pl.Trainer) -> Plan | None:
        sources = [("the checkpoint", self._restored)]
        if self.plan_path is not None and self.plan_path.exists():
            sources.append((str(self.plan_path), Plan.from_json(self.plan_path.read_text())))
        for where, plan in sources:
            if plan is None:
                continue
            reason = self._matches(plan, pl_module, batch, trainer)
            if reason is None:
                rank_zero_info(f"AutoSAC: reusing the plan from {where}; no profiling needed.")
                return plan
            rank_zero_warn(f"AutoSAC: the plan from {where} does not fit this run ({reason}); planning again.")
        return None

    def _make_plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> Plan | None:
        spec = self._target(trainer)
        budget, world_size, sharding = self._settings(trainer, spec)

        settings = FitStepSettings(spec, self.estimate, self.replace_existing)
        try:
            profile = profile_lightning_step(trainer, pl_module, batch, settings)
        except ProfilingError as err:
            if self.strict:
                raise
            rank_zero_warn(f"AutoSAC could not profile the training step, so training runs without a plan: {err}")
            return None
        self.profiled = True
        self.profile = profile
        own = profile.checkpointed_modules or profile.checkpoint_callers
        if own:
            how = (
                "AutoSAC(replace_existing=True) or model.gradient_checkpointing_disable()"
                if profile.checkpointing_flags
                else "removing its torch.utils.checkpoint calls"
            )
            rank_zero_info(
                f"AutoSAC: the model already checkpoints {len(own)} module(s) itself ({', '.join(own[:3])}"
                f"{', ...' if len(own) > 3 else ''}); the plan leaves them, and every module around or inside "
                f"them, alone. To let AutoSAC choose instead: {how}."
            )
        if len(tensors_of(batch)) == 0:
            warnings.warn("AutoSAC's example batch holds no tensors.", stacklevel=2)

        def solve(budget_gb: float) -> Plan:
            return solve_plan(
                profile,
                budget_gb,
                world_size=world_size,
                sharding=sharding,
                candidates=self.candidates,
                n_segments=self.n_segments,
                time_limit_s=self.solver_time_limit_s,
                backend=self.backend,
            )

        try:
            return solve(budget)
        except BudgetError as err:
            if self.strict:
                raise
            rank_zero_warn(f"{err} strict=False: applying the minimum-memory plan instead.")
            return solve(err.minimum_bytes * 1.001 / _GIB)
