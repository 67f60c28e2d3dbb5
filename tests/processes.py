"""Start the ranks of a multi-process test as ``torch.multiprocessing.spawn`` does, without importing per rank.

A spawned rank is a fresh interpreter that imports torch, Lightning, transformers and the test's module again:
6 to 10 s of CPU per rank, much of a small fit's time, with 4 ranks on 2 cores here. These ranks fork from a
``forkserver`` instead: a fresh interpreter, started once per test session (not a fork of pytest, so no test's
state reaches a rank), that has imported the harness once. A rank gets what a spawned one gets from its parent
(``sys.path``, the working directory, and here the environment as it is at the call), less the imports.
Lightning's ``ddp_spawn`` strategy, which some tests exercise on purpose, still spawns.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["start_ranks"]

# What every rank imports: the sharded-fit harness brings torch, Lightning, transformers and lightning_sac.
_PRELOAD = ["sharded_fits"]


def _rank(rank: int, env: dict[str, str], fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    # The forkserver's environment is the parent's when the server started; a spawned rank gets the current one.
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """``mp.spawn(fn, args=args, nprocs=nprocs)``: run ``fn(rank, *args)`` in ``nprocs`` processes and join them.

    Raises as ``mp.spawn`` does (``ProcessRaisedException``) when a rank fails.
    """
    # Read when the forkserver starts (the first call in the session); later calls reuse the server, and a rank
    # imports what else it needs (fn's module, if another one was preloaded) as a spawned one does.
    multiprocessing.set_forkserver_preload([*_PRELOAD, fn.__module__])
    mp.start_processes(_rank, args=(dict(os.environ), fn, args), nprocs=nprocs, join=True, start_method="forkserver")
