"""The check that stand-ins decided nothing: a dry run that used them runs again with other ones.

See :mod:`lightning_sac.dryrun.values.placeholders`: a second run with :data:`~lightning_sac.dryrun.values.placeholders.
OTHER` stand-ins must compute the same forward ops, of the same sizes, in the same module order. When both runs stop
and the answers changed how, the step reads values computed from the weights on the host and acts on them
(:func:`stopped_by_host_reads` names the read that stopped them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_sac.dryrun.values.host_reads import NUMPY_READ, PLAN_ANYWAY
from lightning_sac.dryrun.values.placeholders import HEALTHY, OTHER, _stand_ins
from lightning_sac.errors import ProfilingError

if TYPE_CHECKING:
    from lightning_sac.dryrun.recorded_step import RecordedStep

__all__ = ["record_checked", "stopped_by_host_reads"]


def record_checked(record: Callable[[], RecordedStep]) -> RecordedStep:
    """Run ``record`` (one recorded dry run); when it gave scalar reads stand-ins, check they decided nothing.

    See the module docstring: a second run with :data:`OTHER` stand-ins must compute the same forward ops, of
    the same sizes, in the same module order.

    Raises:
        ProfilingError: The step computes something else when a stand-in changes, or stops with either answer and
            stops differently (a host read of a weight-derived value decides what it does).
    """
    try:
        with _stand_ins(HEALTHY) as healthy:
            first = record()
    except Exception as err:
        if not healthy.scalar_reads:
            raise
        # The healthy answer raised (``if not torch.isfinite(loss): raise``): the other one is the step to plan.
        try:
            with _stand_ins(OTHER) as other:
                return record()
        except Exception as stopped:
            named = stopped_by_host_reads(err, healthy.sites, stopped, other.sites)
            if named is None:
                raise err from None
            raise named from err
    if not healthy.scalar_reads:
        return first
    try:
        with _stand_ins(OTHER):
            second = record()
    except Exception:
        return first  # the other answer stops the step, as it would stop training: nothing else to plan for
    a, b = _computed(first), _computed(second)
    if a != b:
        raise _decision_error(first, a, b)
    return first


def _computed(run: RecordedStep) -> list[tuple[str, int] | str]:
    """What a recorded run computed in its forward: each op and the bytes it allocated, then the module order."""
    ops: list[tuple[str, int] | str] = [(op.name, op.new_bytes) for op in run.recorder.graph.ops]
    return ops + ["modules:", *run.recorder.orders["fwd_pre"]]


def _decision_error(run: RecordedStep, a: list[Any], b: list[Any]) -> ProfilingError:
    scalars = [s for s in run.placeholders if s["kind"] == "scalar"]
    # A boolean read is a decision by nature (``if t:``); a number is mostly logged.
    site = next((s for s in scalars if s["value"] in ("False", "True")), scalars[0])
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    first, second = (a[at] if at < len(a) else "the end"), (b[at] if at < len(b) else "the end")
    where = "; ".join(f"{s['source']} (got {s['value']})" for s in scalars)
    return ProfilingError(
        f"Module {site['module'] or '<root>'!r} calls {site['op']} at {site['source']}, a read of a value derived "
        "from the weights, which the dry run does not have, and the training step computes something else when "
        f"that value changes. The dry run answered the scalar reads at {where}; with other answers (2, True) the "
        f"step's forward differs from op {at} on ({first} against {second}), so a plan would be for another step "
        "than the one training runs. Decide from the batch's values (the dry run has those) or move the decision "
        "out of the training step; with AutoSAC, example_batch= plans for another batch and strict=False trains "
        "without a plan. The model was not changed.",
        op=site["op"],
        module=site["module"],
        source=site["source"],
    )


def _said(err: BaseException) -> str:
    text = str(err).split("\n")[0]
    return f"{type(err).__name__}: {text[:240]}"


def stopped_by_host_reads(
    first: BaseException, first_sites: list[dict[str, Any]], second: BaseException, second_sites: list[dict[str, Any]]
) -> ProfilingError | None:
    """The error for a step that stops with either answer to its host reads, when the answers changed how.

    Args:
        first: What the run with the healthy stand-ins raised.
        first_sites: Where it used stand-ins (:attr:`Placeholders.sites`).
        second: What the run with the other stand-ins raised.
        second_sites: Where that one used them.

    Returns:
        A ``ProfilingError`` naming the host read of a weight-derived value that stopped the dry run (an array read
        by ``.numpy()``, or else the last stand-in read before the first run stopped) and what each answer led to;
        ``None`` when both runs stopped alike (the stand-ins decided nothing: the error is the step's own).
    """
    if _said(first) == _said(second) or not first_sites:
        return None
    # The decision that stopped the healthy run: the last read it answered before raising.
    decision = first_sites[-1]
    answers = (
        f"The read with {decision['op']} at {decision['source']} got a stand-in: with {decision['value']} the step "
        f"raised {_said(first)}"
    )
    if isinstance(second, ProfilingError) and second.op == NUMPY_READ:
        return ProfilingError(
            f"Module {second.module or '<root>'!r} reads a tensor computed from the weights on the host with .numpy() "
            f"at {second.source}. The dry run does not have such values (only the batch's are real there). "
            f"{answers}; with the other answer it went on to that .numpy(), whose array cannot be made up. "
            f"{PLAN_ANYWAY}",
            op=NUMPY_READ,
            module=second.module,
            source=second.source,
        )
    return ProfilingError(
        f"Module {decision['module'] or '<root>'!r} reads a value computed from the weights on the host with "
        f"{decision['op']} at {decision['source']}, and what the step does depends on it. The dry run does not have "
        f"such values (only the batch's are real there). {answers}; with the other answers it raised "
        f"{_said(second)}. {PLAN_ANYWAY}",
        op=decision["op"],
        module=decision["module"],
        source=decision["source"],
    )
