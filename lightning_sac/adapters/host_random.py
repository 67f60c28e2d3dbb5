"""The user's Python and NumPy global generators, as our work leaves them.

A model's Python code may draw from ``random`` or ``np.random`` (a mask from ``np.random.rand``), and so may a
library we call (pwlf seeds NumPy's). Torch's generators have ``torch.random.fork_rng``; these two get the same here:
work that runs the user's code again (a dry run, a checkpoint's recompute) or calls such a library runs inside
:func:`host_generators`, and the user's streams go on as if it had not run.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["HostGenerators", "host_generator_states", "host_generators"]

#: Python's global generator state, and NumPy's.
HostGenerators = tuple[Any, Any]


def host_generator_states() -> HostGenerators:
    """The states of Python's and NumPy's global generators now."""
    return random.getstate(), np.random.get_state()


@contextlib.contextmanager
def host_generators(states: HostGenerators | None = None) -> Iterator[None]:
    """Within the block, the global generators in ``states`` (as they are, by default); after it, as before it."""
    before = host_generator_states()
    if states is not None:
        random.setstate(states[0])
        np.random.set_state(states[1])
    try:
        yield
    finally:
        random.setstate(before[0])
        np.random.set_state(before[1])
