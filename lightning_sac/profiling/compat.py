"""Libraries that detect fake tensors on purpose must not send the dry run down another code path.

Some libraries ask "is this tensor fake?" to tell an export or compile trace from eager execution, and take a
trace-friendly path when it is: transformers' ``is_tracing(tensor)`` is true for a ``FakeTensor``, and its
attention-mask code then builds a full 4-D mask where the real step passes ``None`` and ``is_causal`` to
scaled-dot-product attention. The real step has no fake tensors, so while the dry run runs, those checks
answer as they will in training. Each entry here patches one library's check, only if the library is already
imported (nothing is imported for it), and restores it on exit.

Tested with transformers 5.23 (``transformers.utils.import_utils.is_fake_tensor``, which ``is_tracing`` calls).
Since the batch's values stay real in the dry run (:mod:`lightning_sac.profiling.real_values`), the masks and
positions these checks usually look at are real anyway; this layer covers the rest (a mask too large to keep
real, a library asking about activations). A data-dependent decision on a value that is fake in the dry run
then raises a ``ProfilingError`` naming the op, instead of silently taking the tracing path.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["FAKE_TENSOR_CHECKS", "real_step_answers"]

#: ``(module, attribute)`` of each fake-tensor check answered ``False`` during the dry run.
FAKE_TENSOR_CHECKS: tuple[tuple[str, str], ...] = (("transformers.utils.import_utils", "is_fake_tensor"),)


def _not_fake(x: Any) -> bool:
    """The real step's answer to "is this a fake tensor?": never."""
    return False


@contextlib.contextmanager
def real_step_answers() -> Iterator[list[str]]:
    """Within the block, the libraries' fake-tensor checks of :data:`FAKE_TENSOR_CHECKS` answer ``False``.

    Yields the ``module.attribute`` names it patched (those whose module is imported).
    """
    patched: list[tuple[Any, str, Any]] = []
    try:
        for module_name, attribute in FAKE_TENSOR_CHECKS:
            module = sys.modules.get(module_name)
            if module is not None and hasattr(module, attribute):
                patched.append((module, attribute, getattr(module, attribute)))
                setattr(module, attribute, _not_fake)
        yield [f"{m.__name__}.{a}" for m, a, _ in patched]
    finally:
        for module, attribute, original in reversed(patched):
            setattr(module, attribute, original)
