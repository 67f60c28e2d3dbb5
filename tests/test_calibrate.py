"""What wrapping a module costs, measured on a real copy of the module when profiling for this CPU."""

from __future__ import annotations

import copy
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from conftest import Case
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from zoo import ResNet

from lightning_sac import profile_model, solve_plan
from lightning_sac.demos import GPT, GPTConfig
from lightning_sac.dryrun.modules.inputs import TensorSpec, input_spec
from lightning_sac.profiling import calibrate
from lightning_sac.solver.knapsack import least_kept_policy
from lightning_sac.solver.recompute import fixed_overhead_ms, overhead_ms, recompute_ms
from lightning_sac.solver.tradeoff import effective_memory

GIB = 2**30


PARTS = {"TransformerBlock": "", "CausalSelfAttention": ".attn", "MLP": ".mlp"}


@dataclass
class Steps:
    """What the calibration ran: per class of measured module, each timed step's leaf-module calls, and the copies."""

    leaf_calls: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    copies: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))


# Small shapes: these tests check what was measured and how, not how long it took.
SMALL_GPT = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1)


def small_gpt_case() -> Case:
    torch.manual_seed(0)
    idx, targets = torch.randint(0, SMALL_GPT.vocab_size, (2, 2, 32)).unbind(0)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return Case("gpt", GPT(SMALL_GPT), (idx,), loss)


@pytest.fixture(scope="module")
def gpt_benchmark():
    case = small_gpt_case()
    before = copy.deepcopy(case.model.state_dict())
    rng = torch.get_rng_state()
    steps, step = Steps(), calibrate._step

    def counted(module: nn.Module, *args: Any) -> tuple[float, float]:
        calls = [0]
        leaves = [m for m in module.modules() if not list(m.children())]
        hooks = [m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in leaves]
        try:
            return step(module, *args)
        finally:
            for h in hooks:
                h.remove()
            steps.leaf_calls[type(module).__name__].append(calls[0])
            steps.copies[type(module).__name__].add(id(module))

    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as mp:
        warnings.simplefilter("error")  # every module runs on synthetic inputs: nothing to warn about
        mp.setattr(calibrate, "_step", counted)
        profile = profile_model(case.model, case.inputs, loss_fn=case.loss_fn, device="cpu", estimate="benchmark")
    return case, profile, before, rng, steps


