"""What the Hugging Face Trainer's callback and the Fabric function share: a loop's step, dry-run and planned.

A loop outside Lightning's Trainer describes its step as a :class:`LoopStep` (the loss as the loop computes it,
its optimizer, mixed precision and gradient accumulation); :func:`plan_for_step` dry-runs it on fake tensors and
solves for the budget, and :func:`plan_on_rank_zero` does that on global rank 0 only and hands every rank the
same plan (or the same error) through the loop's own broadcast.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_sac.devices import DeviceSpec, target_device_spec
from lightning_sac.dryrun import ModelProfile
from lightning_sac.errors import ProfilingError
from lightning_sac.lightning import broadcast_from_rank_zero, check_autosac_args, solve_or_minimum
from lightning_sac.plan import Plan
from lightning_sac.profiling import profile_step

__all__ = [
    "LoopStep",
    "PlanSettings",
    "first_batch",
    "optimizer_factory",
    "plan_for_step",
    "plan_json",
    "plan_of",
    "plan_on_rank_zero",
]


@dataclass(frozen=True)
class PlanSettings:
    """AutoSAC's planning arguments, as the integrations take them (see :class:`~lightning_sac.AutoSAC`)."""

    budget_gb: float | None = None
    budget_fraction: float | None = None
    device: str | DeviceSpec | None = None
    estimate: str = "roofline"
    candidates: Sequence[Any] | None = None
    backend: str = "sac"
    n_segments: int = 2
    solver_time_limit_s: float = 30.0
    strict: bool = True
    replace_existing: bool = False

    def check(self, flags: Mapping[str, object], example_batch: Any) -> None:
        """Check every argument as AutoSAC does (``flags``: the caller's boolean ones), before anything runs.

        Raises:
            TypeError: An argument of the wrong type.
            ValueError: A value out of range, an unknown name, or a combination that is not allowed.
        """
        check_autosac_args(
            budget_gb=self.budget_gb,
            budget_fraction=self.budget_fraction,
            device=self.device,
            estimate=self.estimate,
            candidates=self.candidates,
            backend=self.backend,
            n_segments=self.n_segments,
            solver_time_limit_s=self.solver_time_limit_s,
            plan_path=None,
            flags={"strict": self.strict, "replace_existing": self.replace_existing, **flags},
            example_batch=example_batch,
            example_batch_fn=None,
        )

    def target(self, device: torch.device) -> DeviceSpec:
        """The device planned for: the one named, else the loop's own (its real properties on CUDA)."""
        return target_device_spec(self.device, device)

    def budget(self, spec: DeviceSpec) -> float:
        """The budget in GiB per device."""
        if self.budget_gb is not None:
            return float(self.budget_gb)
        assert self.budget_fraction is not None  # the arguments' check asks for one of the two
        return self.budget_fraction * spec.memory_gib


@dataclass
class LoopStep:
    """One training step of a loop, as the dry run runs it.

    Attributes:
        compute_loss: ``compute_loss(model, batch)`` runs the forward and returns the loss the loop backpropagates.
        optimizer: The loop's optimizer (or ``None``); the dry run builds the same one for its fake copy.
        autocast_dtype: The dtype the loop autocasts its forward to (mixed precision), else ``None``.
        autocast_cache: Whether that autocast caches its casts of weights (``torch.autocast``'s default, and
            accelerate's and Fabric's).
        accumulate: Micro-batches per optimizer step; the last one, which holds the most, is dry-run.
        world_size: Processes training; more than one runs under DDP here.
        data_parallel: The model runs under ``DistributedDataParallel`` (its gradient buckets are planned for).
        compiled: The model runs under ``torch.compile``: planned as AutoSAC plans compiled fits.
        share: Objects reachable from the model that the dry run must not copy.
    """

    compute_loss: Callable[[nn.Module, Any], torch.Tensor]
    optimizer: torch.optim.Optimizer | None
    autocast_dtype: torch.dtype | None = None
    autocast_cache: bool = True
    accumulate: int = 1
    world_size: int = 1
    data_parallel: bool = False
    compiled: bool = False
    share: tuple[object, ...] = field(default_factory=tuple)


