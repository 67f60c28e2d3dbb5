"""A profile of a model with ``k + extra`` identical layers, from the profiles of ``k`` and ``k + 1`` of them.

Each list of the profile (modules, timeline, orders, the allocation trace's events and storages, the op lists of the
modules that run the layers) is read as records (:class:`~lightning_sac.profiling.extend.Item`) and extended by
:func:`~lightning_sac.profiling.extend.extend_list`; a layer's number in a name (``model.layers.7.mlp``) is one of
a record's numbers. What the extension does not follow (MoE routing, stand-ins, FSDP units, the model's own
checkpointing, KV caches) must be absent: :func:`extend_profile` raises :class:`NotExtensible` otherwise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from lightning_sac.dryrun import (
    CATEGORIES,
    PHASES,
    AllocationTrace,
    ModelProfile,
    ModuleOpStats,
    ModuleProfile,
    TimelineEvent,
    replay,
)
from lightning_sac.profiling.extend import Item, NotExtensible, affine, extend_list
from lightning_sac.profiling.op_items import op_items, op_stats_of
from lightning_sac.profiling.op_items import op_numbers as _op_numbers
from lightning_sac.profiling.timeline_peaks import module_peaks, step_peak

__all__ = ["extend_profile", "unsupported"]

# Names of modules (lists, or a dict by name) the extension does not follow; each must be empty.
_ABSENT = (
    "checkpointed_modules",
    "checkpoint_callers",
    "checkpointing_flags",
    "replaced_checkpointing",
    "kv_cache_with_tokens",
    "module_state",
    "writes_input",
    "placeholders",
    "routing",
)
_SAME = ("device", "estimate", "input_signature", "backend_overhead_us", "data_parallel")
_MODULE_INTS = ("parameter_bytes", "buffer_bytes", "gradient_bytes", "optimizer_state_bytes", "input_bytes")


class _Names:
    """Names with a layer's number in them, as a template and the number."""

    def __init__(self, blocks: str) -> None:
        self._re = re.compile(r"(^|(?<=:))" + re.escape(blocks + ".") + r"(\d+)(?=\.|$)")
        self._blocks = blocks

    def split(self, name: str) -> tuple[str, int]:
        m = self._re.search(name)
        if m is None:
            return name, 0
        return name[: m.start(2)] + "#" + name[m.end(2) :], int(m.group(2))

    @staticmethod
    def join(template: str, layer: int | float) -> str:
        return template.replace("#", str(int(layer)), 1)


def _snapshot(s: dict[str, int]) -> tuple[int, ...]:
    return tuple(s[c] for c in CATEGORIES) if s else ()


def _unsnapshot(nums: tuple[int | float, ...]) -> dict[str, int]:
    return {c: int(v) for c, v in zip(CATEGORIES, nums, strict=True)} if nums else {}


class _Reader:
    """The records of one profile."""

    def __init__(self, profile: ModelProfile, names: _Names, long_ops: set[str]) -> None:
        self.p, self.names, self.long_ops = profile, names, long_ops
        self.trace = profile.allocations

    def modules(self) -> list[Item]:
        out = []
        module_ops = {} if self.trace is None else self.trace.module_ops
        for fqn, m in self.p.modules.items():
            template, layer = self.names.split(fqn)
            stats = m.op_stats
            # A layer's own op list is the same length in every layer: its ops are numbers of its record.
            ops = [] if fqn in self.long_ops or stats is None else op_items(stats)
            inline = None if stats is None or fqn in self.long_ops else (tuple(o.sig for o in ops), _flags(stats))
            stop = stats.recompute_stop if stats is not None else None
            sig = (
                template,
                m.module_type,
                m.is_leaf,
                inline,
                fqn in self.long_ops,
                stop is None,
                json.dumps(m.measured_overhead, sort_keys=True),
                len(m.freed_inputs),
                len(m.freed_outputs),
                fqn in module_ops,
            )
            nums = (
                layer,
                *(getattr(m, f) for f in _MODULE_INTS),
                m.output_bytes,
                *(v for p in PHASES for v in _snapshot(m.memory[p])),
                m.forward_ms,
                m.backward_ms,
                m.calls,
                *(x for pair in m.freed_inputs + m.freed_outputs for x in pair),
                *([module_ops[fqn]] if fqn in module_ops else []),
                *([stop] if stats is not None and stop is not None else []),
                *(x for o in ops for x in o.nums),
            )
            out.append(Item(sig, nums))
        return out

    def timeline(self) -> list[Item]:
        marks = [] if self.trace is None else self.trace.marks
        out = []
        for i, e in enumerate(self.p.timeline):
            template, layer = self.names.split(e.name)
            sig = (e.kind, template, len(e.peak_after))
            out.append(Item(sig, (layer, *_snapshot(e.at), *_snapshot(e.peak_after), *marks[i : i + 1])))
        return out

    def order(self, key: str) -> list[Item]:
        return [Item(t, (n,)) for t, n in map(self.names.split, getattr(self.p, key))]

    def events(self) -> list[Item]:
        t = self.trace
        assert t is not None
        return [Item((e >= 0, t.sizes[_s(e)], t.sharded[_s(e)]), (_s(e),)) for e in t.events]

    def storages(self) -> list[Item]:
        t = self.trace
        assert t is not None
        return [Item((size, sh), (op,)) for size, sh, op in zip(t.sizes, t.sharded, t.ops, strict=True)]

    def scalars(self) -> tuple[float, ...]:
        return (self.p.forward_ms, self.p.backward_ms, self.p.optimizer_ms)


