"""No keyword a module takes collides with the wrappers' own parameters: every name they use, planned and trained."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import adamw, recompute_all_policy
from torch import nn

from lightning_sac import ModuleDecision, Plan, profile_model
from lightning_sac.apply import apply_plan

# The wrappers' parameters (PlannedForward, the backends, torch.utils.checkpoint's own keywords) and the names a
# wrapper could plausibly use.
NAMES = (
    "state",
    "self_",
    "fn",
    "func",
    "function",
    "inner",
    "call",
    "args",
    "kwargs",
    "module",
    "policy",
    "policy_fn",
    "ctx",
    "fqn",
    "decision",
    "notices",
    "use_reentrant",
    "context_fn",
    "determinism_check",
    "debug",
    "early_stop",
    "preserve_rng_state",
)


class Block(nn.Module):
    """Takes a tensor under every name of :data:`NAMES`, and adds each scaled by its own weight."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.scales = nn.Parameter(torch.linspace(0.5, 1.5, len(NAMES)))

    def forward(self, x: torch.Tensor, **named: torch.Tensor) -> torch.Tensor:
        assert sorted(named) == sorted(NAMES)
        h = self.lin(x).tanh()
        for i, name in enumerate(NAMES):
            h = h + self.scales[i] * named[name].sigmoid()
        return h.relu()


class Model(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.block = Block(d)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        named = {name: x * (i + 1) for i, name in enumerate(NAMES)}
        return self.head(self.block(x, **named))


def steps(model: nn.Module, x: torch.Tensor) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    optimizer = adamw(model.parameters())
    record = []
    for _ in range(2):
        loss = model(x).square().mean()
        loss.backward()
        record.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return record


@pytest.mark.parametrize("backend", ["sac", "graph"])
def test_a_module_taking_our_parameter_names_plans_and_trains(backend):
    torch.manual_seed(0)
    model, x = Model(), torch.randn(8, 16)
    profile = profile_model(model, (x,), optimizer_factory=adamw, device="cpu")
    stats = profile.modules["block"].op_stats
    assert stats is not None
    policy = recompute_all_policy(stats)
    decision = ModuleDecision(
        discard_ratio=1.0, op_policy=policy, recompute_ms=0.0, freed_bytes=0, op_names=list(stats.func_names)
    )
    planned = copy.deepcopy(model)
    handle = apply_plan(planned, Plan(decisions={"block": decision}, budget_bytes=0), backend=backend)
    plain_steps, planned_steps = steps(copy.deepcopy(model), x), steps(planned, x)
    wrapper = handle.wrappers["block"]
    assert wrapper.calls == 2 and wrapper.mismatched_calls == 0
    for (plain_loss, plain_grads), (loss, grads) in zip(plain_steps, planned_steps, strict=True):
        assert torch.equal(loss, plain_loss)
        assert grads.keys() == plain_grads.keys()
        for n, g in plain_grads.items():
            assert torch.equal(grads[n], g), n


def test_the_names_cover_every_parameter_of_the_wrappers_and_of_torch_checkpoint():
    # The list above is only as good as its coverage: every parameter a wrapper or torch's checkpoint declares.
    import inspect

    from torch.utils.checkpoint import checkpoint

    from lightning_sac.apply.graph.backend import GraphCheckpointForward
    from lightning_sac.apply.planned import PlannedForward
    from lightning_sac.apply.sac import SelectiveCheckpointForward

    functions = [checkpoint, PlannedForward.__init__, PlannedForward.__call__, PlannedForward.run_traced]
    functions += [cls.run for cls in (PlannedForward, SelectiveCheckpointForward, GraphCheckpointForward)]
    declared = {
        name
        for f in functions
        for name, p in inspect.signature(f).parameters.items()
        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    assert declared and declared <= set(NAMES), sorted(declared - set(NAMES))
