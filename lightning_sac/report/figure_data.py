"""The numbers the figures draw, gathered apart from drawing them so that tests and users can read them.

Every figure of a plan is per device: it uses the plan's world size and sharding for both the step with the
plan and the step without it, exactly as the solver counted them
(:func:`~lightning_sac.solver.memory_model.device_bytes`), so the two curves and their legends compare like
with like.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_sac.dryrun import ModelProfile
from lightning_sac.plan import ByteUnit, Plan, choose_unit, separating_unit
from lightning_sac.solver import activation_windows, ddp_bucket_bytes, device_model, find_candidates

__all__ = [
    "ModuleBars",
    "ModuleMemory",
    "PeakComposition",
    "StepMemory",
    "measured_unit",
    "module_memory",
    "peak_composition",
    "predicted_step_memory",
    "step_memory",
    "top_modules",
]


def measured_unit(peak_bytes: int, budget_bytes: int | None) -> ByteUnit:
    """The unit of a measured step's numbers: as a plan table would choose it, the peak apart from the budget."""
    if budget_bytes is None:
        return choose_unit([peak_bytes])
    return separating_unit(choose_unit([peak_bytes, budget_bytes]), budget_bytes, [peak_bytes])


def predicted_step_memory(profile: ModelProfile, plan: Plan, *, applied: bool = True) -> list[int]:
    """Predicted bytes on one device at each timeline event's peak, with ``plan`` applied or not.

    Both use the plan's world size and sharding: ``applied=False`` is the plain step on the same devices.
    """
    freed = {f: d.freed_bytes for f, d in plan.decisions.items()} if applied else {}
    windows = activation_windows(profile)
    on_device = device_model(profile, plan.world_size, plan.sharding)  # the solver's model of one device
    out = []
    for k, e in enumerate(profile.timeline[:-1]):
        value = on_device(k, e.peak_after or e.at)
        kept: dict[int, int] = {}  # the inputs checkpoints keep that the plain step has freed by now, by their free
        for f, b in freed.items():
            if f in windows and windows[f][0] <= k < windows[f][1]:
                value -= b  # what the checkpoint frees
                kept.update((at, n) for at, n in profile.modules[f].freed_inputs if at <= k)
        out.append(value + sum(kept.values()))  # an input several checkpoints keep (a mask), once
    return out


@dataclass(frozen=True)
class StepMemory:
    """Predicted memory on one device across the step, without and with the plan.

    Attributes:
        without: Bytes at each module boundary (timeline event) of the plain step.
        with_plan: Bytes at the same boundaries with the plan applied.
        phases: ``(boundary index, phase name)`` where forward, backward and the optimizer step begin.
        world_size: The plan's world size, which both curves use.
        sharding: The plan's sharding, which both curves use.
    """

    without: list[int]
    with_plan: list[int]
    phases: list[tuple[int, str]]
    world_size: int
    sharding: str


def step_memory(profile: ModelProfile, plan: Plan) -> StepMemory:
    """The data of the ``memory_across_step`` figure."""
    phases = [(k, e.name) for k, e in enumerate(profile.timeline[:-1]) if e.kind == "phase"]
    return StepMemory(
        without=predicted_step_memory(profile, plan, applied=False),
        with_plan=predicted_step_memory(profile, plan),
        phases=phases,
        world_size=plan.world_size,
        sharding=plan.sharding,
    )


def top_modules(profile: ModelProfile, plan: Plan, n: int) -> list[str]:
    """The checkpointed modules, then the other candidates with the most retained activation memory, ``n`` in all."""
    others = sorted((c for c in find_candidates(profile) if c.fqn not in plan.decisions), key=lambda c: -c.retained)
    return (list(plan.decisions) + [c.fqn for c in others])[: max(n, len(plan.decisions))]


@dataclass(frozen=True)
class ModuleBars:
    """Bytes on one device per module, by category, without and with the plan (one entry per module).

    Attributes:
        fqns: The modules.
        parameters: Parameter bytes (divided by the world size when sharded).
        gradients: Gradient bytes (likewise).
        optimizer_state: Optimizer state bytes (likewise).
        activations_without: Activation bytes the module's forward leaves alive without the plan.
        activations_with: The same with the plan.
    """

    fqns: list[str]
    parameters: list[int]
    gradients: list[int]
    optimizer_state: list[int]
    activations_without: list[int]
    activations_with: list[int]


@dataclass(frozen=True)
class PeakComposition:
    """What one device holds at the step's predicted peak, by part, so that the parts add up to the plan's figure.

    :attr:`peak_bytes` is the plan's tensor peak (``predicted_peak_bytes`` with the plan,
    ``unconstrained_peak_bytes`` without) and :attr:`total` the device's: that plus the plan's CUDA reserve. The
    parameters, gradients and optimizer state are the profile's at the moment of the peak (each shared out as the
    plan shards them); the activations are the rest of the peak.

    Attributes:
        peak_bytes: The tensors' peak on one device: the sum of the four tensor parts.
        parameters: Parameter and buffer bytes at the peak.
        gradients: Gradient bytes at the peak, DDP's gradient buckets included.
        optimizer_state: Optimizer state bytes at the peak.
        activations: The rest of the peak: activations, the temporaries of the op running, the batch (and under
            FSDP the parameters and gradients the running units hold unsharded).
        reserve: The plan's reserve (CUDA context, NCCL, cuBLAS workspaces, fragmentation); 0 for the CPU.
    """

    peak_bytes: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    reserve: int

    @property
    def total(self) -> int:
        """The device's peak: the tensors' peak and the reserve."""
        return self.peak_bytes + self.reserve


