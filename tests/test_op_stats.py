"""SAC op statistics of non-leaf modules, and per-op runtime estimates, on modules small enough to check by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_sac import get_device_spec, profile_model


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # t (view) and addmm
        h = h + 1  # add: a new tensor, nothing saved for backward
        h.mul_(2)  # in-place on add's output
        x.detach()  # ignored by SAC: must not appear
        d = F.dropout(h, 0.5, self.training)  # random
        return torch.tanh(d.view(-1))  # view, then tanh (saves its output)


class Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _stats(device="cpu"):
    torch.manual_seed(0)
    p = profile_model(Root(), (torch.randn(4, 8),), device=device)
    return p, p.modules["body"].op_stats


def test_op_list_skips_sac_ignored_ops_and_classifies_each_op():
    _, s = _stats()
    names = s.func_names
    assert "aten.detach.default" not in names
    assert names[:2] == ["aten.t.default", "aten.addmm.default"]
    add, mul_ = names.index("aten.add.Tensor"), names.index("aten.mul_.Tensor")
    view, tanh = names.index("aten.view.default"), names.index("aten.tanh.default")
    assert names[-1] == "aten.tanh.default"
    assert {0, view} <= set(s.view_like_ops) and add not in s.view_like_ops
    assert (mul_, add) in s.inplace_ops  # parent: the op whose output storage mul_ mutates
    assert s.memory[0] == 0 and s.memory[view] == 0 and s.memory[mul_] == 0
    assert s.memory[names.index("aten.addmm.default")] == s.memory[add] == s.memory[tanh] == 4 * 8 * 4
    assert tanh in s.saved_autograd_ops and add not in s.saved_autograd_ops
    assert s.rand_ops and all(i > mul_ and i < view for i in s.rand_ops)  # CPU dropout: bernoulli_ on a fresh tensor
    assert s.force_store_random is False
    assert len(s.runtimes) == len(names) == len(s.memory)


def test_inplace_on_a_tensor_from_outside_the_module_is_its_own_parent():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(3)  # x comes from the parent
            return self.lin(x)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = Scale()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.scale(x * 1)

    p = profile_model(Outer(), (torch.randn(4, 8),), device="cpu")
    inner = p.modules["scale"].op_stats
    i = inner.func_names.index("aten.mul_.Tensor")
    assert (i, i) in inner.inplace_ops
    outer = p.modules[""].op_stats
    j, k = outer.func_names.index("aten.mul.Tensor"), outer.func_names.index("aten.mul_.Tensor")
    assert (k, j) in outer.inplace_ops  # seen from the root, the storage was made by x * 1


def test_module_without_tensor_inputs_forces_random_ops_to_be_stored():
    class Noise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, n: int) -> torch.Tensor:
            return self.lin(torch.rand(n, 8))

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.noise = Noise()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.noise(x.shape[0]) * x

    p = profile_model(Outer(), (torch.randn(4, 8),), device="cpu")
    s = p.modules["noise"].op_stats
    assert s.force_store_random is True
    assert s.rand_ops == [s.func_names.index("aten.rand.default")]
    assert p.modules[""].op_stats.force_store_random is False


def test_roofline_runtime_of_a_matmul_is_max_of_compute_and_traffic():
    p, s = _stats("H100-SXM")
    spec = get_device_spec("H100-SXM")
    i = s.func_names.index("aten.addmm.default")
    flops = 2 * 4 * 8 * 8
    moved = (8 + 4 * 8 + 8 * 8 + 4 * 8) * 4  # bias, input, weight.t(), output
    expected_ms = max(flops / (spec.peak_tflops(torch.float32) * 1e12), moved / (spec.dram_gbps * 1e9)) * 1e3
    assert s.runtimes[i] == expected_ms
    assert s.runtimes[s.func_names.index("aten.t.default")] == 0.0  # views launch no kernel
    assert p.modules["body"].forward_ms == sum(s.runtimes)


def test_benchmark_estimate_times_real_ops_on_this_cpu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)))
    p = profile_model(model, (torch.randn(32, 64),), device="cpu", estimate="benchmark")
    s = p.modules["0"].op_stats
    # Every op that runs a kernel was timed for real (a positive time); views run none and cost nothing. How
    # long each took is this machine's, and its load's: how fast the estimate is belongs to benchmarks/.
    assert s.func_names.count("aten.addmm.default") == 2 and "aten.relu.default" in s.func_names
    for i, (name, ms) in enumerate(zip(s.func_names, s.runtimes, strict=True)):
        assert (ms == 0.0) if i in s.view_like_ops else (0.0 < ms < math.inf), (name, ms)
    assert p.estimate == "benchmark" and p.backward_ms > 0


class _Clock:
    """``time`` for the estimator: each repeat of the op takes the next of ``took`` seconds."""

    def __init__(self, took: list[float]) -> None:
        self.took, self.now, self.reads = list(took), 0.0, 0

    def perf_counter(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:  # the read after the op: the op took its time
            self.now += self.took.pop(0)
        return self.now


def test_benchmark_keeps_the_fastest_of_at_least_three_repeats_until_enough_time_was_measured(monkeypatch):
    from lightning_sac.dryrun import runtime

    x = torch.ones(64, 64)
    out = torch.relu(x)

    def timed(took: list[float], **kwargs: float) -> tuple[float, int]:
        clock = _Clock(took)
        monkeypatch.setattr(runtime, "time", clock)
        ms = runtime.BenchmarkEstimator(**kwargs)(torch.ops.aten.relu.default, (x,), {}, out)
        return ms, clock.reads // 2

    # Interference only adds time: the fastest repeat counts. At least 3 repeats, then until 2 ms were measured.
    assert timed([3e-3, 1e-3, 2e-3, 9.0]) == (1.0, 3)
    assert timed([1e-4, 3e-4, 2e-4, 1e-3, 5e-4, 9.0]) == (pytest.approx(0.1), 5)  # 2.1 ms after the 5th
    # At most max_repeats, however little was measured.
    assert timed([1e-5] * 25, max_repeats=20) == (pytest.approx(0.01), 20)
    # Cached by op and argument signature: a second call with the same shapes runs nothing.
    estimator = runtime.BenchmarkEstimator()
    clock = _Clock([3e-3, 1e-3, 2e-3])
    monkeypatch.setattr(runtime, "time", clock)
    assert estimator(torch.ops.aten.relu.default, (x,), {}, out) == 1.0
    assert estimator(torch.ops.aten.relu.default, (torch.zeros(64, 64),), {}, out) == 1.0 and clock.reads == 6


def test_benchmark_times_ops_through_their_out_overload_with_the_same_outputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_sac.dryrun.runtime import _out_variant

    aten = torch.ops.aten
    with FakeTensorMode():
        x, w, b = torch.empty(8, 16), torch.empty(16), torch.empty(16)
        outs = [aten.add.Tensor(x, x), aten.mul.Scalar(x, 2.0), aten.native_layer_norm.default(x, [16], w, b, 1e-5)]
        softmax = aten._safe_softmax.default(x, -1)
    # Called as the estimator calls it, with fake mode off.
    add = _out_variant(aten.add.Tensor, outs[0])
    mul = _out_variant(aten.mul.Scalar, outs[1])
    norm = _out_variant(aten.native_layer_norm.default, outs[2])
    assert add is not None and add[0] is aten.add.out and list(add[1]) == ["out"]
    assert mul is not None and mul[0] is aten.mul.Scalar_out  # the overload taking a Scalar, not add.out's Tensor
    assert norm is not None and list(norm[1]) == ["out0", "out1", "out2"]
    # Real tensors of the outputs' shapes, to be written into on every repeat.
    assert [tuple(t.shape) for t in norm[1].values()] == [(8, 16), (8, 1), (8, 1)]
    assert not any(isinstance(t, torch._subclasses.FakeTensor) for t in norm[1].values())
    assert _out_variant(aten._safe_softmax.default, softmax) is None  # no out= overload: timed as it is
    assert _out_variant(aten.add_.Tensor, x) is None  # in place: allocates nothing anyway
