"""Peaks read back from a profile's timeline: the step's, and those of a module's forward and backward.

A peak is a maximum, not a sum: where it lies can move as layers are added (with few layers the step may peak in
the loss's backward, with many at the first layer's). So a profile extended to more layers takes its peaks from its
extended timeline, as the dry run found them: the first moment of the highest total (each event's ``peak_after`` is
the first highest total until the next event), where the step was then (phase, innermost running module).
"""

from __future__ import annotations

from lightning_sac.dryrun import ModelProfile, TimelineEvent, peak_location

__all__ = ["first_peak", "module_peaks", "step_peak"]


def first_peak(timeline: list[TimelineEvent], start: int, stop: int) -> int:
    """Index of the event in ``[start, stop)`` after which the highest total comes first."""
    best, at = -1, start
    for i in range(start, stop):
        total = sum(timeline[i].peak_after.values())
        if total > best:
            best, at = total, i
    return at


def step_peak(profile: ModelProfile) -> tuple[dict[str, int], str]:
    """The snapshot at the step's peak, and where it was: ``"phase:module"`` as the dry run names it."""
    timeline = profile.timeline
    at = first_peak(timeline, 0, len(timeline))
    phase, stack, open_backward = "", list[str](), list[str]()
    for e in timeline[: at + 1]:
        if e.kind == "phase":
            if phase == "backward":
                open_backward.clear()
            phase = e.name
        elif e.kind == "fwd_pre":
            stack.append(e.name)
        elif e.kind == "fwd_post" and stack:
            stack.pop()
        elif e.kind == "bwd_pre":
            open_backward.append(e.name)
        elif e.kind == "bwd_post" and e.name in open_backward:
            open_backward.remove(e.name)
    return dict(timeline[at].peak_after), peak_location(phase, stack, open_backward)


def module_peaks(profile: ModelProfile, fqn: str) -> dict[str, dict[str, int]]:
    """``peak_forward`` and ``peak_backward`` of the module's first call, from the timeline (empty if not run)."""
    timeline, out = profile.timeline, {}
    for phase, begin, end in (("peak_forward", "fwd_pre", "fwd_post"), ("peak_backward", "bwd_pre", "bwd_post")):
        start = next((i for i, e in enumerate(timeline) if e.kind == begin and e.name == fqn), None)
        if start is None:
            continue
        stop = next(
            (i for i in range(start + 1, len(timeline)) if timeline[i].kind == end and timeline[i].name == fqn), None
        )
        if stop is not None:
            out[phase] = dict(timeline[first_peak(timeline, start, stop)].peak_after)
    return out