def test_modules_are_measured_once_per_kind_and_the_model_is_untouched(gpt_benchmark):
    case, profile, before, rng, steps = gpt_benchmark
    measured = {fqn: m.measured_overhead for fqn, m in profile.modules.items() if m.measured_overhead}
    # Blocks, attention and MLPs; not the root (its forward and backward are the whole step but the loss).
    assert sorted(measured) == sorted(f"blocks.{i}{part}" for i in range(2) for part in ("", ".attn", ".mlp")), sorted(
        measured
    )
    assert profile.modules[""].measured_overhead == {}
    # Identical modules with identical inputs are measured once: block 1 has block 0's very numbers.
    for part in ("", ".attn", ".mlp"):
        assert measured[f"blocks.1{part}"] == measured[f"blocks.0{part}"]
    for by_backend in measured.values():
        assert set(by_backend) == {"sac", "graph"}
        # Times, which a busy CPU stretches at random: only their form is checked here (their quality is
        # benchmarks/'s); how they were taken is checked below.
        assert all(math.isfinite(x) for v in by_backend.values() for x in v)
        assert all(fixed_ms >= 0.0 and factor >= 0.0 for fixed_ms, factor, *_ in by_backend.values())
    # One copy of each kind ran (block 1 reused block 0's figures), in the interleaved rounds: a warm-up, then
    # 6 to 20 timed ones. A round steps each configuration once: plain; SAC keeping all and recomputing all;
    # graph AC the same; and, since each kind's most-discarding policy saves nothing, SAC as a plain checkpoint
    # (stepped twice: the first call of a kind runs under the policy, untimed).
    assert {k: len(v) for k, v in steps.copies.items()} == {"TransformerBlock": 1, "CausalSelfAttention": 1, "MLP": 1}
    for kind, calls in steps.leaf_calls.items():
        rounds, rest = divmod(len(calls), 7)
        assert rest == 0 and 7 <= rounds <= 21, (kind, len(calls))
        # What each step ran, counted in calls of the copy's leaf modules: once in a plain forward; twice where
        # SAC reruns the module's forward in backward; once under graph AC, which reruns ops, not modules.
        leaves = len(
            [m for m in case.model.get_submodule(f"blocks.0{PARTS[kind]}").modules() if not list(m.children())]
        )
        one, two = leaves, 2 * leaves
        assert calls == [one, two, two, one, one, two, two] * rounds, kind
    assert len(measured["blocks.0"]["sac"]) == 3 and len(measured["blocks.0"]["graph"]) == 2
    # Only copies ran: the user's weights, gradients and random stream are as they were.
    for k, v in case.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in case.model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_plans_use_the_measured_overhead(gpt_benchmark):
    _, profile, _, _, _ = gpt_benchmark
    for backend in ("sac", "graph"):
        plan = solve_plan(profile, profile.peak_bytes * 0.7 / GIB, backend=backend)
        assert plan.decisions
        for fqn, d in plan.decisions.items():
            m = profile.modules[fqn]
            fixed, factor, *whole = m.measured_overhead[backend]
            expected = fixed + (factor - 1) * recompute_ms(m.op_stats, d.op_policy, backend)
            if whole and not any(d.op_policy):  # run as a plain checkpoint, timed as one
                expected = whole[0] - recompute_ms(m.op_stats, d.op_policy, backend)
            assert d.overhead_ms == pytest.approx(expected, rel=1e-12)
        assert plan.predicted_overhead_ms == pytest.approx(sum(d.overhead_ms for d in plan.decisions.values()))


def test_measured_overhead_by_hand():
    from test_op_stats import _stats

    _, s = _stats()
    policy = [1, 1, 0, 0, 0, 0, 0, 1, 1, 0]
    # Measured: wrapping costs 3 ms, and the rerun takes 1.5x the profile's op times.
    assert fixed_overhead_ms(s, "sac", [50.0, 20.0], measured=[3.0, 1.5]) == 3.0
    rerun = recompute_ms(s, policy, "sac")
    assert rerun > 0
    assert overhead_ms(s, policy, "sac", [50.0, 20.0], measured=[3.0, 1.5]) == pytest.approx(3.0 + 0.5 * rerun)
    # The per-op figures are not used once the module is measured.
    assert overhead_ms(s, policy, "graph", [0.0, 0.0], measured=[3.0, 1.0]) == 3.0


class _NeedsProfiledData(nn.Module):
    """Runs on the profile's fake tensors, and refuses any other input (as a module checking its data would)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 64), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, FakeTensor):
            raise RuntimeError("expected the profiled batch")
        return self.body(x)


def test_a_module_that_cannot_run_on_synthetic_inputs_is_named_once_and_keeps_per_op_figures():
    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 64), nn.Tanh())

    # Four blocks of like cost: none is more than half the step, so all are meant to be measured.
    model = nn.Sequential(block(), _NeedsProfiledData(), block(), block(), nn.Linear(64, 1))
    with pytest.warns(
        UserWarning, match=r"could not run these modules.*'1' \(RuntimeError: expected the profiled"
    ) as rec:
        profile = profile_model(model, (torch.randn(4096, 64),), device="cpu", estimate="benchmark")
    assert len([w for w in rec if "could not run these modules" in str(w.message)]) == 1
    assert profile.modules["1"].measured_overhead == {}
    assert all(set(profile.modules[f].measured_overhead) == {"sac", "graph"} for f in ("0", "2", "3"))
    assert profile.backend_overhead_us  # what a plan charges for it instead (see test_recompute)


class _OtherPathOnRealData(nn.Module):
    """Runs one op more on real tensors than on the profile's fake ones: the plan's op sequence does not hold."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 64), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return y if isinstance(x, FakeTensor) else y * 1.0


