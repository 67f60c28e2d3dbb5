"""Plans by batch shape for one fit: the cache, and the shapes every rank's step must be planned for.

:class:`~lightning_sac.AutoSAC` keeps every plan of a fit with the
:class:`~lightning_sac.lightning.batch_shapes.Signature`
it was made for. Before each training batch, the ranks agree on the dim-wise largest signature of their
batches (:func:`step_maximum`, two small all-reduces); when the applied plan does not cover it, a cached plan
that does is applied, or global rank 0 plans for it (:func:`planning_batch` brings it a real batch of those
shapes) and every rank applies what it broadcasts. Every rank takes the same branch from the same agreed
signature and the same cache, so every rank enters the same collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_sac.errors import LightningSACError
from lightning_sac.lightning.batch_shapes import Signature, grow_batch, map_tensors, signature_of
from lightning_sac.plan import Plan

__all__ = [
    "PlanningBatch",
    "ShapeChange",
    "ShapePlan",
    "ShapePlans",
    "follow_batch",
    "on_rank_zero",
    "planning_batch",
    "step_maximum",
    "to_cpu",
]


@dataclass
class ShapePlan:
    """A plan and the batch signature it was made for: it covers every batch that signature covers.

    Attributes:
        signature: The shapes the plan was made for.
        plan: The plan.
    """

    signature: Signature
    plan: Plan


class ShapePlans:
    """The plans of a fit by batch shape; :attr:`current` is the applied one.

    Attributes:
        entries: Every plan of the fit (and those restored from a checkpoint), with its signature.
        current: The applied plan, or ``None`` before the first plan and when training runs without one.
        replans: How many times this fit planned again for a batch outside every cached plan.
        switches: How many times this fit applied another cached plan.
        unplanned: Shapes planning failed for (``strict=False``): batches they cover keep the applied plan, as
            the warning said.
    """

    def __init__(self) -> None:
        self.entries: list[ShapePlan] = []
        self.current: ShapePlan | None = None
        self.replans = 0
        self.switches = 0
        self.unplanned: list[Signature] = []

    def start(self, signature: Signature, plan: Plan | None) -> None:
        """The fit's first plan (``None``: the fit trains without a plan, and shapes are not followed)."""
        self.replans = self.switches = 0
        self.unplanned = []
        if plan is None:
            self.current = None
        else:
            self.use(signature, plan)

    def covers(self, signature: Signature) -> bool:
        """Whether the applied plan holds for a batch of ``signature``."""
        return self.current is not None and self.current.signature.covers(signature)

    def covering(self, signature: Signature) -> ShapePlan | None:
        """The cached plan made for the smallest shapes that cover ``signature``, or ``None``."""
        fits = [e for e in self.entries if e.signature.covers(signature)]
        return min(fits, key=lambda e: e.signature.numel, default=None)

    def use(self, signature: Signature, plan: Plan) -> ShapePlan:
        """Record ``plan`` as made for ``signature`` (replacing a plan for the same shapes) and as the applied one."""
        entry = next((e for e in self.entries if e.signature == signature), None)
        if entry is None:
            entry = ShapePlan(signature, plan)
            self.entries.append(entry)
        entry.plan = plan
        self.current = entry
        return entry

    def retain(self, reason_to_drop: Callable[[ShapePlan], str | None]) -> list[str]:
        """Drop the entries for which ``reason_to_drop`` gives a reason (a restored plan for other settings)."""
        reasons, kept = [], []
        for entry in self.entries:
            reason = reason_to_drop(entry)
            if reason is None:
                kept.append(entry)
            else:
                reasons.append(f"{entry.signature.describe()}: {reason}")
        self.entries = kept
        if self.current is not None and self.current not in kept:
            self.current = None
        return reasons

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state: every entry's signature and plan, and which is applied."""
        return {
            "entries": [{"signature": e.signature.to_dict(), "plan": e.plan.to_dict()} for e in self.entries],
            "current": None if self.current is None else self.entries.index(self.current),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the counters start again at 0)."""
        self.entries = [
            ShapePlan(Signature.from_dict(e["signature"]), Plan.from_dict(e["plan"])) for e in state.get("entries", [])
        ]
        index = state.get("current")
        self.current = None if index is None else self.entries[index]
        self.replans = self.switches = 0
        self.unplanned = []


def _distributed(world_size: int) -> bool:
    return world_size > 1 and dist.is_available() and dist.is_initialized()


def step_maximum(local: Signature, world_size: int, device: torch.device) -> Signature:
    """The dim-wise maximum of every rank's batch signature: the same on every rank.

    A collective when ``world_size > 1``: every rank calls it before every training batch. It costs two small
    all-reduces (the structure, then the dims); the signatures themselves are gathered only when the
    structures differ, to say how.

    Raises:
        LightningSACError: The ranks' batches hold different tensors (raised on every rank).
    """
    if not _distributed(world_size):
        return local
    n, h = len(local.dims), local.structure_hash()
    # max(x) and max(-x) in one all-reduce: equal on every rank exactly when max == min.
    head = torch.tensor([n, -n, h, -h], dtype=torch.int64, device=device)
    dist.all_reduce(head, op=dist.ReduceOp.MAX)
    n_max, n_min, h_max, h_min = head.tolist()
    if (n_max, h_max) != (-n_min, -h_min):
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, local.to_dict())
        ranks = "; ".join(f"rank {r}: {Signature.from_dict(d).describe()}" for r, d in enumerate(gathered))
        raise LightningSACError(
            f"AutoSAC plans one plan for every rank, so the ranks' batches must hold the same tensors (places, "
            f"dtypes and number of dims); they differ at this step: {ranks}. Make every rank's collate function "
            "return the same keys and dtypes."
        )
    if n == 0:
        return local
    dims = torch.tensor(local.dims, dtype=torch.int64, device=device)
    dist.all_reduce(dims, op=dist.ReduceOp.MAX)
    return local.with_dims([int(d) for d in dims.tolist()])


def to_cpu(batch: Any) -> Any:
    """``batch`` with its tensors on the CPU: how the dry run is given batches (as the loader's first one)."""
    return map_tensors(batch, lambda t: t.detach().cpu())


@dataclass
class PlanningBatch:
    """The real batch global rank 0 plans with for a step's maximum signature.

    Attributes:
        batch: On global rank 0 the batch (on the CPU), elsewhere ``None``.
        rank: The rank whose batch it is.
        grown: Whether no rank's batch had the maximum's shapes, so the batch is that rank's grown to them
            (:func:`~lightning_sac.lightning.batch_shapes.grow_batch`).
    """

    batch: Any
    rank: int
    grown: bool


def planning_batch(batch: Any, target: Signature, strategy: Any, world_size: int) -> PlanningBatch:
    """Bring global rank 0 a real batch of ``target``'s shapes (a collective when ``world_size > 1``).

    The lowest rank whose batch has exactly ``target``'s shapes sends it; when none has (the ranks' batches are
    larger in different dims), the rank whose batch has most elements sends it and rank 0 grows it.
    """
    local = signature_of(batch)
    if not _distributed(world_size):
        grown = local != target
        return PlanningBatch(grow_batch(to_cpu(batch), target) if grown else to_cpu(batch), 0, grown)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, local.to_dict())
    signatures = [Signature.from_dict(d) for d in gathered]
    exact = [r for r, s in enumerate(signatures) if s == target]
    source = exact[0] if exact else max(range(world_size), key=lambda r: (signatures[r].numel, -r))
    rank = strategy.global_rank
    # Every rank knows the source: when it is rank 0, nothing needs to travel.
    sent = to_cpu(batch) if rank == source else None
    received = sent if source == 0 else strategy.broadcast(sent, src=source)
    if rank != 0:
        return PlanningBatch(None, source, not exact)
    return PlanningBatch(received if exact else grow_batch(received, target), source, not exact)