@dataclass(frozen=True)
class ModuleMemory:
    """The data of the ``memory_per_module`` figure: the largest modules, and the whole model's peak apart.

    The whole model holds every parameter and every activation, so on the modules' scale it would dwarf them; it
    is shown on its own axis as what the device holds at the step's peak, without and with the plan.

    Attributes:
        modules: The checkpointed modules and the largest other candidates, without the root and without the
            modules inside a checkpointed one.
        without: The whole model at the peak of the step without the plan; ``None`` for a profile without a
            timeline.
        with_plan: The same at the peak with the plan.
    """

    modules: ModuleBars
    without: PeakComposition | None
    with_plan: PeakComposition | None


def _share(n: int, plan: Plan) -> int:
    """A module's parameter, gradient or optimizer state bytes on one device."""
    return -(-n // plan.world_size) if plan.sharding == "sharded" else n


def _inside(fqn: str, plan: Plan) -> bool:
    """Whether ``fqn`` lies inside a checkpointed module: its share of what that frees is not known by module."""
    return any(fqn.startswith(d + ".") for d in plan.decisions if d)


def _freed_within(fqn: str, freed: dict[str, int]) -> int:
    """What the checkpointed modules that are ``fqn`` or lie inside it free: ``fqn``'s activations hold theirs."""
    return sum(b for d, b in freed.items() if d == fqn or d.startswith(fqn + "."))


def module_memory(profile: ModelProfile, plan: Plan, n: int = 12) -> ModuleMemory:
    """The ``n`` first modules of :func:`top_modules`, and the whole model's peak apart (see :class:`ModuleMemory`).

    Left out of the ``n``: the root, and the modules inside a checkpointed one (the plan frees their
    activations as part of their parent's; the parent's bar shows it). A module that contains checkpointed ones
    shows, with the plan, its activations less what they free.
    """
    retained = {c.fqn: c.retained for c in find_candidates(profile)}
    freed = {f: d.freed_bytes for f, d in plan.decisions.items()}

    def bars(fqns: list[str], with_plan: list[int]) -> ModuleBars:
        ms = [profile.modules[f] for f in fqns]
        return ModuleBars(
            fqns=fqns,
            parameters=[_share(m.parameter_bytes, plan) for m in ms],
            gradients=[_share(m.gradient_bytes, plan) for m in ms],
            optimizer_state=[_share(m.optimizer_state_bytes, plan) for m in ms],
            activations_without=[retained.get(f, 0) for f in fqns],
            activations_with=with_plan,
        )

    fqns = [f for f in top_modules(profile, plan, len(profile.modules)) if f and not _inside(f, plan)][:n]
    modules = bars(fqns, [max(0, retained.get(f, 0) - _freed_within(f, freed)) for f in fqns])
    return ModuleMemory(
        modules=modules,
        without=peak_composition(profile, plan, applied=False),
        with_plan=peak_composition(profile, plan),
    )


def peak_composition(profile: ModelProfile, plan: Plan, *, applied: bool = True) -> PeakComposition | None:
    """The whole model at the step's peak on one device, with ``plan`` applied or not (see :class:`PeakComposition`).

    The moment of the peak is the highest boundary of :func:`predicted_step_memory` (or the profile's peak with
    the model's KV caches on, when the plan's unplanned peak is that one); ``None`` for a profile without a
    timeline.
    """
    peak = plan.predicted_peak_bytes if applied else plan.unconstrained_peak_bytes
    curve = predicted_step_memory(profile, plan, applied=applied)
    if not curve:
        return None
    k = max(range(len(curve)), key=curve.__getitem__)
    event = profile.timeline[k]
    snapshot = event.peak_after or event.at
    if not applied and profile.kv_cache_peak is not None and peak != curve[k]:
        # The model without a plan runs its KV caches: its peak is the second dry run's, one snapshot.
        snapshot = profile.kv_cache_peak
    bucket = ddp_bucket_bytes(profile, plan.world_size) if plan.sharding == "replicated" else 0
    # Each part is capped by what the parts before it leave of the peak, so that they add up to it exactly.
    parameters = min(peak, _share(snapshot["parameter"], plan) + snapshot["buffer"])
    gradients = min(peak - parameters, _share(snapshot["gradient"], plan) + bucket)
    optimizer_state = min(peak - parameters - gradients, _share(snapshot["optimizer_state"], plan))
    return PeakComposition(
        peak_bytes=peak,
        parameters=parameters,
        gradients=gradients,
        optimizer_state=optimizer_state,
        activations=peak - parameters - gradients - optimizer_state,
        reserve=sum(plan.reserve.values()),
    )
