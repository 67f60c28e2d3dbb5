"""Mixture-of-experts LMs and ops whose fake kernel fails where the real one runs.

Two real transformers MoE classes (``zoo.py``): Mixtral with the default grouped-mm experts (``aten._grouped_mm`` in
float32, whose meta kernel takes bfloat16 only) and OLMoE with the eager experts (a loop over the experts the routing
hits, ``nonzero`` and ``index_add_``). The dry run routes them on an even split of their ``top_k x tokens`` rows
(``dryrun/values/moe_routing.py``), the real step on whatever its random router gives; the grouped-mm experts'
memory does not depend on the split, the eager experts' is exact in sum, and a plan keeping some of an expert's ops
holds what the real routing puts there. Then the fallbacks of ``dryrun/values/meta_fallback.py`` on small modules
of our own.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from test_real_models import GIB, measured_planned_peak, reference, train_planned
from torch import nn

from lightning_sac import ProfilingError, profile_model, solve_plan
from lightning_sac.dryrun.measured import measure_training_step
from lightning_sac.dryrun.values.meta_fallback import grouped_mm_flops
from lightning_sac.dryrun.values.moe_routing import even_split, routing_bound_bytes

MOE = {"mixtral_grouped_mm": "grouped_mm", "olmoe_eager": "eager"}


def routed_rows(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[list[int]]:
    """Rows each expert gets in a real forward of ``model``, per experts module."""
    counts: list[list[int]] = []
    handles = [
        m.register_forward_pre_hook(lambda m, a: counts.append(torch.bincount(a[1].flatten(), minlength=4).tolist()))
        for n, m in model.named_modules()
        if n.endswith("mlp.experts")
    ]
    with torch.no_grad():
        model(**batch)
    for h in handles:
        h.remove()
    return counts


@pytest.mark.slow  # a long real-model cell: the matrix tier (the mechanism's unit tests are quick)
@pytest.mark.parametrize("name", list(MOE))
def test_the_plain_prediction_of_a_mixture_of_experts_matches_a_real_step(name):
    ref = reference(name)
    assert ref.family.model.config._experts_implementation == MOE[name]
    # The dry run's split: 512 tokens x top 2 = 1024 rows, 256 per expert, in each of the two layers.
    assert [c["rows_per_expert"] for c in ref.profile.routing] == [[256] * 4] * 2
    assert [c["rows_follow_routing"] for c in ref.profile.routing] == [MOE[name] == "eager"] * 2
    # The real routing is uneven (layer 1: 147 to 346 rows per expert), yet the plain step holds what every expert
    # keeps, linear in its rows: exact in sum.
    rows = routed_rows(copy.deepcopy(ref.family.model), ref.family.batch)
    assert [sum(r) for r in rows] == [1024, 1024] and max(max(r) for r in rows) > 300
    predicted = ref.profile.plain_peak_bytes
    assert abs(predicted - ref.plain_peak) <= 0.02 * ref.plain_peak, (predicted, ref.plain_peak)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sac", "graph"])
@pytest.mark.parametrize("name", list(MOE))
def test_a_plan_for_a_mixture_of_experts_holds_with_both_backends(name, backend):
    ref = reference(name)
    plan = solve_plan(ref.profile, 0.8 * ref.profile.peak_bytes / GIB, backend=backend)
    assert plan.decisions and plan.routing_layers == 2
    # Grouped-mm experts have every row in every tensor whatever the routing: nothing to bound.
    assert (plan.routing_bound_bytes == 0) == (MOE[name] == "grouped_mm")
    assert "mixture-of-experts" in plan.table()
    train_planned(ref, plan)
    measured = measured_planned_peak(ref, plan)
    predicted = plan.predicted_peak_bytes
    # At most 2% above; the eager experts' plan keeps ops of experts the real routing gives more rows than the
    # split (up to 346 of 256), within the plan's stated bound.
    assert measured <= 1.02 * predicted, (measured, predicted)
    assert measured <= predicted + plan.routing_bound_bytes, (measured, predicted, plan.routing_bound_bytes)
    assert measured <= ref.plain_peak


class GroupedExperts(nn.Module):
    """Four experts of 16 -> 32 applied to fixed groups of rows with one float32 ``torch._grouped_mm``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.weight = nn.Parameter(torch.randn(4, 32, 16) / 4)
        self.register_buffer("offs", torch.tensor([100, 300, 350, 512], dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(self.proj(x), self.weight.transpose(-2, -1), offs=self.offs).relu()


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.block = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def test_a_float32_grouped_matmul_is_profiled_by_its_shape_rule_with_exact_memory():
    torch.manual_seed(0)
    model = Wrapper(GroupedExperts())
    x = torch.randn(512, 16)
    meta = [t.detach().to("meta") for t in (x, model.block.weight.transpose(-2, -1), model.block.offs)]
    with pytest.raises(RuntimeError, match="BF16"):  # the meta kernel itself refuses float32
        torch._grouped_mm(meta[0], meta[1], offs=meta[2])
    loss = lambda out: out.square().mean()  # noqa: E731
    records: list[logging.LogRecord] = []
    catch = logging.Handler()
    catch.emit = records.append  # type: ignore[method-assign]
    torch_log = logging.getLogger("torch._subclasses.fake_tensor")  # torch's loggers do not propagate to the root
    torch_log.addHandler(catch)
    try:
        profile = profile_model(
            model, (x,), loss_fn=loss, optimizer_factory=lambda p: torch.optim.AdamW(p), device="cpu"
        )
    finally:
        torch_log.removeHandler(catch)
    assert not [r.getMessage() for r in records if r.levelno >= logging.ERROR]  # no torch traceback logged
    stats = profile.modules["block"].op_stats
    i = stats.func_names.index("aten._grouped_mm.default")
    assert stats.memory[i] == 512 * 32 * 4  # every row of the output, as the CPU kernel allocates it
    assert stats.runtimes[i] > 0
    # Forward and the two backward grouped matmuls (input and weight gradients) with their real kernels' layouts,
    # and what autograd saves for them: the step's peak is the real step's, to the byte.
    measured = measure_training_step(
        copy.deepcopy(model), (x,), loss_fn=loss, optimizer_factory=lambda p: torch.optim.AdamW(p)
    )
    assert profile.peak_bytes == measured.peak_bytes


def test_grouped_mm_flops_count_every_group_once():
    a, b = torch.empty(512, 16), torch.empty(4, 16, 32)
    assert grouped_mm_flops(a, b, out_val=torch.empty(512, 32)) == 2 * 512 * 16 * 32
    # The weight gradient (2D x 2D): its groups split the 512-long contraction.
    assert grouped_mm_flops(torch.empty(16, 512), torch.empty(512, 32), out_val=torch.empty(4, 16, 32)) == (
        2 * 16 * 512 * 32
    )


@torch.library.custom_op("lightning_sac_tests::gram_cholesky", mutates_args=())
def gram_cholesky(x: torch.Tensor) -> torch.Tensor:
    """A custom kernel without a fake implementation that cannot run on zeros (not positive-definite)."""
    return torch.linalg.cholesky(x @ x.mT)


class Whitening(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h * gram_cholesky(h.detach())


def test_an_op_no_fallback_answers_names_the_op_the_module_the_line_and_the_fix():
    torch.manual_seed(0)
    model = Wrapper(Whitening())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ProfilingError) as info:
        profile_model(model, (torch.randn(8, 16, 16),), device="cpu")
    err = info.value
    assert err.op == "lightning_sac_tests.gram_cholesky.default"
    assert err.module == "block"
    assert err.source is not None and "test_moe.py" in err.source and "gram_cholesky(h.detach())" in err.source
    text = str(err)
    assert "Module 'block' calls lightning_sac_tests.gram_cholesky.default at" in text
    assert "no fake impl registered" in text and "not positive-definite" in text  # why: fake, then real on zeros
    assert 'torch.library.register_fake("lightning_sac_tests::gram_cholesky")' in text
    assert "strict=False" in text and "The model was not changed." in text
    assert isinstance(err.__cause__, torch.linalg.LinAlgError)
    # Nothing of the model changed: weights, gradients, hooks.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())


def test_the_even_split_gives_each_row_distinct_experts_and_each_expert_its_share():
    index = even_split((512, 2), -1, 4, torch.int64)
    assert torch.bincount(index.flatten(), minlength=4).tolist() == [256] * 4
    assert bool((index[:, 0] != index[:, 1]).all())
    # A bound for a plan keeping part of an eager experts call: an expert gets at most every token once, E / k = 2
    # times its share, so what is kept of it can double.
    call = {"module": "mlp.experts", "experts": 4, "top_k": 2, "tokens": 512, "rows_follow_routing": True}
    assert routing_bound_bytes([call], {"mlp.experts": 1000}, {"mlp": ([1, 0, 1], 0)}) == 1000
    assert routing_bound_bytes([call], {"mlp.experts": 1000}, {"mlp.experts": ([1, 0], 400)}) == 600
    assert routing_bound_bytes([call], {"mlp.experts": 1000}, {"mlp": ([1, 1], 0)}) == 0  # all kept: exact in sum
    assert (
        routing_bound_bytes([{**call, "rows_follow_routing": False}], {"mlp.experts": 1000}, {"mlp": ([1, 0], 0)}) == 0
    )