def on_rank_zero(strategy: Any, is_global_zero: bool, make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``make`` on global rank 0 and give its result to every rank.

    When ``make`` raises, rank 0 tells the other ranks (they are waiting for its broadcast) and raises its own
    error with the full traceback; the others raise a :class:`LightningSACError` quoting it.
    """
    payload: dict[str, Any] = {}
    if is_global_zero:
        try:
            payload = make()
        except Exception as err:
            strategy.broadcast({"error": type(err).__name__, "message": str(err)}, src=0)
            raise
    payload = strategy.broadcast(payload, src=0)
    if "error" in payload:
        raise LightningSACError(f"AutoSAC planning failed on global rank 0: {payload['error']}: {payload['message']}")
    return payload


@dataclass
class ShapeChange:
    """What :func:`follow_batch` decided: apply ``entry``'s plan before the batch, and tell the user ``message``.

    Attributes:
        entry: The plan to apply and the shapes it is for.
        message: Why, for the user (``""``: nothing to say).
        planned: Whether global rank 0 profiled for it (``False``: it came from the cache).
        failed: Planning failed (``strict=False``): ``entry`` is the plan applied before; ``message`` warns.
    """

    entry: ShapePlan
    message: str
    planned: bool
    failed: bool = False


def follow_batch(
    plans: ShapePlans, trainer: Any, batch: Any, batch_idx: int, make_plan: Callable[[Any], Plan | None]
) -> ShapeChange | None:
    """Before a training batch: ``None`` when the applied plan covers every rank's batch, else the plan to apply.

    Call it on every rank before every batch (it holds collectives); ``make_plan(batch)`` runs on global rank 0
    only, on a real CPU batch of the step's maximum shapes, with the applied plan already removed from the model.
    """
    assert plans.current is not None
    world_size = trainer.world_size
    target = step_maximum(signature_of(batch), world_size, trainer.strategy.root_device)
    if plans.covers(target) or any(s.covers(target) for s in plans.unplanned):
        return None
    before = plans.current
    why = before.signature.outside(target)
    cached = plans.covering(target)
    if cached is not None:
        plans.current = cached
        plans.switches += 1
        said = plans.switches > 1
        return ShapeChange(cached, "" if said else _switch_message(batch_idx, why, cached), planned=False)
    source = planning_batch(batch, target, trainer.strategy, world_size)
    payload = on_rank_zero(
        trainer.strategy,
        trainer.is_global_zero,
        lambda: {"plan": None if (p := make_plan(source.batch)) is None else p.to_dict()},
    )
    whose = f"the largest batch of this step (rank {source.rank}'s)" if world_size > 1 else "the batch"
    grown = (
        f", grown from rank {source.rank}'s batch by repeating its last entries (no rank's batch has every largest dim)"
        if source.grown
        else ""
    )
    if payload["plan"] is None:
        plans.unplanned.append(target)
        message = (
            f"AutoSAC could not plan for training batch {batch_idx}: {whose} is outside the plan ({why}). It "
            f"keeps the plan made for {before.signature.describe()}: batches up to {target.describe()} may "
            "exceed the budget. Pass max_shapes (or example_batch_fn) with the largest batch to plan for it."
        )
        return ShapeChange(before, message, planned=False, failed=True)
    plans.replans += 1
    entry = plans.use(target, Plan.from_dict(payload["plan"]))
    message = (
        f"AutoSAC re-planned before training batch {batch_idx}: {whose} is outside the plan made for "
        f"{before.signature.describe()} ({why}). The new plan is for {target.describe()}{grown}; it is cached, "
        "so batches it covers cost nothing from now on. To plan once for the worst case, pass max_shapes or "
        "example_batch_fn."
    )
    return ShapeChange(entry, message, planned=True)


def _switch_message(batch_idx: int, why: str, entry: ShapePlan) -> str:
    return (
        f"AutoSAC switched plans before training batch {batch_idx} ({why}): it applies the cached plan made for "
        f"{entry.signature.describe()}. It switches between cached plans as batch shapes vary, without profiling "
        "(said once)."
    )
