"""Tensor parallelism (``parallelize_module`` with ColwiseParallel/RowwiseParallel): planned per rank, exactly.

One process as rank 0 of torch's ``fake`` process group: ``parallelize_module`` and ``fully_shard`` shard as over
real ranks, every rank's compute runs on real CPU tensors, and each collective allocates its buffer as over gloo
(``funcol.all_reduce`` clones, then reduces in place; the fake group moves no data), so the measured peak of a
real step is the rank's. The strategy matrix's ``tp2-fsdp2`` cell (``tests/test_strategy_matrix.py``, slow) fits
TP 2 x FSDP2 2 on 4 gloo processes. Measured peaks are torch.profiler's allocator events
(``measure_training_step``), compared byte for byte: each rank's step is deterministic and the dry run counts
the same allocations.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from conftest import fake_ranks
from sharded_fits import tiny_llama
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from zoo import lm_batch

from lightning_sac import ModelProfile, ProfilingError, apply_plan, profile_model, solve_plan
from lightning_sac.dryrun.emulation import fake_copy
from lightning_sac.dryrun.measured import measure_training_step
from lightning_sac.sharding import declared_tensor_parallel

GIB = 2**30
COLS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWS = ("self_attn.o_proj", "mlp.down_proj")


@pytest.fixture
def two_ranks() -> Iterator[None]:
    with fake_ranks(2):
        yield


def padded_batch() -> dict[str, torch.Tensor]:
    return lm_batch(128, batch=4, seq=64, pad_from=48)


@pytest.fixture(scope="module")
def tp_profile() -> ModelProfile:
    """The TP 2 Llama's profile with AdamW on :func:`padded_batch` (the process group is gone once it is made)."""
    with fake_ranks(2):
        return profile_model(tp_llama(2), padded_batch(), optimizer_factory=adamw, device="cpu")


def layer_plan() -> dict[str, object]:
    """torchtitan's per-layer plan for Llama without sequence parallelism (Hugging Face's ``base_model_tp_plan``)."""
    return {**{n: ColwiseParallel() for n in COLS}, **{n: RowwiseParallel() for n in ROWS}}


def tp_llama(size: int) -> nn.Module:
    torch.manual_seed(0)
    model = tiny_llama()
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
    for layer in model.model.layers:
        parallelize_module(layer, mesh, layer_plan())
    return model


