"""Plans applied on the GPU: real steps within the budget, and bit-equal to the plain model's.

A budget bounds all the device memory the process holds (:mod:`lightning_sac.plan.reserve`): the step's tensors
plus the reserve (CUDA context, cuBLAS workspaces, the allocator's fragmentation). The budget here is 70% of the plain
step's measured peak (80% for the ResNet; in the profile's terms, see :mod:`harness`) plus the plain step's reserve;
the plan's own reserve holds the planned step's fragmentation (:mod:`lightning_sac.plan.fragmentation`), so its
tensors get that budget less it.
Plans are made from both profiles: the visible GPU's (``"cuda"``) and the one a machine without a GPU makes for this
GPU by name (``"emulated"``), the package's promise: a plan made on a CPU box holds on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from lightning_sac import Plan, apply_plan, solve_plan
from lightning_sac.errors import BudgetError
from lightning_sac.plan.reserve import device_reserve

from .harness import (
    GIB,
    build,
    deterministic,
    differences,
    measured_plain,
    profile_for,
    run_steps,
    state_after_steps,
)

# The tensors' share of the plain peak the budget leaves, where a plan reaches it (plan_for). The ResNet's lowest
# reachable peak in bf16 is 68% of its plain one (profiled for an H100), too close to 70% for a measured peak a few
# percent off the predicted one.
FRACTION = {"gpt": 0.70, "gpt2": 0.70, "llama": 0.70, "resnet": 0.80}
# The accept pattern of a planned fit (issue 13): every step's peak at most 2% over the budget. The solver plans with
# its own KiB margin; 2% leaves room for what test_cuda_memory's tolerance allows the profile to miss.
OVER_BUDGET = 1.02
# The plan's predicted peak against the measured one: as tests/test_apply.py holds it on the CPU (allocator events).
PREDICTION_TOLERANCE = 0.10

CASES = [
    ("gpt", "fp32", "cuda"),
    ("gpt", "fp32", "emulated"),
    ("gpt", "bf16", "cuda"),
    ("gpt", "bf16", "emulated"),
    ("gpt2", "fp32", "emulated"),
    ("llama", "bf16", "cuda"),
    ("resnet", "fp32", "cuda"),
    ("resnet", "fp32", "emulated"),  # cuDNN's BatchNorm emulated on the CPU
    ("resnet", "bf16", "emulated"),
]
IDS = ["-".join(c) for c in CASES]

_PLANS: dict[tuple[str, str, str, bool], tuple[Plan, int]] = {}


def plan_for(name: str, precision: str, path: str) -> tuple[Plan, int]:
    """The sac plan for the tensors' fraction of the measured plain peak plus the plain step's reserve, and that
    fraction in bytes (cached per process), from a profile made under the deterministic-algorithms mode in force."""
    key = (name, precision, path, torch.are_deterministic_algorithms_enabled())
    if key not in _PLANS:
        profile = profile_for(name, precision, path)
        tensors = int(FRACTION[name] * measured_plain(name, precision).step_peak_bytes)
        budget = tensors + device_reserve(profile).total
        try:
            plan = solve_plan(profile, budget / GIB, backend="sac")
        except BudgetError as floor:
            # No plan reaches the fraction: the ResNet in fp32 profiled on an H100, whose first convolution's
            # backward holds cuDNN's 560 MiB workspace when little else is alive, cannot go below 89% of its plain
            # peak. Tested halfway between the lowest reachable peak and the unconstrained one instead.
            budget = (floor.minimum_bytes + floor.unconstrained_bytes) // 2
            tensors = budget - device_reserve(profile).total
            plan = solve_plan(profile, budget / GIB, backend="sac")
        _PLANS[key] = plan, tensors
    return _PLANS[key]


@pytest.mark.parametrize(("name", "precision", "path"), CASES, ids=IDS)
def test_planned_steps_stay_within_the_budget(name, precision, path, figure):
    plan, tensors = plan_for(name, precision, path)
    plain = measured_plain(name, precision)
    case = build(name, "cuda")
    handle = apply_plan(case.model, plan)
    run = run_steps(case, precision)
    figure("checkpointed", ", ".join(sorted(plan.decisions)))
    figure.mib("budget", plan.budget_bytes)
    figure("reserve_MiB", str({k: round(v / 2**20, 1) for k, v in plan.reserve.items()}))
    figure.mib("tensor_budget", plan.tensor_budget_bytes)
    figure.mib("plain_measured_peak", plain.step_peak_bytes)
    figure.mib("plan_predicted_peak", plan.predicted_peak_bytes)
    figure.mib("planned_measured_peak", run.step_peak_bytes)
    figure.mib("allocated_budget", plan.allocated_budget_bytes)
    figure.mib("planned_max_memory_allocated", run.allocated_peak_bytes)
    figure.mib("planned_max_memory_reserved", run.reserved_peak_bytes)
    figure.mib("planned_device_peak", run.device_peak_bytes)
    figure.mib("predicted_fragmentation", plan.reserve.get("fragmentation_bytes", 0))
    figure.mib("measured_fragmentation", run.reserved_bytes - run.step_peak_bytes)
    figure("tensors_over_budget", round(run.step_peak_bytes / plan.tensor_budget_bytes - 1, 4))
    figure("device_over_budget", round(run.device_peak_bytes / plan.budget_bytes - 1, 4))
    assert plan.decisions, f"no plan at {FRACTION[name]:.0%} of the plain peak: nothing was tested"
    # The reserve the plan kept holds its own fragmentation; the tensors get the budget less all of it.
    assert plan.predicted_peak_bytes <= plan.tensor_budget_bytes == plan.budget_bytes - sum(plan.reserve.values())
    mismatched = {f: w.last_mismatch for f, w in handle.wrappers.items() if w.mismatched_calls}
    assert not mismatched, f"the GPU ran other ops than the profiled ones, so the plan fell back: {mismatched}"
    assert all(w.calls == 2 for w in handle.wrappers.values())
    where = f"{name} {precision} planned from the {path} profile"
    # The tensors, in the profile's terms (the brief of issue 15: max_memory_allocated within the budget).
    assert run.step_peak_bytes <= plan.tensor_budget_bytes * OVER_BUDGET, (
        f"{where}: {run.step_peak_bytes / 2**20:.1f} MiB of tensors for {plan.tensor_budget_bytes / 2**20:.1f} MiB "
        f"(plan predicted {plan.predicted_peak_bytes / 2**20:.1f} MiB)"
    )
    # torch's own counter, cuBLAS's workspaces included, against what the plan says it may reach.
    assert run.allocated_peak_bytes <= plan.allocated_budget_bytes * OVER_BUDGET, (
        f"{where}: max_memory_allocated {run.allocated_peak_bytes / 2**20:.1f} MiB, the plan allows "
        f"{plan.allocated_budget_bytes / 2**20:.1f} MiB"
    )
    # What a budget means: the device memory the process holds (context and reserved segments), as nvidia-smi shows.
    assert run.device_peak_bytes <= plan.budget_bytes * OVER_BUDGET, (
        f"{where}: the device held {run.device_peak_bytes / 2**20:.1f} MiB (context and reserved) for a budget of "
        f"{plan.budget_bytes / 2**20:.1f} MiB"
    )
    assert run.step_peak_bytes < plain.step_peak_bytes
    assert abs(run.step_peak_bytes - plan.predicted_peak_bytes) <= PREDICTION_TOLERANCE * plan.predicted_peak_bytes


@pytest.mark.parametrize(("name", "precision", "path"), CASES, ids=IDS)
def test_planned_steps_equal_the_plain_ones(name, precision, path, figure):
    # Bit for bit: checkpointing reruns the same kernels on the same inputs with the same random state, and
    # backward runs the same kernels in the same order. Only kernels whose result depends on the order of atomic
    # additions could differ: deterministic mode picks the deterministic ones (SDPA's backward needs
    # warn_only=False). The ResNet's AdaptiveAvgPool2d backward has no kernel torch calls deterministic, so it only
    # warns there; with a 1x1 output each input gradient gets a single addition, whose order cannot matter.
    with deterministic(warn_only=name == "resnet"):
        plan, _ = plan_for(name, precision, path)  # profiled in this mode: it picks the attention kernel
        plain = state_after_steps(build(name, "cuda"), precision)
        control = differences(plain, state_after_steps(build(name, "cuda"), precision))
        case = build(name, "cuda")
        handle = apply_plan(case.model, plan)
        planned = state_after_steps(case, precision)
    diff = differences(planned, plain)
    figure("losses", str(planned["losses"]))
    figure("tensors_compared", sum(len(plain[k]) for k in ("grads", "params", "buffers")))
    figure("tensors_differing", len(diff))
    assert not control, f"the plain model is not bit-reproducible on this GPU, so equality cannot be tested: {control}"
    assert plan.decisions
    assert all(w.calls == 3 and w.mismatched_calls == 0 for w in handle.wrappers.values())
    assert not diff, f"{name} {precision} planned from the {path} profile differs from the plain model: {diff[:10]}"
