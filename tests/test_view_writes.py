"""Writes made through a view: a recompute rebuilds the written buffer with every write, on both backends.

Each module fills a buffer made by ``zeros_like`` through a view (slice assignment, ``index_put_``, ``scatter_``,
a view's ``copy_``, ``masked_fill_``, an ``as_strided`` write) and a linear layer reads the whole buffer, so its
weight gradient needs the buffer's final value. The plans recompute the buffer's producer; loss, every gradient and
every buffer must equal the plain model's exactly, and the calls must run the profiled ops.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import pytest
import torch
from conftest import adamw, recompute_all_policy
from torch import nn

from lightning_sac import ModuleDecision, Plan, profile_model
from lightning_sac.apply import apply_plan
from lightning_sac.apply.graph.backend import save_recompute_policy
from lightning_sac.solver.recompute import recomputed_ops

D = 8


def loop_slices(y: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros_like(y)
    for t in range(y.shape[1]):
        buf[:, t] = y[:, t].tanh() * (t + 1)
    return buf


def one_slice(y: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros_like(y)
    buf[:, 1:3] = y[:, :2].sigmoid()
    return buf


def index_put(y: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros_like(y)
    rows = torch.tensor([0, 2, 3])
    buf[:, 1].index_put_((rows,), y[:3, 0].exp())
    buf[1:].index_put_((torch.tensor([0, 1]),), y[:2].cos(), accumulate=True)
    return buf


def scatter(y: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros_like(y)
    index = torch.arange(D).flip(0).expand(y.shape[0], D)
    buf[:, 2].scatter_(1, index, y[:, 0].sin())
    return buf


def view_copy(y: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros_like(y)
    flat = buf.view(-1, D)  # taken before the writes: it must see them
    flat[::2].copy_(y.reshape(-1, D)[1::2].tanh())
    return buf + flat.sum()


def masked_fill(y: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros_like(y)
    buf.copy_(y.tanh())
    buf[:, 0].masked_fill_(y[:, 0] > 0, 0.5)
    return buf


def strided(y: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros_like(y)
    diagonal = buf.as_strided((y.shape[0], y.shape[1]), (buf.stride(0), buf.stride(1) + 1))
    diagonal.add_(y[:, 0, : y.shape[1]].square())
    return buf


PATTERNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    f.__name__: f for f in (loop_slices, one_slice, index_put, scatter, view_copy, masked_fill, strided)
}


class Fill(nn.Module):
    """A linear layer, a buffer filled by ``pattern``, a linear layer reading the whole buffer."""

    def __init__(self, pattern: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.pattern = pattern
        self.lin = nn.Linear(D, D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.pattern(self.lin(x)))


class Model(nn.Module):
    def __init__(self, pattern: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fill = Fill(pattern)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fill(x).square().mean()


def steps(
    model: nn.Module, x: torch.Tensor
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    optimizer = adamw(model.parameters())
    record = []
    for _ in range(2):
        loss = model(x)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        record.append((loss.detach(), grads, {n: b.clone() for n, b in model.named_buffers()}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return record


@pytest.mark.parametrize("backend", ["sac", "graph"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_recomputing_the_buffer_replays_every_write(pattern, backend):
    torch.manual_seed(0)
    model, x = Model(PATTERNS[pattern]), torch.randn(4, 5, D)
    profile = profile_model(model, (x,), loss_fn=lambda loss: loss, optimizer_factory=adamw, device="cpu")
    stats = profile.modules["fill"].op_stats
    assert stats is not None
    policy = recompute_all_policy(stats)
    producer = stats.func_names.index("aten.zeros_like.default")
    assert policy[producer] == 0
    # Every write lands on the buffer's storage, so the profile ties it to the buffer's producer.
    writes = [op for op, parent in stats.inplace_ops if parent == producer]
    assert writes and producer in stats.mutated_later
    if backend == "graph":
        # The graph backend rebuilds the buffer the output layer's backward reads: its producer and every write.
        assert {producer, *writes} <= set(recomputed_ops(stats, policy, "graph"))
    decision = ModuleDecision(
        discard_ratio=1.0, op_policy=policy, recompute_ms=0.0, freed_bytes=0, op_names=list(stats.func_names)
    )
    planned = copy.deepcopy(model)
    handle = apply_plan(planned, Plan(decisions={"fill": decision}, budget_bytes=0), backend=backend)
    plain_steps, planned_steps = steps(copy.deepcopy(model), x), steps(planned, x)
    wrapper = handle.wrappers["fill"]
    assert wrapper.calls == 2 and wrapper.mismatched_calls == 0, wrapper.last_mismatch
    for (plain_loss, plain_grads, plain_buffers), (loss, grads, buffers) in zip(
        plain_steps, planned_steps, strict=True
    ):
        assert torch.equal(loss, plain_loss)
        assert grads.keys() == plain_grads.keys()
        for n, g in plain_grads.items():
            assert torch.equal(grads[n], g), n
            assert g.abs().sum() > 0, n  # every layer learns: a lost write would zero the output layer's weight
        for n, b in plain_buffers.items():
            assert torch.equal(buffers[n], b), n


def test_a_long_scan_replays_its_writes_in_place_without_recursion(monkeypatch):
    """3000 steps, each a slice write that depends on the last: deeper than Python's recursion limit, and replayed
    into the recompute's own buffer, with no copy of it."""
    copies = []
    clone = torch.UntypedStorage.clone
    monkeypatch.setattr(torch.UntypedStorage, "clone", lambda self, *a, **k: copies.append(1) or clone(self, *a, **k))
    steps_ = 3000
    torch.manual_seed(0)
    x = torch.randn(2, steps_, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)

    def scan(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        buf = torch.zeros_like(x)
        h = torch.zeros(2, 4)
        for t in range(steps_):
            h = torch.tanh(h * 0.5 + x[:, t])
            buf[:, t] = h
        return (buf @ w).sum()

    with save_recompute_policy("recompute_all"):
        loss = scan(x, w)
    loss.backward()
    grads = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    plain = scan(x, w)
    plain.backward()
    assert torch.equal(loss, plain) and torch.equal(grads[0], x.grad) and torch.equal(grads[1], w.grad)
    assert not copies


class WriteInput(nn.Module):
    """Writes into its input through a view, then an op saves the input: the write must be kept, not replayed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x[:, 0] = self.lin(x[:, 1].clone()).tanh()
        return (x * self.scale).sigmoid()


class InputModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.write = WriteInput()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.write(self.pre(x)).square().mean()


@pytest.mark.parametrize("backend", ["sac", "graph"])
def test_a_write_into_the_modules_input_through_a_view_is_kept(backend):
    torch.manual_seed(0)
    model, x = InputModel(), torch.randn(4, 5, D)
    profile = profile_model(model, (x,), loss_fn=lambda loss: loss, optimizer_factory=adamw, device="cpu")
    stats = profile.modules["write"].op_stats
    assert stats is not None
    write = stats.func_names.index("aten.copy_.default")
    clone = stats.func_names.index("aten.clone.default")
    assert (write, write) in stats.inplace_ops  # its storage came from outside the module
    # The clone read the input before the write: only the kept write can stand for what it saw, so it is kept too.
    assert (clone, write) in stats.reads_before_overwrite
    policy = recompute_all_policy(stats)
    assert policy[write] == policy[clone] == 1
    decision = ModuleDecision(
        discard_ratio=1.0, op_policy=policy, recompute_ms=0.0, freed_bytes=0, op_names=list(stats.func_names)
    )
    planned = copy.deepcopy(model)
    handle = apply_plan(planned, Plan(decisions={"write": decision}, budget_bytes=0), backend=backend)
    plain_steps = steps(copy.deepcopy(model), x)
    if backend == "sac":
        # torch.utils.checkpoint reruns the forward on its input as it is now, written: autograd's version check
        # stops the backward (loudly, never a wrong gradient).
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            steps(planned, x)
        return
    planned_steps = steps(planned, x)
    assert handle.wrappers["write"].mismatched_calls == 0
    for (plain_loss, plain_grads, _), (loss, grads, _) in zip(plain_steps, planned_steps, strict=True):
        assert torch.equal(loss, plain_loss)
        for n, g in plain_grads.items():
            assert torch.equal(grads[n], g), n


# In-place ops whose gradient for their second argument reads ``self`` before the write: autograd keeps a clone of
# it, taken before the op (``original_self``), whose recompute reads the same output of ``w``'s maker as the write.
_WRITES_BY_A_TENSOR: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "div_ by its own sum (Qwen3-MoE's router)": lambda w, x: w.div_(w.sum(-1, keepdim=True)),
    "mul_ by its own sum": lambda w, x: w.mul_(w.sum(-1, keepdim=True)),
    "div_ by another tensor": lambda w, x: w.div_(x.sum(-1, keepdim=True) + 5),
    "div_ of a view": lambda w, x: w[:, :2].div_(w[:, 2:].sum(-1, keepdim=True) + 5),
}


@pytest.mark.parametrize("source", ["mul", "topk"])
@pytest.mark.parametrize("write", list(_WRITES_BY_A_TENSOR))
def test_a_write_by_a_tensor_keeps_the_value_its_gradient_reads(write, source):
    torch.manual_seed(0)
    x0 = torch.rand(64, 4) + 0.5  # positive: no sum near zero, every gradient finite

    def step(recompute: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = x0.clone().requires_grad_()
        with save_recompute_policy("recompute_all") if recompute else contextlib.nullcontext():
            w = x * 1.5 if source == "mul" else torch.topk(x, 3, -1)[0]
            _WRITES_BY_A_TENSOR[write](w, x)
            out = w.exp()  # saves its output: backward needs the written value, and the divisor's gradient w's old
        (grad,) = torch.autograd.grad(out.sum(), x)
        return out.detach(), grad

    plain, recomputed = step(False), step(True)
    assert torch.equal(plain[0], recomputed[0])
    # Before, the gradients differed by up to 5e12: the clone was recomputed from the divided values.
    assert torch.equal(plain[1], recomputed[1])