class Block(nn.Module):
    """A column-parallel linear, then a row-parallel one, no residual: the all-reduced output is the block's."""

    def __init__(self, h: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(h, h // 2)
        self.down = nn.Linear(h // 2, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def tp_blocks(size: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
    for block in model:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def adamw(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)  # type: ignore[arg-type]


def test_the_copy_computes_as_one_rank_without_the_styles_hooks(two_ranks: None) -> None:
    model = tp_llama(2)
    copy = fake_copy(model, FakeTensorMode(), "cpu")
    attn, mlp = copy.model.layers[0].self_attn, copy.model.layers[0].mlp
    # hidden 64, 4 heads of 16, 2 KV heads, intermediate 176: the column-parallel rows and row-parallel columns halved
    assert attn.q_proj.weight.shape == (32, 64) and attn.k_proj.weight.shape == (16, 64)
    assert attn.o_proj.weight.shape == (64, 32)
    assert mlp.gate_proj.weight.shape == (88, 64) and mlp.down_proj.weight.shape == (64, 88)
    assert copy.model.embed_tokens.weight.shape == (128, 64)  # not parallelized: whole
    assert not any(isinstance(p, DTensor) for p in copy.parameters())
    # The user's model keeps its DTensors and its styles' hooks.
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q.weight, DTensor) and q.weight.placements == (Shard(0),) and q.weight.shape == (64, 64)
    assert len(q._forward_pre_hooks) == len(q._forward_hooks) == 1


def test_the_collectives_buffers_are_counted_to_the_byte(two_ranks: None) -> None:
    # The row-parallel output's all-reduce holds a second copy of the output beside the partial one, and in
    # backward each column-parallel input's partial gradient is all-reduced into a new buffer. Without them this
    # model's predicted peak is 22% low (924,136 against 1,184,064 bytes when they were first counted).
    x = torch.randn(64, 32, 32)
    profile = profile_model(tp_blocks(2), (x,), loss_fn=lambda out: out.sum(), device="cpu")
    measured = measure_training_step(tp_blocks(2), (x,), loss_fn=lambda out: out.sum())
    assert profile.plain_peak_bytes == measured.peak_bytes


def _two_steps(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    optimizer = adamw(model.parameters())
    out = []
    for _ in range(2):
        loss = model(**batch).loss
        loss.backward()
        grads = {
            n: p.grad.to_local().clone() if isinstance(p.grad, DTensor) else p.grad.clone()
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        out.append((loss.detach(), grads))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("fraction", [pytest.param(0.8, marks=pytest.mark.slow), 0.6])  # 4 s each
def test_a_planned_tp_llama_holds_its_plan_its_values_and_its_prediction(
    tp_profile: ModelProfile, two_ranks: None, fraction: float
) -> None:
    batch, profile = padded_batch(), tp_profile
    plain = measure_training_step(tp_llama(2), batch, optimizer_factory=adamw).peak_bytes
    assert profile.plain_peak_bytes == plain
    plan = solve_plan(profile, fraction * plain / GIB)
    assert plan.decisions
    planned = tp_llama(2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="lightning-sac")  # no call may leave the profiled ops
        handle = apply_plan(planned, plan)
        measured = measure_training_step(planned, batch, optimizer_factory=adamw).peak_bytes
    # Never under, and at most 1% over: a partly discarded decoder layer is predicted up to 16,896 bytes high on this
    # model with or without tensor parallelism (the memory model's slack, not TP's).
    assert measured <= plan.predicted_peak_bytes <= 1.01 * measured
    assert all(w.calls == 2 and w.mismatched_calls == 0 for w in handle.wrappers.values())
    handle.remove()
    # The graph backend reruns its own recorded graph, collectives included: refused, the model left as it was.
    with pytest.raises(ValueError, match="contains tensor-parallel modules; the 'graph' backend"):
        apply_plan(planned, plan, backend="graph")
    assert all("forward" not in m.__dict__ for m in planned.modules())
    # Loss and every gradient of two steps, bit for bit against the plain parallelized model.
    again = tp_llama(2)
    handle = apply_plan(again, plan)
    for (loss, grads), (plain_loss, plain_grads) in zip(
        _two_steps(again, batch), _two_steps(tp_llama(2), batch), strict=True
    ):
        assert torch.equal(loss, plain_loss)
        assert grads.keys() == plain_grads.keys()
        assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)


def _parallelized(plan: Callable[[], dict[str, object]]) -> nn.Module:
    torch.manual_seed(0)
    model = tiny_llama()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize_module(model.model.layers[0], mesh, plan())
    return model


@pytest.mark.parametrize(
    ("plan", "named"),
    [
        (lambda: {"input_layernorm": SequenceParallel()}, "'model.layers.0.input_layernorm' (LlamaRMSNorm) has Seq"),
        (lambda: {"mlp.up_proj": ColwiseParallel(output_layouts=Shard(1))}, "'model.layers.0.mlp.up_proj' (Linear)"),
    ],
    ids=["sequence-parallel", "colwise-sharded-output"],
)
def test_a_style_the_copy_does_not_reproduce_is_refused_before_anything_runs(
    two_ranks: None, plan: Callable[[], dict[str, object]], named: str
) -> None:
    model = _parallelized(plan)
    before = {n: (type(p), tuple(p.shape)) for n, p in model.named_parameters()}
    with pytest.raises(ProfilingError, match="ColwiseParallel\\(\\) and RowwiseParallel\\(\\)") as info:
        profile_model(model, lm_batch(128, batch=2, seq=16), device="cpu")
    assert named in str(info.value) and "Sequence parallelism" in str(info.value)
    assert {n: (type(p), tuple(p.shape)) for n, p in model.named_parameters()} == before


def test_a_declared_plan_copies_as_parallelize_module_shards(two_ranks: None) -> None:
    # The command line's --tp: an unparallelized model, the styles named; the copy's shapes and its predicted peak
    # are those of the model parallelize_module shards.
    torch.manual_seed(0)
    model = tiny_llama()
    styles = {f"model.layers.{i}.{n}": "colwise" for i in range(3) for n in COLS}
    styles |= {f"model.layers.{i}.{n}": "rowwise" for i in range(3) for n in ROWS}
    declared = declared_tensor_parallel(model, styles, 2)
    real = fake_copy(tp_llama(2), FakeTensorMode(), "cpu")
    assert {n: tuple(p.shape) for n, p in declared.named_parameters()} == {
        n: tuple(p.shape) for n, p in real.named_parameters()
    }
    assert model.model.layers[0].mlp.up_proj.weight.shape == (176, 64)  # the model is not changed
    assert declared.model.embed_tokens.weight is model.model.embed_tokens.weight  # the rest is shared, not copied
    batch = lm_batch(128, batch=8, seq=128)
    from_declared = profile_model(declared, batch, optimizer_factory=adamw, device="cpu")
    assert (
        from_declared.plain_peak_bytes == measure_training_step(tp_llama(2), batch, optimizer_factory=adamw).peak_bytes
    )
    with pytest.raises(ValueError, match="does not split evenly over 3"):
        declared_tensor_parallel(model, styles, 3)
    with pytest.raises(ValueError, match="only linear layers"):
        declared_tensor_parallel(model, {"model.layers.0.input_layernorm": "colwise"}, 2)


def test_tensor_parallelism_alone_is_planned_without_ddps_gradient_buckets(two_ranks: None) -> None:
    # ModelParallelStrategy never wraps the model in DDP: with tensor parallelism and no fully_shard, a plan for its
    # 2 ranks must not count the gradient buckets of a 2-rank DDP (343,808 bytes over the measured peak in the
    # strategy harness's TP-only fit on 2 gloo ranks before it was so).
    from types import SimpleNamespace

    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_sac import AutoSAC, get_device_spec

    spec, model = get_device_spec("L4"), tp_llama(2)
    tp_only = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    trainer = SimpleNamespace(strategy=tp_only, lightning_module=model, world_size=2)
    assert AutoSAC(budget_gb=10)._settings(trainer, spec) == (10.0, 1, "replicated")
    ddp = SimpleNamespace(model=model)  # any other strategy of 2 ranks keeps its world size
    assert (
        AutoSAC(budget_gb=10)._settings(SimpleNamespace(strategy=ddp, lightning_module=model, world_size=2), spec)[1]
        == 2
    )


def test_no_plan_saves_an_op_past_the_early_stop(tp_profile: ModelProfile) -> None:
    # A row-parallel linear's partial sums (the MLP's last matmul) are freed once all-reduced, after the MLP's last
    # saved tensor: SAC's recompute stops before it, so a plan that saved it held 65,536 bytes (4 x 64 x 64 fp32)
    # unread until the MLP's backward ended, above its prediction (a 60% plan of this model measured so). The op
    # knapsack may still save it (its curves are as they were); the plan's policies never do.
    from lightning_sac.solver import optimal_op_policy
    from lightning_sac.solver.decisions import past_the_stop_recomputed

    profile = tp_profile
    stats = profile.modules["model.layers.2.mlp"].op_stats
    last_mm = len(stats.func_names) - 2  # ..., mm, _unsafe_view: the partial sums before the stand-in all-reduce
    assert stats.func_names[last_mm] == "aten.mm.default" and stats.recompute_stop == last_mm
    assert stats.memory[last_mm] == 4 * 64 * 64 * 4 and stats.freed_at[last_mm] >= 0
    knapsack = [optimal_op_policy(stats, f / 10) for f in range(11)]
    assert any(policy[last_mm] for policy in knapsack)
    assert not any(past_the_stop_recomputed(stats, policy, "sac")[last_mm] for policy in knapsack)
    for fraction in (0.9, 0.8, 0.7, 0.6):
        plan = solve_plan(profile, fraction * profile.plain_peak_bytes / GIB)
        for fqn, decision in plan.decisions.items():
            stop = profile.modules[fqn].op_stats.recompute_stop
            assert stop is not None and not any(decision.op_policy[stop:]), (fraction, fqn)


def test_a_dtensor_op_is_never_skipped_in_a_recompute(two_ranks: None) -> None:
    # A recompute skips a matmul whose value nothing needs (a GPT-2 MLP's projection before dropout) by standing a
    # NaN tensor of its layout in for it. A tensor-parallel linear's matmul runs on DTensors: a plain tensor of the
    # global layout in its place broke the style's output hook (`'Tensor' object has no attribute 'placements'`).
    from torch.distributed.tensor import Replicate, distribute_tensor

    from lightning_sac.apply.skip_dead import placeholder

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    a, b = torch.randn(4, 8), torch.randn(8, 6)
    assert placeholder(torch.ops.aten.mm.default, (a, b), {}).shape == (4, 6)
    da, db = distribute_tensor(a, mesh, [Replicate()]), distribute_tensor(b, mesh, [Shard(1)])
    assert placeholder(torch.ops.aten.mm.default, (da, db), {}) is None


def test_sequence_parallelism_under_fsdp2_is_refused_too() -> None:
    # FSDP's check of the model came first and did not ask the TP one: a sequence-parallel norm under fully_shard
    # was copied without its style's effect (its hooks dropped, no stand-in) and planned as if whole.
    from torch.distributed.fsdp import fully_shard

    with fake_ranks(4):
        torch.manual_seed(0)
        model = tiny_llama()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model.model.layers[0], mesh["tp"], {"input_layernorm": SequenceParallel()})
        fully_shard(model, mesh=mesh["dp"])
        with pytest.raises(ProfilingError, match="'model.layers.0.input_layernorm' \\(LlamaRMSNorm\\) has Seq"):
            profile_model(model, lm_batch(128, batch=2, seq=16), device="cpu")
