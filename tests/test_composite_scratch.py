"""An op's own scratch that its fake kernel does not make: ``_safe_softmax``, the softmax of SDPA's math kernel.

It allocates a ``bool`` of ``input == -inf`` and that one's ``all`` over ``dim`` inside the call (on an H200 the
attention of a fp32 Llama with grouped-query attention runs it: 64 MiB beyond its output). The dry run charges it
at the op, and a recompute that reruns the op holds it for that moment too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_sac import profile_model
from lightning_sac.dryrun import ModuleOpStats
from lightning_sac.dryrun.cpu.scratch import peak_beyond
from lightning_sac.ops import composite_scratch
from lightning_sac.profiling.op_items import op_items, op_stats_of
from lightning_sac.solver.candidates import _Transient
from lightning_sac.solver.recompute import recompute_transient

aten = torch.ops.aten


@pytest.mark.parametrize("shape", [(2, 4, 128, 128), (3, 5, 7)])
def test_the_scratch_is_what_the_cpu_kernel_allocates(shape):
    x = torch.randn(shape)
    x[..., -1, :] = float("-inf")  # a row the mask empties: zeroed, not NaN
    out, extra = peak_beyond(lambda: aten._safe_softmax.default(x, -1))
    rows = x.numel() // shape[-1]
    assert composite_scratch(aten._safe_softmax.default, (x, -1)) == [x.numel(), rows, 4]
    assert extra == x.numel() + rows + 4  # measured on the kernel: a bool per element, one per row, a float zero
    assert torch.equal(out[..., -1, :], torch.zeros_like(out[..., -1, :]))
    assert composite_scratch(aten._softmax.default, (x, -1, False)) == []


class _Attention(torch.nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d, 3 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, s, d)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x)).square().mean()


def test_the_dry_run_records_it_on_the_op_and_a_recompute_holds_it():
    torch.manual_seed(0)
    x = torch.randn(2, 256, 32)
    with sdpa_kernel(SDPBackend.MATH):
        profile = profile_model(_Net(), (x,), loss_fn=lambda out: out, device="cpu")
    stats = profile.modules["attn"].op_stats
    assert stats is not None
    [i] = [i for i, name in enumerate(stats.func_names) if name == "aten._safe_softmax.default"]
    scores = 2 * 4 * 256 * 256  # batch x heads x queries x keys
    assert (stats.workspace_ops, stats.workspace_bytes) == ([i], [scores + scores // 256 + 4])
    # The records of deep models carry it (extended layers keep every op's workspace).
    again = op_stats_of(op_items(stats), (stats.force_store_random, stats.output_saved_inside), stats.recompute_stop)
    assert (again.workspace_ops, again.workspace_bytes) == (stats.workspace_ops, stats.workspace_bytes)
    # Rerun or saved, against the same figures without the workspace: it counts only where the op reruns.
    bare = dataclasses.replace(stats, workspace_ops=[], workspace_bytes=[])
    everything = [0] * len(stats.func_names)
    saved = list(everything)
    saved[i] = 1
    for policy in (everything, saved, None):
        assert recompute_transient(stats, policy) >= recompute_transient(bare, policy)
        if policy is not None:  # the solver's running figure is the same
            assert _Transient(stats, policy, "sac").value() == recompute_transient(stats, policy)
    assert recompute_transient(stats, saved) == recompute_transient(bare, saved)


def test_a_recompute_holds_the_workspace_while_its_op_runs():
    # op 0 makes a temporary (freed once op 2 has run... its last reader is op 1), op 1 an activation, with 30 bytes
    # of workspace. Rerunning both: 100 alive at op 0, 200 at op 1 with the workspace 230, 100 after.
    stats = ModuleOpStats(
        func_names=["aten.mul.Tensor", "aten._safe_softmax.default", "aten.add.Tensor"],
        runtimes=[1.0, 1.0, 1.0],
        memory=[100, 100, 0],
        freed_at=[2, -1, -1],
        op_inputs=[[], [0], [1]],
        workspace_ops=[1],
        workspace_bytes=[30],
    )
    # Before the rerun the module holds its plain activations: op 1's 100 is missing until rebuilt.
    assert recompute_transient(stats, [0, 0, 0]) == -100 + 100 + 100 + 30
    assert recompute_transient(stats, [0, 1, 0]) == 100  # op 1 saved: never rerun, no workspace; op 0's temporary
    assert _Transient(stats, [0, 0, 0], "sac").value() == 130
    assert _Transient(stats, [0, 1, 0], "sac").value() == 100