def _s(e: int) -> int:
    return e if e >= 0 else -e - 1


def unsupported(p: ModelProfile) -> str | None:
    """What of a profile extending does not follow, or ``None``."""
    for name in _ABSENT:
        if getattr(p, name):
            return f"the profile has {name}, which extending does not follow"
    if p.sharded is not None:
        return "the profile has FSDP units, which extending does not follow"
    return None


def _check(a: ModelProfile, b: ModelProfile) -> None:
    for p in (a, b):
        reason = unsupported(p)
        if reason:
            raise NotExtensible(reason)
    for name in _SAME:
        if getattr(a, name) != getattr(b, name):
            raise NotExtensible(f"the profiles' {name} differ")
    if (a.allocations is None) != (b.allocations is None):
        raise NotExtensible("one profile has an allocation trace, the other not")


def _phases_of_events(p: ModelProfile) -> list[str]:
    """The step's phase at each event of the allocation trace."""
    assert p.allocations is not None
    phases, marks = p.timeline_phases(), p.allocations.marks
    out, phase, k = [], "", 0
    for t in range(len(p.allocations.events)):
        while k < len(marks) and marks[k] <= t:
            phase = phases[k]
            k += 1
        out.append(phase)
    return out


def extend_profile(a: ModelProfile, b: ModelProfile, blocks: str, extra: int) -> ModelProfile:
    """The profile of the model of ``a`` with ``extra`` more layers in its module list ``blocks`` (``b``: one more).

    Raises:
        NotExtensible: The two profiles do not differ by one layer's records.
    """
    _check(a, b)
    names = _Names(blocks)
    ancestors = [f for f in a.modules if f == "" or blocks.startswith(f + ".") or f == blocks]
    for p in (a, b):
        _check_peaks(p, ancestors)
    long_ops = {
        f
        for f, m in a.modules.items()
        if f in b.modules and m.op_stats is not None and len(m.op_stats.func_names) != _ops(b, f)
    }
    ra, rb = _Reader(a, names, long_ops), _Reader(b, names, long_ops)
    backward = [p == "backward" for p in b.timeline_phases()]

    def ext(read: Callable[[_Reader], list[Item]], desc: Callable[[int], bool] = lambda _: False) -> list[Item]:
        return extend_list(read(ra), read(rb), extra, desc)

    modules = ext(_Reader.modules)
    timeline = ext(_Reader.timeline, lambda j: backward[j])
    orders = {key: _order(ra, rb, key, extra) for key in (*_ORDERS, "kv_cache_off")}
    op_lists = {f: extend_list(op_items(_stats(a, f)), op_items(_stats(b, f)), extra) for f in sorted(long_ops)}
    forward_ms, backward_ms, optimizer_ms = affine(ra.scalars(), rb.scalars(), extra)
    trace = None
    if a.allocations is not None and b.allocations is not None:
        phase_b = _phases_of_events(b)
        events = ext(_Reader.events, lambda j: phase_b[j] == "backward")
        storages = ext(_Reader.storages)
        trace = AllocationTrace(
            events=[int(x.nums[0]) if x.sig[0] else -int(x.nums[0]) - 1 for x in events],  # type: ignore[index]
            sizes=[x.sig[0] for x in storages],  # type: ignore[index]
            sharded=[x.sig[1] for x in storages],  # type: ignore[index]
            ops=[int(x.nums[0]) for x in storages],
            marks=[int(x.nums[-1]) for x in timeline],
            alloc_conf=a.allocations.alloc_conf,
        )
    out = replace(
        a,
        modules=_modules(modules, op_lists, a, names, trace),
        timeline=[_event(x, names) for x in timeline],
        **{key: [names.join(x.sig, x.nums[0]) for x in items] for key, items in orders.items()},  # type: ignore[arg-type]
        forward_ms=forward_ms,
        backward_ms=backward_ms,
        optimizer_ms=optimizer_ms,
        allocations=trace,
        reserved_peak_bytes=0 if trace is None else replay(trace.events, trace.sizes, trace.config).reserved,
        kv_cache_peak=None,  # the peak of another step: the caller extends that step's profile for it
    )
    _set_peaks(out, ancestors)
    return out


