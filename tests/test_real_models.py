"""Models we did not write (``zoo.py``), called as their users call them: the profile, plans and applied plans hold.

For each family: the plain prediction against torch.profiler's allocator events of a real step; plans at 85% of the
unconstrained peak and near the minimum, applied with each backend, give the plain model's loss, every gradient and
every buffer over two optimizer steps, run the profiled ops, and measure within 3% of their prediction and never
above the unplanned step.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from zoo import FAMILIES, Family

from lightning_sac import BudgetError, ModelProfile, Plan, apply_plan, profile_model, solve_plan
from lightning_sac.dryrun.measured import measure_training_step
from lightning_sac.dryrun.step import model_inputs, model_loss

GIB = 2**30
PLANNED = ["gpt2", "llama", "llama_lora", "bert", "t5", "resnet", "lstm", "self_checkpointing"]


@dataclass
class Reference:
    family: Family
    profile: ModelProfile
    plain_peak: int  # measured
    steps: list[tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]]  # loss, grads, buffers


def two_steps(model: torch.nn.Module, family: Family) -> list[Any]:
    """Two optimizer steps from the same seed: the loss, every gradient and every buffer after each."""
    torch.manual_seed(7)
    optimizer = family.optimizer(model.parameters())
    inputs = model_inputs(family.batch)
    record = []
    for _ in range(2):
        loss = model_loss(family.loss_fn)(model, inputs)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        record.append((loss.detach(), grads, {n: b.clone() for n, b in model.named_buffers()}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return record


_REFERENCES: dict[str, Reference] = {}


def build_reference(family: Family) -> Reference:
    """The family's profile, its measured plain peak and two plain optimizer steps."""
    profile = profile_model(
        family.model, family.batch, loss_fn=family.loss_fn, optimizer_factory=family.optimizer, device="cpu"
    )
    measured = measure_training_step(
        copy.deepcopy(family.model), family.batch, loss_fn=family.loss_fn, optimizer_factory=family.optimizer
    )
    return Reference(family, profile, measured.peak_bytes, two_steps(copy.deepcopy(family.model), family))


def reference(name: str) -> Reference:
    if name not in _REFERENCES:
        _REFERENCES[name] = build_reference(FAMILIES[name]())
    return _REFERENCES[name]


def plan_for(ref: Reference, budget: str, backend: str) -> Plan:
    if budget == "85%":
        return solve_plan(ref.profile, 0.85 * ref.profile.peak_bytes / GIB, backend=backend)
    with pytest.raises(BudgetError) as info:
        solve_plan(ref.profile, 1e-6, backend=backend)
    return solve_plan(ref.profile, info.value.minimum_bytes * 1.02 / GIB, backend=backend)


def train_planned(ref: Reference, plan: Plan, *, exact: bool = False) -> list[Any]:
    """Train a planned copy two steps as ``ref`` did: no mismatch, no unplanned call, and the plain model's loss, every
    gradient and every buffer (bit-equal with ``exact``). Returns the plan's wrappers, removed, with their counters."""
    model = copy.deepcopy(ref.family.model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="lightning-sac")  # no mismatch, no unplanned call
        warnings.filterwarnings("ignore", message=".*trains with use_cache=False.*")
        handle = apply_plan(model, plan)
        steps = two_steps(model, ref.family)
    wrappers = list(handle.wrappers.values())
    handle.remove()
    assert all(w.mismatched_calls == 0 for w in wrappers)

    def equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        if exact:
            assert torch.equal(a, b), what
        else:
            torch.testing.assert_close(a, b, msg=what)

    for (plain_loss, plain_grads, plain_buffers), (loss, grads, buffers) in zip(ref.steps, steps, strict=True):
        equal(loss, plain_loss, "loss")
        assert grads.keys() == plain_grads.keys()
        for n in plain_grads:
            equal(grads[n], plain_grads[n], n)
        assert buffers.keys() == plain_buffers.keys()
        for n in plain_buffers:  # BatchNorm's running statistics: updated once per step, as without a plan
            equal(buffers[n], plain_buffers[n], n)
    return wrappers


def measured_planned_peak(ref: Reference, plan: Plan) -> int:
    """The allocator's peak of a real step of a planned copy of ``ref``'s model."""
    planned = copy.deepcopy(ref.family.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_plan(planned, plan)
        return measure_training_step(
            planned, ref.family.batch, loss_fn=ref.family.loss_fn, optimizer_factory=ref.family.optimizer
        ).peak_bytes


@pytest.mark.parametrize("name", PLANNED + ["gpt2_gradient_checkpointing"])
def test_the_plain_prediction_matches_a_real_step(name):
    ref = reference(name)
    # On an LSTM, oneDNN's scratch buffers are measured on the kernel with the call's own gradient layouts
    # (tests/test_lstm_scratch.py).
    predicted = ref.profile.plain_peak_bytes  # with the model's KV caches on, as it runs without a plan
    assert abs(predicted - ref.plain_peak) <= 0.03 * ref.plain_peak, (predicted, ref.plain_peak)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sac", "graph"])
@pytest.mark.parametrize("budget", ["85%", "minimum"])
@pytest.mark.parametrize("name", PLANNED)
def test_planned_steps_equal_the_plain_model_and_their_prediction(name, budget, backend):
    ref = reference(name)
    plan = plan_for(ref, budget, backend)
    assert plan.decisions
    train_planned(ref, plan)
    measured = measured_planned_peak(ref, plan)
    # Within 3%; the graph backend may hold less than predicted (5%): its recompute is counted as SAC's, an upper
    # bound, since it reruns only what backward unpacks and frees each node at its last consumer.
    below = 0.05 if backend == "graph" else 0.03
    assert -0.03 <= (plan.predicted_peak_bytes - measured) / plan.predicted_peak_bytes <= below, (measured, plan)
    assert measured <= ref.plain_peak


def test_lora_counts_gradients_and_optimizer_state_of_the_adapters_only():
    ref = reference("llama_lora")
    trainable = [p for p in ref.family.model.parameters() if p.requires_grad]
    frozen = [p for p in ref.family.model.parameters() if not p.requires_grad]
    assert trainable and frozen
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    root = ref.profile.modules[""]
    assert root.gradient_bytes == grad_bytes
    # AdamW: exp_avg and exp_avg_sq like each parameter, and a float32 scalar step per parameter.
    assert root.optimizer_state_bytes == 2 * grad_bytes + 4 * len(trainable)
