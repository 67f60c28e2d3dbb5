"""How :class:`~lightning_sac.AutoSAC` plans: the target and settings, reusing a plan, and profiling and solving.

Split from the callback's Lightning hooks (:mod:`lightning_sac.lightning.callback`): this is what a plan is made from
and
when a plan at hand fits the run.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_sac.adapters import compiled_parts
from lightning_sac.devices import DeviceSpec, target_device_spec
from lightning_sac.dryrun import ModelProfile, fingerprint_of, loop_signature, placeholder_message, tensors_of
from lightning_sac.errors import ProfilingError
from lightning_sac.lightning.compiled_budget import inductor_fit, lightning_step_tracer, plan_compiled
from lightning_sac.lightning.fit_planning import (
    first_training_batch,
    own_checkpointing_message,
    read_plan_file,
    solve_or_minimum,
)
from lightning_sac.lightning.fit_step import FitStepSettings, profile_lightning_step
from lightning_sac.plan import Plan
from lightning_sac.sharding import is_sharded
from lightning_sac.solver import solve_plan

__all__ = ["PlanningMixin"]

_GIB = 2**30


class PlanningMixin:
    """AutoSAC's planning: the attributes it reads are AutoSAC's arguments (see :class:`~lightning_sac.AutoSAC`)."""

    budget_gb: float | None
    budget_fraction: float | None
    device: Any
    estimate: str
    candidates: Any
    backend: str
    n_segments: int
    solver_time_limit_s: float
    plan_path: Path | None
    strict: bool
    example_batch: Any
    example_batch_fn: Any
    replace_existing: bool
    profile: ModelProfile | None
    profiled: bool
    _restored: Plan | None

    def _example_batch(self, trainer: pl.Trainer) -> Any:
        if self.example_batch is not None:
            return self.example_batch
        if self.example_batch_fn is not None:
            return self.example_batch_fn()
        return first_training_batch(trainer)

    def _target(self, trainer: pl.Trainer) -> DeviceSpec:
        return target_device_spec(self.device, trainer.strategy.root_device)

    def _settings(self, trainer: pl.Trainer, spec: DeviceSpec) -> tuple[float, int, str]:
        budget = self.budget_gb if self.budget_gb is not None else self.budget_fraction * spec.memory_gib  # type: ignore[operator]
        if budget > spec.memory_gib and not getattr(self, "_said_budget_above_memory", False):
            self._said_budget_above_memory = True  # once per callback, not per planned batch shape
            rank_zero_warn(
                f"AutoSAC: budget_gb={budget:g} is more than {spec.name}'s {spec.memory_gib:g} GiB: a plan for it may "
                f"not fit on the device. Pass budget_gb at most {math.floor(spec.memory_gib * 10) / 10:g}, or "
                "budget_fraction=0.9 for 90% of the device."
            )
        sharded = is_sharded(trainer.strategy.model or trainer.lightning_module) is not None
        world = trainer.world_size
        if isinstance(trainer.strategy, ModelParallelStrategy) and not sharded:
            # Tensor parallelism alone: no DDP wraps the model, so no gradient buckets; every rank's shards are in
            # the profile's per-rank copy already (sharding.tensor_parallel).
            world = 1
        return float(budget), world, "sharded" if sharded else "replicated"

    def _matches(self, plan: Plan, pl_module: pl.LightningModule, batch: Any, trainer: pl.Trainer) -> str | None:
        """Why ``plan`` does not fit this run, or ``None`` when it does."""
        spec = self._target(trainer)
        budget, world_size, sharding = self._settings(trainer, spec)
        loop = loop_signature(trainer.accumulate_grad_batches, manual=not pl_module.automatic_optimization)
        if plan.fingerprint != fingerprint_of(pl_module, (batch,), loop=loop):
            return "the model structure, batch shapes or training loop (accumulate_grad_batches, manual) changed"
        if (plan.device, plan.world_size, plan.sharding) != (spec.name, world_size, sharding):
            return "the device, world size or sharding changed"
        if plan.budget_bytes != int(budget * _GIB):
            return "the budget changed"
        return None

    def _reuse(self, pl_module: pl.LightningModule, batch: Any, trainer: pl.Trainer) -> Plan | None:
        sources = [("the checkpoint", self._restored)]
        if self.plan_path is not None and self.plan_path.exists():
            sources.append((str(self.plan_path), read_plan_file(self.plan_path)))
        for where, plan in sources:
            if plan is None:
                continue
            reason = self._matches(plan, pl_module, batch, trainer)
            if reason is None:
                rank_zero_info(f"AutoSAC: reusing the plan from {where}; no profiling needed.")
                return plan
            rank_zero_warn(f"AutoSAC: the plan from {where} does not fit this run ({reason}); planning again.")
        return None

    def _make_plan(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *, replanning: bool = False
    ) -> Plan | None:
        spec = self._target(trainer)
        budget, world_size, sharding = self._settings(trainer, spec)

        settings = FitStepSettings(spec, self.estimate, self.replace_existing)
        try:
            profile = profile_lightning_step(trainer, pl_module, batch, settings)
        except ProfilingError as err:
            if self.strict:
                raise
            # A failed re-plan keeps the plan applied before (shape_plans says so and for which shapes).
            outcome = " for a larger batch" if replanning else ", so training runs without a plan"
            rank_zero_warn(f"AutoSAC could not profile the training step{outcome}: {err}")
            return None
        told = self.profile.placeholders if self.profile is not None else []
        self.profiled = True
        self.profile = profile
        if profile.placeholders and profile.placeholders != told:  # once, not again for each re-plan
            rank_zero_info(placeholder_message(profile.placeholders))
        own = own_checkpointing_message(profile)
        if own is not None:
            rank_zero_info(own)
        if len(tensors_of(batch)) == 0:
            warnings.warn("AutoSAC's example batch holds no tensors.", stacklevel=2)

        if inductor_fit(trainer, pl_module):
            return self._compiled_plan(trainer, pl_module, batch, profile, budget)
        return solve_or_minimum(
            profile,
            budget,
            strict=self.strict,
            world_size=world_size,
            sharding=sharding,
            candidates=self.candidates,
            n_segments=self.n_segments,
            time_limit_s=self.solver_time_limit_s,
            backend=self.backend,
            # Under torch.compile the partitioner and inductor place a plan's recompute themselves, and a plan
            # of partial discards measured 18% over its prediction where the one-fit plan kept its budget
            # (tests/test_loop_compile.py): compiled fits keep the one-fit plan.
            refine=not compiled_parts(pl_module),
            # A traced region cannot copy masks back in its recompute: compiled fits redraw their dropout noise.
            masks=not compiled_parts(pl_module),
        )

    def _compiled_plan(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, profile: ModelProfile, budget: float
    ) -> Plan:
        """The plan for a step inductor compiles, landed on the budget by the compiled step's own memory.

        The solver ranks with the eager profile; the budget it is given is searched until the compiled step, traced
        with the plan applied, is predicted within the real one (:mod:`lightning_sac.lightning.compiled_budget`).
        """

        def solve(solver_bytes: int) -> Plan:
            return solve_plan(
                profile,
                solver_bytes / _GIB,
                world_size=1,
                candidates=self.candidates,
                n_segments=self.n_segments,
                time_limit_s=self.solver_time_limit_s,
                backend=self.backend,
                refine=False,  # as for any compiled fit (below): each plan is traced instead
                masks=False,
            )

        plan, search = plan_compiled(
            profile, int(budget * _GIB), solve, lightning_step_tracer(trainer, pl_module, batch), strict=self.strict
        )
        rank_zero_info(
            f"AutoSAC: the compiled step (inductor) is predicted at {search.plain_peak_bytes / 2**20:.1f} MiB without "
            f"a plan, {plan.predicted_peak_bytes / 2**20:.1f} MiB with it ({len(search.rounds)} plans traced in "
            f"{search.trace_s:.1f} s)."
        )
        if not search.fits:
            rank_zero_warn(
                f"AutoSAC: no plan traced for the compiled step is predicted within the budget of {budget:g} GiB; "
                "strict=False: applying the lowest one."
            )
        return plan