def _set_peaks(p: ModelProfile, ancestors: list[str]) -> None:
    """The step's peak, and the peaks of the modules that run the layers, from the timeline (they can move)."""
    p.peak_breakdown, p.peak_location = step_peak(p)
    p.peak_bytes = sum(p.peak_breakdown.values())
    for fqn in ancestors:
        p.modules[fqn].memory.update(module_peaks(p, fqn))


def _check_peaks(p: ModelProfile, ancestors: list[str]) -> None:
    """Raise unless the peaks read from the timeline are the ones the dry run recorded."""
    breakdown, location = step_peak(p)
    if (breakdown, location) != (p.peak_breakdown, p.peak_location):
        raise NotExtensible(f"the step's peak read from the timeline, at {location}, is not the recorded one")
    for fqn in ancestors:
        for phase, snapshot in module_peaks(p, fqn).items():
            if snapshot != p.modules[fqn].memory[phase]:
                raise NotExtensible(f"the {phase} of {fqn!r} read from the timeline is not the recorded one")


_ORDERS = ("forward_pre_order", "forward_post_order", "backward_pre_order", "backward_post_order")


def _order(ra: _Reader, rb: _Reader, key: str, extra: int) -> list[Item]:
    down = key.startswith("backward")  # a backward order runs the last layer first
    return extend_list(ra.order(key), rb.order(key), extra, lambda _: down)


def _ops(p: ModelProfile, fqn: str) -> int:
    stats = p.modules[fqn].op_stats
    return -1 if stats is None else len(stats.func_names)


def _stats(p: ModelProfile, fqn: str) -> ModuleOpStats:
    stats = p.modules[fqn].op_stats
    assert stats is not None
    return stats


def _event(x: Item, names: _Names) -> TimelineEvent:
    sig: tuple[Any, ...] = x.sig  # type: ignore[assignment]
    kind, template, n_after = sig
    n = len(CATEGORIES)
    nums = x.nums
    return TimelineEvent(
        kind=kind,
        name=names.join(template, nums[0]),
        at=_unsnapshot(nums[1 : 1 + n]),
        peak_after=_unsnapshot(nums[1 + n : 1 + n + n_after]),
    )


def _modules(
    items: list[Item], op_lists: dict[str, list[Item]], a: ModelProfile, names: _Names, trace: AllocationTrace | None
) -> dict[str, ModuleProfile]:
    out = {}
    n_mem = len(PHASES) * len(CATEGORIES)
    for x in items:
        sig: tuple[Any, ...] = x.sig  # type: ignore[assignment]
        template, module_type, is_leaf, inline, long_ops, no_stop, overhead, n_in, n_out, has_ops = sig
        nums = list(x.nums)
        fqn = names.join(template, nums[0])
        k = 1 + len(_MODULE_INTS) + 1
        mem = nums[k : k + n_mem]
        k += n_mem
        forward_ms, backward_ms, calls = nums[k : k + 3]
        k += 3
        pairs = [[int(nums[k + 2 * i]), int(nums[k + 2 * i + 1])] for i in range(n_in + n_out)]
        k += 2 * (n_in + n_out)
        if has_ops and trace is not None:
            trace.module_ops[fqn] = int(nums[k])
            k += 1
        stats = None
        stop = None if no_stop or (not long_ops and inline is None) else int(nums[k])
        k += stop is not None
        if long_ops:
            stats = op_stats_of(op_lists[template], _flags(_stats(a, template)), stop)
        elif inline is not None:
            op_sigs, flags = inline
            ops = []
            for op_sig in op_sigs:
                n = _op_numbers(op_sig)
                ops.append(Item(op_sig, tuple(nums[k : k + n])))
                k += n
            stats = op_stats_of(ops, flags, stop)
        out[fqn] = ModuleProfile(
            fqn=fqn,
            module_type=module_type,
            is_leaf=is_leaf,
            **{f: int(v) for f, v in zip(_MODULE_INTS, nums[1:], strict=False)},
            output_bytes=int(nums[1 + len(_MODULE_INTS)]),
            memory={
                p: _unsnapshot(tuple(mem[i * len(CATEGORIES) : (i + 1) * len(CATEGORIES)]))
                for i, p in enumerate(PHASES)
            },
            forward_ms=forward_ms,
            backward_ms=backward_ms,
            calls=int(calls),
            op_stats=stats,
            measured_overhead=json.loads(overhead),
            freed_inputs=pairs[:n_in],
            freed_outputs=pairs[n_in:],
        )
    return out


def _flags(stats: ModuleOpStats) -> tuple[bool, bool]:
    return stats.force_store_random, stats.output_saved_inside
