"""Which modules a plan may checkpoint (candidates), and why the others may not."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_sac.dryrun import ModelProfile, ModuleOpStats, ModuleProfile
from lightning_sac.errors import BudgetError
from lightning_sac.plan import device_reserve
from lightning_sac.solver.masks import masked_view
from lightning_sac.solver.memory_model import activation_windows, recompute_state_bytes
from lightning_sac.solver.recompute import output_indices, recompute_transient, rerun_output_bytes
from lightning_sac.solver.tradeoff import ModuleTradeoff, module_tradeoff

__all__ = [
    "Candidate",
    "budget_error",
    "excluded_reason",
    "find_candidates",
    "forward_temporaries",
    "more_candidates_hint",
    "op_stats",
    "related",
]


@dataclass(frozen=True)
class Candidate:
    """A module the solver may checkpoint.

    Attributes:
        fqn: The module.
        window: Timeline indices of its forward's end and its backward's start.
        retained: Activation bytes its forward leaves alive without checkpointing, its output excluded.
        transient: What a recompute of it holds at once besides its activations, with every op rerun: the bound
            (:func:`~lightning_sac.solver.recompute.recompute_transient`; a plan's prediction uses its policy's).
        transient_line: ``(bytes, bytes per unit of discard ratio)``: a line through that quantity along the
            trade-off's order, never above ``transient`` within the module's discard range, which the solver
            plans with first (the bound is the fallback when a plan's own figures exceed the budget).
        tradeoff: Its trade-off curve and fit.
    """

    fqn: str
    window: tuple[int, int]
    retained: int
    transient: int
    tradeoff: ModuleTradeoff
    transient_line: tuple[float, float] = (0.0, 0.0)

    @property
    def min_discard(self) -> float:
        """Smallest discard ratio that frees anything: below it, SAC would keep more than autograd did."""
        acm = self.tradeoff.total_memory
        return max(0.0, (acm - self.retained) / acm) if acm else 1.0

    def freed(self, discard: float) -> float:
        """Bytes freed at a discard ratio: what autograd kept minus what the policy saves."""
        return self.retained - (1.0 - discard) * self.tradeoff.total_memory


def _matches(m: ModuleProfile, candidates: Sequence[Any] | None) -> bool:
    if candidates is None:
        return True
    for c in candidates:
        if isinstance(c, str) and fnmatch.fnmatchcase(m.fqn, c):
            return True
        if isinstance(c, type) and c.__name__ == m.module_type:
            return True
    return False


def excluded_reason(profile: ModelProfile, fqn: str) -> str | None:
    """Why module ``fqn`` must not be checkpointed by a plan, or ``None``.

    A module that runs under the model's own checkpointing, contains such a module or lies inside one, or
    whose forward opens a checkpoint region itself, would be recomputed twice under nested regions that the
    profile's op lists do not describe; one called with a KV cache that holds tokens would update it twice; one
    whose forward stores state computed from its inputs, or contains such a module, would be recomputed from the
    state its forward left (:attr:`ModelProfile.module_state`); one whose forward writes to one of its inputs in
    place would be recomputed from the written values (:attr:`ModelProfile.writes_input`).
    """
    for own in profile.checkpointed_modules:
        if related(own, fqn):
            return f"already checkpointed by the model ({own or '<root>'})"
    for caller in profile.checkpoint_callers:
        if fqn == caller or fqn == "" or caller.startswith(fqn + "."):
            return f"contains the model's own checkpointing ({caller or '<root>'})"
    for holder in profile.kv_cache_with_tokens:
        if related(holder, fqn):
            return f"called with a KV cache that holds tokens ({holder or '<root>'})"
    for holder, name in profile.module_state.items():
        if fqn == holder or fqn == "" or holder.startswith(fqn + "."):
            return f"its forward stores state computed from its inputs ({holder or '<root>'}.{name})"
    if fqn in profile.writes_input:
        return f"its forward writes to one of its inputs in place ({profile.writes_input[fqn]})"
    return None


def find_candidates(
    profile: ModelProfile,
    candidates: Sequence[Any] | None = None,
    n_segments: int = 2,
    backend: str = "sac",
    masks: bool = False,
) -> list[Candidate]:
    """Modules that can be checkpointed: with op stats, run once, with a backward, matching ``candidates``.

    Op stats exist for non-leaf modules and for leaves that run several allocating ops, such as ``nn.LSTM``.

    Modules that :func:`excluded_reason` names are left out.

    Args:
        profile: The profile.
        candidates: Module classes or fqn glob patterns (``"blocks.*"``); ``None`` allows every module.
        n_segments: Lines of each trade-off fit.
        backend: The backend the plan is for (what its recompute brings back).
        masks: Whether the trade-offs are of :func:`~lightning_sac.solver.masks.masked_view` (dropout noise may
            be kept as masks).
    """
    if candidates is not None:
        bad = [c for c in candidates if not isinstance(c, (str, type))]
        if bad:
            raise TypeError(f"candidates must be module classes or fqn glob patterns, got {bad!r}.")
    windows = activation_windows(profile)
    found = []
    lines: dict[tuple[object, ...], tuple[float, float]] = {}  # identical blocks share their transient line
    for fqn, m in profile.modules.items():
        if m.op_stats is None or m.calls != 1 or fqn not in windows or not _matches(m, candidates):
            continue
        if excluded_reason(profile, fqn) is not None:
            continue
        post, pre = m.memory["post_forward"], m.memory["pre_forward"]
        retained = max(0, post["activation"] - pre["activation"] - m.output_bytes)
        tradeoff = module_tradeoff(masked_view(m.op_stats, backend) if masks else m.op_stats, n_segments, backend)
        if tradeoff.total_memory == 0 or retained == 0:
            continue  # nothing to free
        state = recompute_state_bytes(profile, fqn, backend)
        bound = recompute_transient(m.op_stats, None, backend)
        if bound is None:  # a profile without op lifetimes
            bound = forward_temporaries(m) + rerun_output_bytes(m.op_stats, None, backend) + state
            found.append(Candidate(fqn, windows[fqn], retained, bound, tradeoff, (float(bound), 0.0)))
            continue
        # Everything _transient_line reads; the trade-offs are alive here, so their ids tell them apart.
        stats = m.op_stats
        key = (id(tradeoff), bound, len(stats.func_names), stats.recompute_stop, *map(tuple, _line_inputs(stats)))
        if key not in lines:
            lines[key] = _transient_line(stats, tradeoff, bound, backend)
        line = (lines[key][0] + state, lines[key][1])
        found.append(Candidate(fqn, windows[fqn], retained, bound + state, tradeoff, line))
    return found


def _transient_line(stats: ModuleOpStats, tradeoff: ModuleTradeoff, bound: int, backend: str) -> tuple[float, float]:
    """A line for a recompute's transient in the discard ratio: ``(bytes, bytes per unit of ratio)``.

    From the transient with nothing discarded, the lowest slope (negative when discarding lowers it) that
    reaches its value at each point of the greedy order, capped so that the line reaches ``bound`` (the
    transient with everything discarded) by the largest discard ratio. The transient
    at each point is :func:`~lightning_sac.solver.recompute.recompute_transient` of the policy there, kept up to date
    as each unit's ops turn to recompute (:class:`_Transient`) instead of recounted from scratch: that was
    quadratic in a module's ops, minutes for the root of an 80-layer model.
    """
    views = set(stats.view_like_ops)
    policy = [0 if i in views else 1 for i in range(len(stats.func_names))]
    live = _Transient(stats, policy, backend)
    base = float(live.value())
    slope: float | None = None
    for unit, (discard, _) in zip(tradeoff.order, tradeoff.curve[1:], strict=True):
        for i in unit.ops:
            live.recompute(i)
        if discard > 0:
            point = (live.value() - base) / discard
            slope = point if slope is None else max(slope, point)
    slope = slope or 0.0  # may be negative: discarding more usually lowers what the recompute rebuilds at once
    if tradeoff.max_discard > 0:
        slope = min(slope, (bound - base) / tradeoff.max_discard)
    return base, slope


def _line_inputs(stats: ModuleOpStats) -> tuple[list[Any], ...]:
    return stats.freed_at, stats.memory, stats.output_ops, stats.view_like_ops, stats.inplace_ops, stats.freed_parts


class _Transient:
    """:func:`~lightning_sac.solver.recompute.recompute_transient` of a policy that only ever turns ops to recompute.

    That function follows the rerun op by op: ``alive[t]`` here is its running total once the rerun's events at
    index ``t`` are in (the saved temporaries, less the discarded activations not rebuilt by ``t``, plus the
    rerun temporaries alive at ``t``), and the transient is the highest ``alive[t]`` plus the rerun output's
    bytes. Turning op ``i`` to recompute updates slices: a temporary leaves the saved ones (everywhere) and,
    before the early stop, is alive over ``[i, freed)``; an activation before the early stop (not an output) is
    missing before ``i``.
    """

    def __init__(self, stats: ModuleOpStats, policy: list[int], backend: str) -> None:
        self.stats, self.policy, self.backend = stats, [1] * len(policy), backend
        self.stop = len(stats.func_names) if stats.recompute_stop is None else stats.recompute_stop
        self.outputs = output_indices(stats)
        self.alive = np.zeros(max([len(stats.func_names), *stats.freed_at]) + 1, dtype=np.int64)
        # Parts the forward freed: for SAC (the graph backend keeps its bound, which counts the op whole).
        self.parts = {i: (n, at) for i, n, at in stats.freed_parts} if backend == "sac" else {}
        for i, (m, freed) in enumerate(zip(stats.memory, stats.freed_at, strict=True)):
            if freed >= 0:  # every temporary saved, and every part of an op its forward freed
                self.alive[: self._cached_until(i, freed)] += m
        for i, (n, at) in self.parts.items():
            self.alive[: self._cached_until(i, at)] += n
        self.scratch = np.zeros_like(self.alive)  # the workspace of each rerun op, for the moment it runs
        self.workspace = stats.rerun_workspaces(self.stop)  # as recompute_transient counts them
        for i, saved in enumerate(policy):
            if not saved:
                self.recompute(i)

    def _cached_until(self, i: int, freed: int) -> int:
        """Until which index of the rerun a saved output of op ``i`` that the forward freed at ``freed`` is alive.

        SAC's rerun takes it out of the cache at ``i``, and it dies where the forward's did; one past the early
        stop, or on the graph backend (bounded from above), stays for the whole rerun.
        """
        return freed if self.backend == "sac" and i < self.stop else len(self.alive)

    def recompute(self, i: int) -> None:
        """Turn op ``i`` to recompute (nothing when it already is)."""
        if not self.policy[i]:
            return
        self.policy[i] = 0
        if i in self.workspace:
            self.scratch[i] = self.workspace[i]
        size, freed = self.stats.memory[i], self.stats.freed_at[i]
        if not size:
            return
        if i in self.parts:  # the checkpoint's cache no longer keeps it
            self.alive[: self._cached_until(i, self.parts[i][1])] -= self.parts[i][0]
        if freed >= 0:
            self.alive[: self._cached_until(i, freed)] -= size
            if i < self.stop:
                if i < freed:
                    self.alive[i:freed] += size
                elif freed < i:
                    self.alive[freed:i] -= size
        elif i < self.stop and i not in self.outputs:
            part, at = self.parts.get(i, (0, i))  # a part its forward freed is a temporary of the rerun
            self.alive[:i] -= size - part
            self.alive[i:at] += part

    def value(self) -> int:
        """The transient of the current policy, bytes."""
        return int((self.alive + self.scratch).max()) + rerun_output_bytes(self.stats, self.policy, self.backend)


def more_candidates_hint(profile: ModelProfile) -> str:
    """The end of a BudgetError's advice: how more modules could be checkpointed."""
    own = profile.checkpointed_modules or profile.checkpoint_callers
    if not own:
        return ", or allow more checkpoint candidates."
    names = ", ".join(f or "<root>" for f in own[:3]) + (", ..." if len(own) > 3 else "")
    text = (
        f". The model already checkpoints {len(own)} module(s) itself ({names}), and lightning-sac plans around "
        "them: it checkpoints no module that is, contains or lies inside one."
    )
    if profile.checkpointing_flags:
        return text + (
            " To let lightning-sac choose instead, turn Hugging Face's checkpointing off "
            "(model.gradient_checkpointing_disable()) or pass replace_existing=True (AutoSAC, profile_model)."
        )
    return text + " To let lightning-sac choose instead, remove the model's own torch.utils.checkpoint calls."


_SMALL = 2**30 // 10  # below a tenth of a GiB, a budget error's figures are in MiB: three decimals of GiB hide them


def _size(nbytes: float) -> str:
    """``nbytes`` for a budget error: GiB with three decimals, MiB below :data:`_SMALL`.

    A budget of 0.0018 GiB below a minimum of 0.0019 printed both as "0.002 GiB".
    """
    return f"{nbytes / 2**30:.3f} GiB" if nbytes >= _SMALL else f"{nbytes / 2**20:.3f} MiB"


def budget_error(
    profile: ModelProfile,
    budget_gb: float,
    world_size: int,
    sharding: str,
    peak: int,
    plain: int,
    fragmentation: int,
    plain_fragmentation: int,
) -> BudgetError:
    """The error for a budget below the least-memory plan: its tensors, and its own reserve with its fragmentation."""
    reserve = device_reserve(profile, world_size, fragmentation_bytes=fragmentation)
    plain_reserve = device_reserve(profile, world_size, fragmentation_bytes=plain_fragmentation)
    kept = f" (the tensors' {_size(peak)} plus {_size(reserve.total)} the device holds besides: {reserve.describe()})"
    # A budget in the unit its figures are printed in, and as given when that is MiB (``budget_gb=0.001``).
    budget = _size(budget_gb * 2**30) + (f" (budget_gb={budget_gb:g})" if budget_gb * 2**30 < _SMALL else "")
    return BudgetError(
        f"A budget of {budget} per device is below the minimum achievable peak of "
        f"{_size(peak + reserve.total)}{kept if reserve.total else ''} (the unconstrained "
        f"peak is {_size(plain + plain_reserve.total)} on {profile.device.name}, world size "
        f"{world_size}, {sharding}). Raise the budget, use a smaller "
        "batch or shorter sequences, "
        + (
            "shard parameters, gradients and optimizer state over N devices (sharding='sharded', world_size=N)"
            if sharding == "replicated"
            else f"shard them over more devices (world_size above {world_size})"
        )
        + more_candidates_hint(profile),
        minimum_bytes=peak + reserve.total,
        unconstrained_bytes=plain + plain_reserve.total,
    )


def forward_temporaries(m: ModuleProfile) -> int:
    """Bytes the module's forward allocates and frees again, for a profile without op lifetimes (an older one)."""
    return max(0, sum(m.memory["peak_forward"].values()) - sum(m.memory["post_forward"].values()))


def op_stats(profile: ModelProfile, fqn: str) -> ModuleOpStats:
    """The op stats of a candidate (which has them)."""
    stats = profile.modules[fqn].op_stats
    assert stats is not None  # candidates are modules with op stats
    return stats


def related(a: str, b: str) -> bool:
    """Whether modules ``a`` and ``b`` are the same, or one contains the other."""
    return a == "" or b == "" or b.startswith(a + ".") or a.startswith(b + ".")
