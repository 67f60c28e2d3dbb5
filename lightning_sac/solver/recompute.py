"""What backward really recomputes under a policy, per backend, from a module's op graph.

A policy marks ops to recompute, but neither backend reruns all of them:

* ``"sac"``: ``torch.utils.checkpoint`` reruns the module's forward in order, serving saved ops from its
  cache, and stops (early stop, on by default) as soon as autograd has packed the last tensor the forward had
  packed. Ops after that point never rerun, whatever the policy says.
* ``"graph"``: :mod:`lightning_sac.apply.graph.backend` realizes only what backward unpacks, recursing through missing
  ancestors; an op whose output neither backward nor a recomputed descendant reads is never rerun. A saved op
  whose storage a later in-place op of the module overwrote counts as missing, as it does at run time.

SAC reruns an op only when the recompute needs its values (:func:`skipped_ops`): a matrix product whose output
nothing backward unpacks reads, other than for its shape (dropout's ``empty_like`` on a CPU makes the noise of
the MLP's last ``addmm`` that way), gets an empty tensor of its output's layout instead
(:mod:`lightning_sac.apply.skip_dead`).

Both read :class:`ModuleOpStats`' graph facts (``recompute_stop``, ``packed_ops``, ``op_inputs``, ``mutated_later``);
for a profile without them (an older version's), every op the policy recomputes counts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Annotations only: the profiler imports this module, and lightning_sac.apply's package import must stay light.
    from lightning_sac.dryrun import ModuleOpStats

from lightning_sac.plan import check_backend

__all__ = [
    "output_indices",
    "output_op",
    "recompute_transient",
    "rerun_output_bytes",
    "fixed_overhead_ms",
    "overhead_ms",
    "whole_overhead_ms",
    "recompute_costs",
    "recompute_ms",
    "recomputed_ops",
    "SHAPE_ONLY_OPS",
    "SKIPPABLE_OPS",
    "skipped_ops",
]

#: Ops whose outputs depend on their tensor arguments' sizes, strides, dtypes and devices, not their values.
SHAPE_ONLY_OPS: frozenset[str] = frozenset(
    f"aten.{name}.default"
    for name in (
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
    )
)

#: Ops a SAC recompute may skip when nothing needs their values: pure, one dense output whose layout the meta
#: kernel gives exactly, and costly enough for the skip to matter (matrix products).
SKIPPABLE_OPS: frozenset[str] = frozenset(
    {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default"}
)


def _stop(stats: ModuleOpStats) -> int:
    # How many ops a SAC recompute reruns; all of them when the profile does not say.
    return len(stats.func_names) if stats.recompute_stop is None else stats.recompute_stop


def skipped_ops(stats: ModuleOpStats, policy: Sequence[int] | None) -> list[int]:
    """Indices of the ops a SAC recompute under ``policy`` skips: nothing it reruns needs their values.

    What a recompute must run: every op it reruns (not saved, before the early stop) whose output autograd
    packed, that draws random numbers (the generator must advance as in the forward), writes in place or
    writes state, and the rerun ops these read, transitively, except through an op that reads only its input's
    layout (:data:`SHAPE_ONLY_OPS`). A saved op's inputs are not read: SAC serves its output from the cache.
    Of the rest, :data:`SKIPPABLE_OPS` are skipped. With ``policy`` ``None`` every op counts as rerun. Empty
    for a profile without the op graph.
    """
    n = len(stats.func_names)
    if stats.recompute_stop is None or len(stats.op_inputs) != n:
        return []
    stop = stats.recompute_stop
    rerun = [i < stop and (policy is None or not policy[i]) for i in range(n)]
    seeds = set(stats.packed_ops) | set(stats.rand_ops) | set(stats.stateful_ops)
    seeds |= {i for i, _ in stats.inplace_ops}
    needed: set[int] = set()
    todo = [i for i in seeds if i < n and rerun[i]]
    while todo:
        i = todo.pop()
        if i in needed:
            continue
        needed.add(i)
        if stats.func_names[i] not in SHAPE_ONLY_OPS:
            todo.extend(j for j in stats.op_inputs[i] if rerun[j] and j not in needed)
    return [i for i in range(n) if rerun[i] and i not in needed and stats.func_names[i] in SKIPPABLE_OPS]


def recompute_costs(stats: ModuleOpStats, backend: str = "sac") -> list[float]:
    """What recomputing each op costs the ``"sac"`` backend, ms: its runtime, or 0 when it never reruns.

    An op never reruns past the early stop, or on SAC when even a full recompute skips it (:func:`skipped_ops`).
    The cost is additive over ops, so the trade-off curves and the op knapsack use it as is: an upper bound of
    a policy's SAC cost (saving ops can only make more ops skippable). The graph backend reruns what backward
    unpacks and all its ancestors, layout-only reads included: for it, the cost stays the op's runtime.
    """
    check_backend(backend)
    stop = _stop(stats)
    skipped = set(skipped_ops(stats, None)) if backend == "sac" else set()
    return [t if i < stop and i not in skipped else 0.0 for i, t in enumerate(stats.runtimes)]


def recomputed_ops(stats: ModuleOpStats, policy: Sequence[int], backend: str = "sac") -> list[int]:
    """Indices of the ops one backward reruns when the module runs under ``policy`` (1 = save, 0 = recompute).

    Raises:
        ValueError: ``policy`` does not have one entry per op, or an unknown ``backend``.
    """
    check_backend(backend)
    n = len(stats.func_names)
    if len(policy) != n:
        raise ValueError(f"The policy has {len(policy)} decisions for a module of {n} ops; it must have one per op.")
    if backend == "sac" or stats.recompute_stop is None:
        skipped = set(skipped_ops(stats, policy)) if backend == "sac" else set()
        return [i for i in range(_stop(stats)) if not policy[i] and i not in skipped]
    # An op that writes in place to a tensor from outside the module, or writes state it does not return, is
    # always kept (running it twice would write twice), and a kept op later overwritten in place is missing again.
    kept = {i for i in range(n) if policy[i]} | {i for i, parent in stats.inplace_ops if parent == i}
    # A stateful op's outputs are served as saved even when one of them is overwritten later (BatchNorm's output
    # by an in-place ReLU): graph AC tracks staleness per output, and backward needs only its statistics.
    fresh = (kept - set(stats.mutated_later)) | set(stats.stateful_ops)
    writes, root = _writes_by_storage(stats)
    rerun: set[int] = set()
    todo = [i for i in stats.packed_ops if i not in fresh]
    while todo:
        i = todo.pop()
        if i in rerun:
            continue
        rerun.add(i)
        for j in stats.op_inputs[i]:
            if j not in fresh and j not in rerun:
                todo.append(j)
            # A storage written in place holds every write before i: replayed back to the latest kept one.
            for w in reversed([w for w in writes.get(root(j), []) if w < i]):
                if w in fresh:
                    break
                if w not in rerun:
                    todo.append(w)
    return sorted(rerun)


def _writes_by_storage(stats: ModuleOpStats) -> tuple[dict[int, list[int]], Callable[[int], int]]:
    """Per op that made a storage, the in-place ops writing it, in order; per op, its storage's maker."""
    parents = {op: parent for op, parent in stats.inplace_ops if op != parent}
    writes: dict[int, list[int]] = {}
    for op, parent in parents.items():
        writes.setdefault(parent, []).append(op)
    views = set(stats.view_like_ops)

    def root(i: int) -> int:
        for _ in range(len(stats.func_names)):
            if i in parents:
                i = parents[i]
            elif i in views and stats.op_inputs[i]:
                i = stats.op_inputs[i][0]
            else:
                break
        return i

    return {k: sorted(v) for k, v in writes.items()}, root


