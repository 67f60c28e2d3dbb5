"""Values computed from the weights read on the host: the read is named, or, when asked, given a stand-in array.

A loss may hand predictions to the host: a detector's bipartite matcher (DETR's ``HungarianMatcher``) builds a cost
matrix from the predicted boxes and classes and solves the assignment with scipy's ``linear_sum_assignment`` on
its ``.numpy()`` (``np.asarray`` calls it too). The dry run has those predictions as fake tensors, without values,
so no array exists. Torch refuses ``.numpy()`` of a fake tensor with a message about tensor subclasses; worse, an
earlier check on the same values (``if not (boxes[:, 2:] >= boxes[:, :2]).all(): raise ValueError(...)``) got a
stand-in answer (:mod:`lightning_sac.dryrun.values.placeholders`), and the user would read the library's complaint
about box formats. So during the dry run a fake tensor's ``.numpy()`` raises a
:class:`~lightning_sac.errors.ProfilingError` that names the read, its module and source line, and says the value
came from the weights; when the two dry runs of :func:`~lightning_sac.dryrun.values.stand_in_check.record_checked` both
stop, :func:`~lightning_sac.dryrun.values.stand_in_check.stopped_by_host_reads` names the host read that stopped them
and what each stand-in answer led to.

**Planning such a model anyway.** What the matcher decides is which prediction pairs with which target, and the
loss then gathers the matched rows: their number is ``min(queries, targets)`` per image, which the batch alone
fixes, so every tensor the step allocates has the same size whatever the assignment. Within
:func:`host_read_stand_ins`, a fake tensor's ``.numpy()`` returns a stand-in array of its shape and dtype (zeros;
in the check run, a ramp), recorded like the scalar stand-ins (``kind`` ``"array"``). The matcher then returns a
valid assignment of the real sizes. When both dry runs complete, their different arrays must give the same ops of
the same sizes, or the dry run stops as for any stand-in that decides what the step computes; when the first stops
(a check answered ``False`` raised), the second is the profile, as for scalar stand-ins. Measured on a DETR
detector, the profile's peak is within 1% of a real step's, and plans made on it hold (tests/test_batch_values.py).
An assignment whose *size* depends on the values (a matcher that drops pairs above a cost threshold) is not such a
case: the stand-ins would plan another step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor

from lightning_sac.errors import ProfilingError

if TYPE_CHECKING:
    from lightning_sac.dryrun.values.placeholders import Placeholders

__all__ = ["NUMPY_READ", "PLAN_ANYWAY", "HostArrays", "host_read_stand_ins", "stand_in_array"]

#: How a host read of a whole tensor is named in errors and in the profile's stand-in sites.
NUMPY_READ = "Tensor.numpy"

_STAND_INS: ContextVar[bool] = ContextVar("lightning_sac_host_read_stand_ins", default=False)

#: What the user can do about a host read of a weight-derived value (the end of every such error).
PLAN_ANYWAY = (
    "To plan it anyway, profile within lightning_sac.host_read_stand_ins() (profile_model, or trainer.fit with "
    "AutoSAC): such a read then gets a stand-in array of the tensor's shape, which holds for a matcher, whose "
    "assignment decides which rows the loss gathers but not how many (docs/autosac.md, 'Host reads'); or profile "
    "with a loss_fn that does not read predictions on the host; with AutoSAC, strict=False trains without a plan. "
    "The model was not changed."
)


@contextmanager
def host_read_stand_ins() -> Iterator[None]:
    """Dry runs started within the block answer ``.numpy()`` of a weight-derived tensor with a stand-in array.

    For losses whose host code (a bipartite matcher) decides which rows it gathers but not how many: see the module
    docstring. Every such read is listed in the profile's ``placeholders`` (``kind`` ``"array"``).
    """
    token = _STAND_INS.set(True)
    try:
        yield
    finally:
        _STAND_INS.reset(token)


def stand_in_array(tensor: torch.Tensor, healthy: bool) -> np.ndarray:
    """The stand-in for ``tensor.numpy()``: zeros in the healthy run, a ramp (0, 1, 2, ...) in the check run."""
    # numpy has the dtypes' names (a bfloat16 has none, and the real step's .numpy() fails on it too).
    numpy_dtype = np.dtype(str(tensor.dtype).removeprefix("torch."))
    if healthy:
        return np.zeros(tuple(tensor.shape), dtype=numpy_dtype)
    ramp = np.arange(tensor.numel()) % 2 if tensor.dtype == torch.bool else np.arange(tensor.numel())
    return ramp.astype(numpy_dtype).reshape(tuple(tensor.shape))


class HostArrays:
    """Enter around the dry run: a fake tensor's ``.numpy()`` is named, or answered within :func:`host_read_stand_ins`.

    Args:
        placeholders: Records each stand-in and gives the run's choice of stand-ins.
    """

    def __init__(self, placeholders: Placeholders) -> None:
        self.placeholders = placeholders
        self._saved: Any = None

    def __enter__(self) -> HostArrays:
        # ``.numpy()`` is refused in C for every tensor subclass before any dispatch, so no mode sees it: the fake
        # tensor class gets the method while the dry run runs (``np.asarray`` calls it through ``__array__``).
        self._saved = FakeTensor.__dict__.get("numpy")
        placeholders = self.placeholders

        def numpy(tensor: torch.Tensor, *, force: bool = False) -> np.ndarray:
            module, source = placeholders.where()
            if not _STAND_INS.get():
                raise ProfilingError(
                    f"Module {module or '<root>'!r} reads a tensor of shape {tuple(tensor.shape)} on the host with "
                    f".numpy() at {source}: a value computed from the weights, which the dry run does not have "
                    f"(only the batch's values are real there). {PLAN_ANYWAY}",
                    op=NUMPY_READ,
                    module=module,
                    source=source,
                )
            healthy = placeholders.stand_in(NUMPY_READ, f"an array of shape {tuple(tensor.shape)}")
            return stand_in_array(tensor, healthy)

        FakeTensor.numpy = numpy  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is None:
            del FakeTensor.numpy
        else:
            FakeTensor.numpy = self._saved  # type: ignore[method-assign]
