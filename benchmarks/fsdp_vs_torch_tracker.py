"""Per-rank peak of an FSDP2 step: our prediction and PyTorch's ``FSDPMemTracker``'s, each against the measured one.

The strategy matrix's model (a Hugging Face Llama, 3 layers, hidden 64, batch 4 x 128, AdamW), sharded with
``fully_shard`` per decoder layer and then the root, for each FSDP2 cell of the matrix: world sizes 1, 2 and 4,
"32-true" and bf16 autocast (Lightning's "bf16-mixed"), FSDP2's ``MixedPrecisionPolicy`` (bf16 parameters, fp32
reduction), ``reshard_after_forward=False``, HSDP over a 2 x 2 mesh, and tensor parallelism 2 x FSDP2 2 (each
layer's linears column- and row-parallel over the mesh's ``tp`` dim, as torchtitan's plan without sequence
parallelism, then ``fully_shard`` over ``dp``). Everything runs in this one process as rank
0 of torch's ``fake`` process group of that world size: its collectives move no data but allocate as real ones do,
so rank 0's memory is a real rank's (the matrix's multi-process fits measure the same figures to the byte).

- measured: torch.profiler's allocator events of the second real step (the first makes AdamW's state), the
  profiler started before the model exists;
- ours: ``profile_step`` (Lightning's order) on the sharded model, and the plan's unplanned per-rank peak
  (``solve_plan``);
- torch: ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` around two steps of the same sharded model
  built under ``FakeTensorMode`` (its documented use as an estimator), the peak of the second.

    python benchmarks/fsdp_vs_torch_tracker.py
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sharded_fits import tiny_llama  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.profiler import ProfilerActivity, record_function  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from lightning_sac import solve_plan  # noqa: E402
from lightning_sac.dryrun.measured import QuietProfile  # noqa: E402
from lightning_sac.profiling import profile_step  # noqa: E402

CELLS = [
    (1, "fsdp2", "32-true"),
    (1, "fsdp2", "bf16-mixed"),
    (1, "fsdp2-mp", "32-true"),
    (2, "fsdp2", "32-true"),
    (2, "fsdp2", "bf16-mixed"),
    (2, "fsdp2-mp", "32-true"),
    (2, "fsdp2-keep", "32-true"),
    (4, "fsdp2", "32-true"),
    (4, "fsdp2", "bf16-mixed"),
    (4, "fsdp2-mp", "32-true"),
    (4, "fsdp2-keep", "32-true"),
    (4, "fsdp2-reshard2", "32-true"),
    (4, "hsdp", "32-true"),
    (4, "tp2-fsdp2", "32-true"),
]


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_llama()


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (4, 128), generator=g)
    # No attention mask: Hugging Face reads an all-ones mask's values on the host, which FakeTensorMode (the tracker's)
    # cannot answer; without one the model builds the same causal mask.
    return {"input_ids": ids, "labels": ids}


def make_mesh(variant: str, world: int) -> Any:
    """The cell's device mesh: HSDP's 2 x (world / 2) replicate x shard, TP's (world / 2) x 2 data x tensor
    parallel, else one dimension of ``world`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    if variant == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    if variant == "tp2-fsdp2":
        return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    return init_device_mesh("cpu", (world,))


def shard(model: torch.nn.Module, variant: str, mesh: Any) -> None:
    if variant == "tp2-fsdp2":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}  # Hugging Face's own plan for Llama
        plan = {k.removeprefix("layers.*."): styles[v]() for k, v in model.config.base_model_tp_plan.items()}
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
        mesh = mesh["dp"]
    kw: dict[str, Any] = {"mesh": mesh}
    if variant == "fsdp2-mp":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if variant == "fsdp2-keep":
        kw["reshard_after_forward"] = False
    if variant == "fsdp2-reshard2":  # half of each unit's parameters kept from forward to backward
        kw["reshard_after_forward"] = 2
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: dict[str, Any], precision: str) -> None:
    """Lightning's order: forward and loss (under autocast for bf16-mixed), gradients to None, backward, step."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss = model(**inputs).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def measured(variant: str, precision: str, world: int) -> int:
    """The second step's peak, from a profiler started before the model exists: every block's size is known to it
    (a profiler started later is not told the sizes of older blocks' frees, such as the gradients ``zero_grad``
    drops)."""
    gc.collect()
    with QuietProfile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model, inputs = llama(), batch()
        shard(model, variant, make_mesh(variant, world))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step(model, optimizer, inputs, precision)
        with record_function("measured step"):
            step(model, optimizer, inputs, precision)
    events = list(prof.profiler.kineto_results.events())
    window = next(e for e in events if e.name() == "measured step")
    alive = peak = 0
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        alive += e.nbytes()
        if window.start_ns() <= e.start_ns() <= window.end_ns():
            peak = max(peak, alive)
    return peak


def ours(variant: str, precision: str, world: int) -> int:
    model = llama()
    shard(model, variant, make_mesh(variant, world))
    profile = profile_step(
        model,
        batch(),
        lambda m, inputs: m(**inputs).loss,
        make_optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
        device="cpu",
        autocast_dtype=torch.bfloat16 if precision == "bf16-mixed" else None,
        lightning_order=True,  # gradients set to None just before backward, as step() does
    )
    shards = world // 2 if variant == "tp2-fsdp2" else world  # FSDP's ranks (the data-parallel ones under TP)
    plan = solve_plan(profile, 1000.0, world_size=shards, sharding="sharded")
    return plan.unconstrained_peak_bytes


def torch_tracker(variant: str, precision: str, world: int) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    mesh = make_mesh(variant, world)  # outside the fake mode: a mesh reads its ranks on the host
    with FakeTensorMode():
        model, inputs = llama(), batch()
        shard(model, variant, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((inputs,))
        with tracker:
            for i in range(2):
                step(model, optimizer, inputs, precision)
                if i == 0:
                    tracker.reset_mod_stats()
        return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def in_world(world: int, fn: Callable[[str, str, int], int], variant: str, precision: str) -> int:
    """``fn(variant, precision, world)`` as rank 0 of a fake process group of ``world`` ranks."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        return fn(variant, precision, world)
    finally:
        dist.destroy_process_group()


def tracked(world: int, variant: str, precision: str) -> int | str:
    """FSDPMemTracker's peak, or why it could not run the cell (a result of this comparison, printed)."""
    try:
        return in_world(world, torch_tracker, variant, precision)
    except Exception as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"


def main() -> None:
    print(f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}")
    print("| ranks | strategy | precision | measured (bytes) | ours | ours vs measured | FSDPMemTracker | its error |")
    print("|---|---|---|---|---|---|---|---|")
    for world, variant, precision in CELLS:
        start = time.perf_counter()
        real = in_world(world, measured, variant, precision)
        mine = in_world(world, ours, variant, precision)
        theirs = tracked(world, variant, precision)
        err = f"{(mine - real) / real:+.3%}"
        if isinstance(theirs, int):
            their_err = f"{(theirs - real) / real:+.3%}"
        else:
            theirs, their_err = "-", f"failed ({theirs})"
        print(
            f"| {world} | {variant} | {precision} | {real} | {mine} | {err} | {theirs} | {their_err} |",
            f"<!-- {time.perf_counter() - start:.0f} s -->",
            flush=True,
        )


if __name__ == "__main__":
    main()