def output_op(stats: ModuleOpStats) -> int | None:
    """Index of the module's output op, the last that made a storage of its output (``None``: no such op).

    For an older profile, the last op that is neither a view nor in place.
    """
    if stats.output_ops:
        return stats.output_ops[-1]
    skip = set(stats.view_like_ops) | {op for op, _ in stats.inplace_ops}
    return next((i for i in range(len(stats.func_names) - 1, -1, -1) if i not in skip), None)


def output_indices(stats: ModuleOpStats) -> set[int]:
    """Indices of the ops that made the module's output: its output ops and :func:`output_op`.

    Their storages outlive the module's forward because the module returns them, not because its backward
    keeps them, so a recompute does not rebuild them as discarded activations.
    """
    out = output_op(stats)
    return set(stats.output_ops) | ({out} if out is not None else set())


def rerun_output_bytes(stats: ModuleOpStats, policy: Sequence[int] | None, backend: str = "sac") -> int:
    """Bytes of a second copy of the module's output that one backward's recompute allocates.

    SAC reruns the module's code up to its early stop, which usually lies after the output op (the op that last
    packs a tensor is the output's own matmul): a recomputed output op then makes a new output beside the one the
    forward returned, alive until the recompute stops. The graph backend reruns only ancestors of packed tensors.
    With ``policy`` ``None``, the output op counts as recomputed (the bound the solver plans with).
    """
    check_backend(backend)
    i = output_op(stats)
    if backend != "sac" or i is None or i >= _stop(stats) or (policy is not None and policy[i]):
        return 0
    return stats.memory[i]