def optimizer_factory(optimizer: Any, model: nn.Module) -> Callable[[nn.Module], torch.optim.Optimizer | None]:
    """Builds ``optimizer``'s twin for a copy of ``model``: its class and parameter groups, found by name.

    ``optimizer`` may be wrapped (accelerate's ``AcceleratedOptimizer``, Fabric's ``_FabricOptimizer``: each keeps
    the torch optimizer as ``.optimizer``).

    Raises:
        ProfilingError: The optimizer holds a parameter that is not ``model``'s.
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    if inner is None:
        return lambda copy_: None
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    groups = []
    for group in inner.param_groups:
        foreign = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if foreign:
            raise ProfilingError(
                f"The optimizer ({type(inner).__name__}) holds {len(foreign)} parameter(s) that are not the model's "
                f"(shapes {foreign[:3]}): AutoSAC dry-runs the model's step with the same optimizer built for a copy "
                "of the model, so every parameter it steps must be the model's."
            )
        settings = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        groups.append((settings, [names[id(p)] for p in group["params"]]))

    def make(copy_: nn.Module) -> torch.optim.Optimizer:
        params = dict(copy_.named_parameters(remove_duplicate=False))
        # Each group carries every hyperparameter (lr, betas, fused, ...), so the class's defaults decide nothing.
        return type(inner)([{**settings, "params": [params[n] for n in ps]} for settings, ps in groups])

    return make


def _generators(loader: Any) -> list[torch.Generator]:
    """The random generators a loader's samplers draw from: a first batch taken for planning must not move them."""
    found, todo = [], [loader, getattr(loader, "base_dataloader", None)]
    while todo:
        obj = todo.pop()
        if obj is None:
            continue
        gen = getattr(obj, "generator", None)
        if isinstance(gen, torch.Generator):
            found.append(gen)
        todo += [getattr(obj, name, None) for name in ("sampler", "batch_sampler")]
    return found


def first_batch(loader: Any) -> Any:
    """The first batch of ``loader``, drawn without moving the run's random numbers.

    For accelerate's prepared loaders, the loader it wraps is read (its own iterator would synchronize the ranks'
    random states and register itself as the active loader); the global generator is forked and the samplers'
    generators are put back, so the run shuffles and drops out as it would without the plan.

    Raises:
        ValueError: ``loader`` is ``None`` or empty.
    """
    if loader is None:
        raise ValueError("AutoSAC found no training dataloader to take the batch to plan for; pass example_batch.")
    base = getattr(loader, "base_dataloader", loader)
    generators = _generators(loader)
    states = [g.get_state() for g in generators]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            return next(iter(base))
    except StopIteration:
        raise ValueError("AutoSAC: the training dataloader is empty; there is no batch to plan for.") from None
    finally:
        for gen, state in zip(generators, states, strict=True):
            gen.set_state(state)


def plan_for_step(
    model: nn.Module, batch: Any, step: LoopStep, settings: PlanSettings, device: torch.device
) -> tuple[Plan, ModelProfile]:
    """Dry-run ``step`` on ``batch`` for the target device and solve for the budget.

    Raises:
        ProfilingError: The step cannot be dry-run.
        BudgetError: The budget is below the minimum and ``settings.strict`` is set.
    """
    spec = settings.target(device)
    profile = profile_step(
        model,
        (batch,),
        lambda fake, inputs: step.compute_loss(fake, inputs[0]),
        make_optimizer=optimizer_factory(step.optimizer, model),
        device=spec,
        estimate=settings.estimate,
        share=step.share,
        autocast_dtype=step.autocast_dtype,
        autocast_cache=step.autocast_cache,
        # With accumulation the step's gradients live through its forward (the earlier micro-batches made them);
        # without, the loop sets them to None after the optimizer step: Lightning's order and a plain step's.
        lightning_order=step.accumulate > 1,
        replace_existing=settings.replace_existing,
        accumulate_grad_batches=step.accumulate,
    )
    profile.data_parallel = step.data_parallel
    plan = solve_or_minimum(
        profile,
        settings.budget(spec),
        strict=settings.strict,
        world_size=step.world_size,
        sharding="replicated",
        candidates=settings.candidates,
        n_segments=settings.n_segments,
        time_limit_s=settings.solver_time_limit_s,
        backend=settings.backend,
        # As AutoSAC plans compiled fits (lightning_sac.lightning.planning): one fit per module, no masks.
        refine=not step.compiled,
        masks=not step.compiled,
    )
    return plan, profile


def plan_on_rank_zero(
    is_rank_zero: bool, make: Callable[[], Plan | None], broadcast: Callable[[Any], Any]
) -> Plan | None:
    """``make()`` on global rank 0, its plan handed to every rank by ``broadcast`` (an object from rank 0).

    Raises:
        LightningSACError: Planning failed on rank 0 (raised there with its own traceback; on the other ranks
            with its type and message), so that no rank trains without the plan the others apply.
    """
    return plan_of(broadcast_from_rank_zero(is_rank_zero, lambda: {"plan": plan_json(make())}, broadcast))


def plan_json(plan: Plan | None) -> str | None:
    """A plan as a broadcast carries it."""
    return None if plan is None else plan.to_json()


def plan_of(payload: dict[str, Any]) -> Plan | None:
    """The plan a broadcast carried under ``"plan"``."""
    return None if payload["plan"] is None else Plan.from_json(payload["plan"])
