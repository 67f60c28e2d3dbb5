"""What each checkpoint backend costs per op on this host, besides the recompute itself.

Both backends see every op of a wrapped module through a Python dispatch mode: in forward (to decide and
record), and in backward (SAC reruns the module's code up to its early stop, serving saved ops from a cache;
the graph backend realizes each recomputed node in Python). On a CPU step that time adds to the step like
recompute does: 10-15 ms per transformer block of about 70 ops here, as much as recomputing a few of its
matmuls. It is measured once per profile, on a chain of tiny ops whose kernels cost next to nothing, as the
difference between the wrapped and the plain chain. These per-op figures are a floor: on large tensors a module
pays more (see :mod:`lightning_sac.profiling.calibrate`, which measures the modules themselves when it can).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_sac.ops import is_sac_ignored, op_name
from lightning_sac.plan import BACKENDS

if TYPE_CHECKING:
    from lightning_sac.plan import Plan

__all__ = ["BackendOverhead", "measure_backend_overheads", "whole_module_plan"]


@dataclass(frozen=True)
class BackendOverhead:
    """Host time a backend adds per op, microseconds.

    Attributes:
        forward_us: Per op a wrapped module's forward runs.
        rerun_us: Per op backward reruns: for ``"sac"`` every op up to the early stop, saved or not; for
            ``"graph"`` every recomputed op. The op's own runtime is not included.
    """

    forward_us: float
    rerun_us: float


class _Chain(nn.Module):
    """``n`` tiny elementwise ops, then one that saves its inputs, so that a recompute reruns all of them."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for _ in range(self.n):
            y = y + 1.0
        return y * x


class _Names(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not is_sac_ignored(func):
            self.names.append(op_name(func))
        return func(*args, **(kwargs or {}))


def _fastest(fn: Callable[[], None], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _forward_backward(model: nn.Module, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    forward = _fastest(lambda: model(x), repeats)  # the graph is dropped unused: forward only
    both = _fastest(lambda: model(x).sum().backward(), repeats)
    return forward, both - forward


def measure_backend_overheads(n_ops: int = 64, repeats: int = 15) -> dict[str, BackendOverhead]:
    """Time each backend's per-op cost on this host (see the module docstring); ``{"sac": ..., "graph": ...}``.

    A property of the host, not of the model: measured once per process (and intra-op thread count), so that
    profiling several models does not pay the 0.7 s again.
    """
    return dict(_measure(n_ops, repeats, torch.get_num_threads()))


def whole_module_plan(op_names: list[str], policy: list[int], skipped: list[int] | None = None) -> Plan:
    """A plan that wraps the root (``""``) of a module with ``policy``: to time a backend on one module.

    ``skipped`` are the ops the SAC backend's recompute skips (:func:`lightning_sac.solver.recompute.skipped_ops`).
    """
    from lightning_sac.plan import ModuleDecision, Plan  # the plan imports the profiler's data model

    decision = ModuleDecision(
        discard_ratio=1.0 - sum(policy) / len(policy),
        op_policy=list(policy),
        recompute_ms=0.0,
        freed_bytes=0,
        op_names=list(op_names),
        skipped_ops=list(skipped or []),
    )
    return Plan(decisions={"": decision}, budget_bytes=0)


@functools.cache
def _measure(n_ops: int, repeats: int, threads: int) -> tuple[tuple[str, BackendOverhead], ...]:
    from lightning_sac.apply import apply_plan  # the appliers import the profiler's data model

    chain = _Chain(n_ops)
    x = torch.ones(8, requires_grad=True)
    with _Names() as seen:
        chain(x)
    plain_forward, plain_backward = _forward_backward(chain, x, repeats)
    per_op = plain_forward / len(seen.names)  # what the rerun of an op costs by itself on tiny tensors
    result = []
    for backend in BACKENDS:
        costs = []
        for keep in (1, 0):
            with apply_plan(chain, whole_module_plan(seen.names, [keep] * len(seen.names)), backend=backend):
                costs.append(_forward_backward(chain, x, repeats))
        (keep_forward, keep_backward), (_, recompute_backward) = costs
        forward_us = max(0.0, keep_forward - plain_forward) / len(seen.names) * 1e6
        if backend == "sac":  # SAC reruns every op to the last pack whatever the policy: the kept-all case
            rerun = keep_backward - plain_backward
        else:  # graph reruns only recomputed ops: everything recomputed, less what the ops cost themselves
            rerun = recompute_backward - plain_backward - per_op * len(seen.names)
        result.append((backend, BackendOverhead(forward_us, max(0.0, rerun) / len(seen.names) * 1e6)))
    return tuple(result)