def recompute_transient(
    stats: ModuleOpStats, policy: Sequence[int] | None, backend: str = "sac", masked: Sequence[int] = ()
) -> int | None:
    """How far a recompute of the module rises above the activations the plain step keeps, bytes, or ``None``.

    The memory model counts the module's plain activations at its backward's start; a recompute replaces those
    the policy discards as it reruns them, in the forward's order. At rerun op ``i`` the module holds, beyond
    the plain activations: the temporaries the policy saves (the checkpoint's cache keeps them from the forward
    on), the rerun ops' temporaries alive at ``i`` (for the same span as in the forward: the rerun is the same
    code), a second copy of the module's output once its output op reran (:func:`rerun_output_bytes`), less the
    discarded activations not yet rebuilt, and while a rerun op runs, its kernel's workspace
    (:attr:`ModuleOpStats.workspace_ops`). The highest of that over the rerun is the answer: it may be negative
    when a recompute never rebuilds everything at once. With ``policy`` ``None`` every op counts as rerun.
    Counted for SAC (which reruns everything up to its early stop), an upper bound for the graph backend (which
    reruns only what backward unpacks and frees each node's cache at its last consumer). ``None`` for a profile
    without op lifetimes. The ``bool`` masks of ``masked`` ops (:attr:`ModuleDecision.masked_ops`) are held from
    the rerun's start until their op has copied them back.
    """
    n = len(stats.func_names)
    if len(stats.freed_at) != n:
        return None
    stop = _stop(stats)
    outputs = output_indices(stats)
    saved = [i for i in range(n) if policy is not None and policy[i]]
    parts = {i: (n, at) for i, n, at in stats.freed_parts} if backend == "sac" else {}  # graph: its old bound
    masks = dict(zip(stats.mask_ops, stats.mask_bytes, strict=False))
    # What the cache keeps: saved temporaries, saved parts the forward freed, the masks.
    saved_temps = sum(stats.memory[i] if stats.freed_at[i] >= 0 else parts.get(i, (0,))[0] for i in saved)
    saved_temps += sum(masks[i] for i in masked)
    events: list[tuple[int, int]] = [(i + 1, -masks[i]) for i in masked]  # freed once the op has copied it back
    if backend == "sac":
        # SAC's rerun takes a saved output out of the cache when it reaches the op: from then on the rerun's own
        # references hold it, which drop where the forward's did (one past the early stop stays cached).
        events += [(stats.freed_at[i], -stats.memory[i]) for i in saved if i < stop and stats.freed_at[i] >= 0]
        events += [(parts[i][1], -parts[i][0]) for i in saved if i < stop and i in parts]
    missing = 0  # discarded activations not rebuilt yet
    scratch = {i: w for i, w in stats.rerun_workspaces(stop).items() if policy is None or not policy[i]}
    events += [(i, 0) for i in scratch]  # a moment at each such op, after its index's frees and allocations
    for i in range(stop):
        m = stats.memory[i]
        if not m or (policy is not None and policy[i]):
            continue
        if stats.freed_at[i] >= 0:
            events += [(i, m), (stats.freed_at[i], -m)]
        elif i not in outputs:
            part, at = parts.get(i, (0, i))  # a part the forward freed is a temporary of the rerun
            missing += m - part
            events += [(i, m), (at, -part)]
    alive = peak = saved_temps - missing  # before the rerun's first op
    events.sort()  # at one index, frees (negative) first
    for k, (index, delta) in enumerate(events):
        alive += delta
        peak = max(peak, alive)
        if index in scratch and (k + 1 == len(events) or events[k + 1][0] != index):
            peak = max(peak, alive + scratch[index])  # the op runs: its inputs and output alive, and its workspace
    return peak + rerun_output_bytes(stats, policy, backend)


