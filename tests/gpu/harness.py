"""Real training steps on the GPU for the suite: measured memory, states to compare, plans, figures.

The models and profiles are in :mod:`models`; this module re-exports them so that tests import one place.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_sac import ModelProfile, ModuleDecision, Plan
from lightning_sac.adapters.caches import CacheSwitch
from lightning_sac.dryrun.step import model_inputs, tensors_of, training_step
from lightning_sac.solver import find_candidates
from lightning_sac.solver.tradeoff import module_tradeoff

from .models import (
    GIB,
    MODELS,
    SEED,
    Case,
    adamw,
    build,
    compute_loss,
    device_bytes,
    free_memory,
    named_spec,
    no_cuda,
    optimizer_tensors,
    profile_for,
)

__all__ = [
    "GIB",
    "MODELS",
    "Case",
    "FigureWriter",
    "StepRun",
    "adamw",
    "build",
    "compute_loss",
    "device_bytes",
    "differences",
    "measured_plain",
    "measured_runs",
    "named_spec",
    "no_cuda",
    "outside_allocator_now",
    "profile_for",
    "recompute_everything",
    "recomputed_random_ops",
    "run_steps",
    "state_after_steps",
]


@dataclass
class StepRun:
    """The memory of real training steps, and their losses.

    Attributes:
        losses: Each step's loss.
        counted_bytes: At the start of the last step, what the profile counts as existing then: parameters,
            buffers, gradients, optimizer state on the device, the batch and the tensors the loss closes over.
        uncounted_bytes: ``memory_allocated()`` at the start of the last step minus ``counted_bytes``.
        allocated_peak_bytes: ``max_memory_allocated()`` over the last step.
        reserved_peak_bytes: ``max_memory_reserved()`` over all the steps, from an emptied cache.
        outside_allocator_bytes: After the steps, what the device holds that the caching allocator did not reserve
            (``mem_get_info``'s used bytes less ``memory_reserved()``): the CUDA context with the kernels loaded so
            far, and any other process's memory (none on a dedicated GPU).
        parameter_bytes, buffer_bytes, optimizer_state_bytes: Parts of ``counted_bytes``.
    """

    losses: list[float]
    counted_bytes: int
    uncounted_bytes: int
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    outside_allocator_bytes: int
    parameter_bytes: int
    buffer_bytes: int
    optimizer_state_bytes: int

    @property
    def step_peak_bytes(self) -> int:
        """The last step's peak in the profile's terms (module docstring)."""
        return self.allocated_peak_bytes - self.uncounted_bytes

    @property
    def reserved_bytes(self) -> int:
        """What the allocator reserved at most, less the uncounted allocations it holds too."""
        return self.reserved_peak_bytes - self.uncounted_bytes

    @property
    def device_peak_bytes(self) -> int:
        """The most the device held for this process at once, as ``nvidia-smi`` shows it: what a budget bounds."""
        return self.outside_allocator_bytes + self.reserved_peak_bytes


def outside_allocator_now() -> int:
    """What the device holds now beyond what the caching allocator reserved: the CUDA context (and other processes)."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def run_steps(case: Case, precision: str, steps: int = 2, seed: int = SEED, caches: bool = True) -> StepRun:
    """Train ``case.model`` for ``steps`` real steps and measure the last one, as the dry run profiles it.

    The step is the package's own :func:`~lightning_sac.dryrun.step.training_step` (forward and loss, backward,
    optimizer step, ``zero_grad(set_to_none=True)``), so profile and measurement run the same code. The first step
    creates AdamW's state; the last one, begun with that state and no gradients, is the one the dry run records.
    Step ``i`` draws its random numbers from seed ``seed + i``. ``caches=False`` runs the model without its KV
    caches (Hugging Face's ``use_cache``), as the dry run records it and as a plan runs it
    (:class:`~lightning_sac.adapters.caches.CacheSwitch`, the package's own switch).
    """
    model = case.model
    inputs = model_inputs(case.batch)
    forward = compute_loss(case, precision)
    losses: list[float] = []

    def counted_forward(m: nn.Module, x: Any) -> torch.Tensor:
        loss = forward(m, x)
        losses.append(loss.item())  # a number: holding the loss tensor would outlive the step's own
        return loss

    optimizer = adamw(model.parameters())
    free_memory()
    torch.cuda.reset_peak_memory_stats()
    reserved = before = 0
    parts: dict[str, int] = {}
    with contextlib.nullcontext() if caches else CacheSwitch(model):
        for i in range(steps):
            if i == steps - 1:
                torch.cuda.synchronize()
                reserved = torch.cuda.max_memory_reserved()
                params = list(model.parameters())
                grads = [p.grad for p in params if p.grad is not None]
                state = optimizer_tensors(optimizer)
                parts = {
                    "parameter": device_bytes(params),
                    "buffer": device_bytes(list(model.buffers())),
                    "optimizer_state": device_bytes(state),
                    "counted": device_bytes(
                        params + list(model.buffers()) + grads + state + tensors_of(inputs) + case.closed_over
                    ),
                }
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            torch.manual_seed(seed + i)
            training_step(model, inputs, counted_forward, optimizer)
    torch.cuda.synchronize()
    run = StepRun(
        losses=losses,
        counted_bytes=parts["counted"],
        uncounted_bytes=before - parts["counted"],
        allocated_peak_bytes=torch.cuda.max_memory_allocated(),
        reserved_peak_bytes=max(reserved, torch.cuda.max_memory_reserved()),
        outside_allocator_bytes=outside_allocator_now(),
        parameter_bytes=parts["parameter"],
        buffer_bytes=parts["buffer"],
        optimizer_state_bytes=parts["optimizer_state"],
    )
    del optimizer
    free_memory()
    return run


_PLAIN: dict[tuple[str, str, bool], StepRun] = {}


def measured_plain(name: str, precision: str, caches: bool = True) -> StepRun:
    """Two real steps of the plain model ``name`` on the GPU, with or without its KV caches (cached per process)."""
    key = (name, precision, caches)
    if key not in _PLAIN:
        case = build(name, "cuda")
        _PLAIN[key] = run_steps(case, precision, caches=caches)
        del case
        free_memory()
    return _PLAIN[key]


def measured_runs() -> list[StepRun]:
    """Every plain run measured so far in this process."""
    return list(_PLAIN.values())


def state_after_steps(case: Case, precision: str, steps: int = 2, seed: int = SEED) -> dict[str, Any]:
    """Losses of ``steps`` training steps, then the loss, every gradient, parameter and buffer of one more forward
    and backward (no optimizer step), from fixed seeds: what two runs must agree on bit for bit."""
    losses = run_steps(case, precision, steps, seed).losses
    model = case.model
    torch.manual_seed(seed + steps)
    loss = compute_loss(case, precision)(model, model_inputs(case.batch))
    loss.backward()
    return {
        "losses": [*losses, loss.item()],
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None},
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
    }


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Where two :func:`state_after_steps` results differ at all (bitwise): an empty list when they are equal."""
    out = [f"losses {a['losses']} != {b['losses']}"] if a["losses"] != b["losses"] else []
    for kind in ("grads", "params", "buffers"):
        if a[kind].keys() != b[kind].keys():
            out.append(f"{kind}: names differ: {sorted(a[kind].keys() ^ b[kind].keys())}")
            continue
        for n, x in a[kind].items():
            y = b[kind][n]
            if not torch.equal(x, y):
                worst = (x.double() - y.double()).abs().max().item() if x.is_floating_point() else float("nan")
                out.append(f"{kind} {n}: max |diff| {worst:.3g}")
    return out


@contextlib.contextmanager
def deterministic(warn_only: bool = False) -> Iterator[None]:
    """Deterministic kernels (attention backward, convolutions), so that two runs of one step can be bit-equal.

    ``warn_only=False`` is needed for SDPA: with ``warn_only=True`` its flash and memory-efficient backward stay
    non-deterministic and only warn. cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` (set by the suite's conftest).
    """
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)


# ---------------------------------------------------------------------------------------------------- plans


def recompute_everything(profile: ModelProfile, backend: str) -> Plan:
    """Every outermost candidate module checkpointed, every op recomputed but those a policy must save."""
    fqns = [c.fqn for c in find_candidates(profile, backend=backend) if c.fqn]
    top = [f for f in fqns if not any(f.startswith(o + ".") for o in fqns if o != f)]
    decisions = {}
    for fqn in top:
        stats = profile.modules[fqn].op_stats
        assert stats is not None
        forced = {i for unit in module_tradeoff(stats).stored for i in unit.ops}
        decisions[fqn] = ModuleDecision(
            discard_ratio=1.0,
            op_policy=[int(i in forced) for i in range(len(stats.func_names))],
            recompute_ms=sum(stats.runtimes),
            freed_bytes=0,
            op_names=list(stats.func_names),
        )
    return Plan(decisions=decisions, budget_bytes=0, backend=backend, kv_cache_off=bool(profile.kv_cache_off))


def recomputed_random_ops(plan: Plan, profile: ModelProfile) -> list[str]:
    """``module: op`` for each random op (dropout, SDPA with dropout) the plan recomputes rather than saves."""
    out = []
    for fqn, decision in plan.decisions.items():
        stats = profile.modules[fqn].op_stats
        assert stats is not None
        out += [f"{fqn}: {stats.func_names[i]}" for i in stats.rand_ops if not decision.op_policy[i]]
    return out


# ---------------------------------------------------------------------------------------------------- figures


@dataclass
class FigureWriter:
    """Records a test's figures: as a pytest property (``-rA`` and junit show it), on stdout (the report's captured
    output), and as one JSON line each in the file named by ``LSAC_GPU_FIGURES`` when it is set."""

    test: str
    device: str
    record_property: Callable[[str, object], None]
    path: str | None = field(default_factory=lambda: os.environ.get("LSAC_GPU_FIGURES"))

    def __call__(self, name: str, value: float | int | str, unit: str = "") -> None:
        self.record_property(name, value)
        print(f"[{self.device}] {self.test} {name} = {value} {unit}".rstrip())
        if self.path:
            line = {
                "test": self.test,
                "figure": name,
                "value": value,
                "unit": unit,
                "device": self.device,
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
            }
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")

    def mib(self, name: str, nbytes: int) -> None:
        """A byte figure, in MiB to three decimals."""
        self(name, round(nbytes / 2**20, 3), "MiB")