def test_a_module_that_runs_other_ops_for_real_is_not_measured():
    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 64), nn.Tanh())

    model = nn.Sequential(block(), _OtherPathOnRealData(), block(), block(), nn.Linear(64, 1))
    with pytest.warns(UserWarning, match=r"'1' \(RuntimeError: on synthetic inputs it ran other ops than in the "):
        profile = profile_model(model, (torch.randn(4096, 64),), device="cpu", estimate="benchmark")
    assert profile.modules["1"].measured_overhead == {}
    assert all(set(profile.modules[f].measured_overhead) == {"sac", "graph"} for f in ("0", "2", "3"))


def test_a_meta_model_is_not_measured():
    with torch.device("meta"):
        model = nn.Sequential(nn.Sequential(nn.Linear(64, 64), nn.ReLU()), nn.Linear(64, 1))
    profile = profile_model(model, (torch.randn(32, 64),), device="cpu", estimate="benchmark")
    assert all(m.measured_overhead == {} for m in profile.modules.values())
    assert profile.backend_overhead_us  # the per-op figures still apply


def test_input_spec_keeps_layout_not_tensors():
    x = torch.randn(4, 6).t()
    ids = torch.zeros(3, dtype=torch.long)
    spec = input_spec(((x, 2.0), {"ids": ids, "flag": True}))
    (sx, scalar), kwargs = spec
    assert sx == TensorSpec((6, 4), (1, 6), 0, torch.float32, False)
    assert scalar == 2.0 and kwargs["flag"] is True
    real = sx.materialize()
    assert real.shape == (6, 4) and real.stride() == (1, 6)
    assert real.min() >= 0.5 and real.max() <= 1.5  # positive floats of a typical scale
    assert torch.equal(kwargs["ids"].materialize(), torch.zeros(3, dtype=torch.long))  # valid indices
    grad_spec = input_spec(torch.ones(2, requires_grad=True))
    assert grad_spec.materialize().requires_grad and grad_spec.materialize().is_leaf


@pytest.mark.slow  # about 30 s of calibration runs: the quick tier's 5-minute bound
def test_residual_blocks_whose_batch_norm_must_be_saved_are_measured():
    # A ResNet block's first BatchNorm writes running statistics and its output is no block output: every policy
    # saves it, so "recompute everything" (a budget of 0) has no policy. Such blocks were named in a warning as
    # modules that "could not run" and kept the per-op figures; they are measured with the least they can keep.
    torch.manual_seed(0)
    images, labels = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))  # small: nothing here needs size
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        profile = profile_model(
            ResNet().train(),
            (images,),
            loss_fn=lambda out: nn.functional.cross_entropy(out, labels),
            device="cpu",
            estimate="benchmark",
        )
    # Every residual block runs far fewer than half the step's forward ops: each is measured, whatever the timings.
    blocks = [f for f in profile.modules if f.startswith("layer") and f.count(".") == 1]
    root_ops = len(profile.modules[""].op_stats.func_names)
    assert len(blocks) == 4 and all(2 * len(profile.modules[f].op_stats.func_names) <= root_ops for f in blocks)
    for fqn in blocks:
        stats = profile.modules[fqn].op_stats
        least = least_kept_policy(stats)
        assert any(least)  # the block must keep something: the case at hand
        assert sum(m for m, keep in zip(effective_memory(stats), least, strict=True) if keep) > 0
        measured = profile.modules[fqn].measured_overhead
        assert set(measured) == {"sac", "graph"}, fqn
        assert all(len(v) == 2 for v in measured.values())  # no plain-checkpoint figure: BN inside
        assert all(math.isfinite(x) and x >= 0.0 for v in measured.values() for x in v)