def recompute_ms(
    stats: ModuleOpStats, policy: Sequence[int], backend: str = "sac", masked: Sequence[int] = ()
) -> float:
    """Runtime of :func:`recomputed_ops`, ms: what the policy adds to one backward on ``backend``.

    A ``masked`` op (its noise copied back from a ``bool`` mask, :attr:`ModuleDecision.masked_ops`) costs the copy.
    """
    copies = dict(zip(stats.mask_ops, stats.mask_ms, strict=False))
    copies = {i: copies[i] for i in masked}
    return sum(copies.get(i, stats.runtimes[i]) for i in recomputed_ops(stats, policy, backend))


def fixed_overhead_ms(
    stats: ModuleOpStats, backend: str, per_op_us: Sequence[float], measured: Sequence[float] | None = None
) -> float:
    """The backend's host time for wrapping the module whatever its policy, ms.

    ``measured`` is the module's ``[fixed_ms, recompute_factor]`` from
    :attr:`ModuleProfile.measured_overhead`; when given, its ``fixed_ms`` is the answer. Otherwise it is
    estimated from ``per_op_us``, ``[forward_us, rerun_us]`` from :attr:`ModelProfile.backend_overhead_us`:
    every op of the forward pays ``forward_us``, and SAC also reruns every op up to its early stop.
    """
    check_backend(backend)
    if measured:
        return measured[0]
    forward_us, rerun_us = per_op_us
    rerun = _stop(stats) * rerun_us if backend == "sac" else 0.0
    return (len(stats.func_names) * forward_us + rerun) / 1e3


def whole_overhead_ms(
    stats: ModuleOpStats,
    policy: Sequence[int],
    backend: str,
    measured: Sequence[float] | None = None,
    masked: Sequence[int] = (),
) -> float | None:
    """The host time of a policy that saves nothing run as a plain checkpoint, besides its recompute, ms.

    The SAC backend runs such a policy without a selective policy's dispatch modes
    (:mod:`lightning_sac.apply.sac`). Measured, it is the module's ``whole_ms`` (the third entry of
    :attr:`ModuleProfile.measured_overhead`, recompute included) less the predicted recompute: negative when
    the real rerun is faster than the profile's op times. Unmeasured, none: a plain checkpoint adds no work per
    op. ``None`` when ``policy`` saves or masks something or the backend is not SAC.
    """
    if backend != "sac" or any(policy) or masked:
        return None
    if measured and len(measured) > 2:
        return measured[2] - recompute_ms(stats, policy, backend)
    return 0.0


def overhead_ms(
    stats: ModuleOpStats,
    policy: Sequence[int],
    backend: str,
    per_op_us: Sequence[float],
    measured: Sequence[float] | None = None,
    masked: Sequence[int] = (),
) -> float:
    """The backend's host time for the module under ``policy``, besides :func:`recompute_ms`, ms.

    A policy that saves nothing runs as a plain checkpoint on SAC: :func:`whole_overhead_ms`. Otherwise, with
    ``measured`` (``[fixed_ms, recompute_factor, ...]``), ``fixed_ms`` and the share of the recompute that the
    module's real rerun took beyond the profile's op times: ``(recompute_factor - 1) * recompute_ms``.
    Otherwise :func:`fixed_overhead_ms`, and for the graph backend ``rerun_us`` per recomputed op.
    """
    whole = whole_overhead_ms(stats, policy, backend, measured, masked)
    if whole is not None:
        return whole
    fixed = fixed_overhead_ms(stats, backend, per_op_us, measured)
    if measured:
        return fixed + (measured[1] - 1.0) * recompute_ms(stats, policy, backend, masked)
    if backend == "sac":
        return fixed
    return fixed + len(recomputed_ops(stats, policy, backend)) * per_op_us[1] / 1e3
