"""The SAC backend under torch's recompute protocol before 2.12, where recompute asks the policy again.

From torch 2.12 SAC's recompute serves saved ops from a cache indexed by the forward's answers and asks nothing.
From 2.6 to 2.11 it asks the policy again for every op (``SelectiveCheckpointContext(is_recompute=True)``) and
serves an op answered "save" from a per-op list, first in first out. A policy that answered otherwise in recompute
than in the forward handed one op's saved value to another: on an H100 with torch 2.11 a ResNet's plan raised
"Trying to backward an extra time" in its first backward (an in-place ``relu_`` the forward recomputed was answered
"save" in recompute); had the block saved a later ``relu_``, it would have taken that value, silently.

This machine's torch has the new protocol, so the old one is rebuilt here from its definition (torch 2.11's
``_CachingTorchDispatchMode`` and ``_CachedTorchDispatchMode``) and put under the SAC backend.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, SelectiveCheckpointContext
from zoo import resnet

from lightning_sac import profile_model, solve_plan
from lightning_sac.apply import apply_plan
from lightning_sac.errors import LightningSACError
from lightning_sac.plan.decisions import ModuleDecision, Plan

_SAVE = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


class _OldProtocol(TorchDispatchMode):
    """torch 2.11's SAC modes: both ask the policy about every op; ``recompute`` tells which of the two this is.

    The forward mode keeps the output of an op answered "save" in its op's list; the recompute mode hands an op
    answered "save" its list's first value, first in first out.
    """

    def __init__(self, policy: Any, storage: dict[Any, list[Any]], recompute: bool) -> None:
        super().__init__()
        self.policy, self.storage, self.recompute = policy, storage, recompute

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        saved = self.policy(SelectiveCheckpointContext(is_recompute=self.recompute), func, *args, **kwargs) in _SAVE
        if not self.recompute:
            out = func(*args, **kwargs)
            if saved:
                self.storage[func].append(tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out))
            return out
        if not saved:
            return func(*args, **kwargs)
        if not self.storage.get(func):
            raise RuntimeError("Trying to backward an extra time. You are only allowed to backward once ...")
        return self.storage[func].pop(0)


def _contexts_before_2_12(policy: Any, allow_cache_entry_mutation: bool = False) -> tuple[Any, Any]:
    storage: dict[Any, list[Any]] = defaultdict(list)
    return _OldProtocol(policy, storage, recompute=False), _OldProtocol(policy, storage, recompute=True)


def _state(model: torch.nn.Module, batch: tuple[Any, ...], loss_fn: Any) -> dict[str, Any]:
    loss = loss_fn(model(*batch))
    loss.backward()
    return {
        "loss": loss.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }


def _equal(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    differ = [] if torch.equal(a["loss"], b["loss"]) else ["loss"]
    for kind in ("grads", "buffers"):
        differ += [f"{kind}:{n}" for n, t in a[kind].items() if not torch.equal(t, b[kind][n])]
    return differ


class _LinearReluScaled(torch.nn.Module):
    """A linear layer, an in-place ReLU on its output, a scaling: the plan saves the scaling only."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu_() * 2.0


def test_an_in_place_op_the_forward_recomputed_is_recomputed_again(monkeypatch) -> None:
    # The forward recomputes the linear layer and its in-place ReLU and saves the product; asked again in recompute,
    # the fallback of a call past its profiled ops answered "save" for the ReLU, whose list is empty: the error the
    # GPU raised, here on a CPU under the old protocol.
    torch.manual_seed(0)
    model = torch.nn.Sequential(_LinearReluScaled(), torch.nn.Linear(16, 4))
    x = torch.randn(8, 16)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    profile = profile_model(model, (x,), loss_fn=loss_fn, device="cpu")
    names = list(profile.modules["0"].op_stats.func_names)
    assert names[-2:] == ["aten.relu_.default", "aten.mul.Tensor"]
    policy = [0] * (len(names) - 1) + [1]
    decision = ModuleDecision(discard_ratio=0.5, op_policy=policy, recompute_ms=0.0, freed_bytes=0, op_names=names)
    planned_model = copy.deepcopy(model)
    plain = _state(model, (x,), loss_fn)
    monkeypatch.setattr("lightning_sac.apply.sac.create_selective_checkpoint_contexts", _contexts_before_2_12)
    handle = apply_plan(planned_model, Plan(decisions={"0": decision}, budget_bytes=0), backend="sac")
    planned = _state(planned_model, (x,), loss_fn)
    assert handle.wrappers["0"].calls == 1 and handle.wrappers["0"].mismatched_calls == 0
    assert not _equal(planned, plain)


def test_a_solved_resnet_plan_under_the_old_recompute_protocol_equals_the_plain_model(monkeypatch) -> None:
    family = resnet()
    images, labels = family.batch[0][:4], torch.arange(4)  # four images are enough for a plan of two blocks
    batch = (images,)
    loss_fn = lambda out: torch.nn.functional.cross_entropy(out, labels)  # noqa: E731
    profile = profile_model(family.model, batch, loss_fn=loss_fn, device="cpu")
    plan = solve_plan(profile, (profile.peak_bytes - 0.25 * profile.peak_breakdown["activation"]) / 2**30)
    assert len(plan.decisions) >= 2
    planned_model = copy.deepcopy(family.model)
    plain = _state(family.model, batch, loss_fn)
    monkeypatch.setattr("lightning_sac.apply.sac.create_selective_checkpoint_contexts", _contexts_before_2_12)
    handle = apply_plan(planned_model, plan, backend="sac")
    planned = _state(planned_model, batch, loss_fn)
    assert all(w.calls == 1 and w.mismatched_calls == 0 for w in handle.wrappers.values())
    assert not _equal(planned, plain)


def test_a_recompute_that_runs_other_ops_than_the_forward_is_refused(monkeypatch) -> None:
    # A block whose forward picks its code path by a counter: the recompute runs another op at the same position,
    # whose saved value would be another op's.
    class Flipping(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            y = self.linear(x)
            return y.relu() if self.calls % 2 else y.sigmoid()

    model = torch.nn.Sequential(Flipping())
    x = torch.randn(4, 8)
    profile = profile_model(model, (x,), loss_fn=lambda out: out.sum(), device="cpu")
    names = list(profile.modules["0"].op_stats.func_names)
    decision = ModuleDecision(
        discard_ratio=0.5, op_policy=[1] * len(names), recompute_ms=0.0, freed_bytes=0, op_names=names
    )
    monkeypatch.setattr("lightning_sac.apply.sac.create_selective_checkpoint_contexts", _contexts_before_2_12)
    model[0].calls = 0
    apply_plan(model, Plan(decisions={"0": decision}, budget_bytes=0), backend="sac")
    with pytest.raises(LightningSACError, match=r"recompute of '0' ran aten\.sigmoid\.default as its op \d+"):
        model(x).sum().backward()
