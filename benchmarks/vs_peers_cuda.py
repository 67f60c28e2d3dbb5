"""``vs_peers.py`` on a CUDA GPU: the same peers, goals and method, a Llama sized for the GPU, timed on its clock.

The Hugging Face Llama of ``vs_peers.py`` (GQA, no dropout, AdamW), wider and longer by default, trained on the
GPU in fp32: plain (two copies), full AC, torchtitan's op-level SAC, Hugging Face's checkpointing, and ours at
0.75% above each peer's measured peak and at a sweep of fractions of the plain peak. Ours is planned as AutoSAC
plans for the visible GPU: ``device="auto"`` on fake CUDA tensors, op times by the roofline (the profile's
``estimate="benchmark"`` times ops on a CPU only).

Peaks are the step's in the profile's terms: ``max_memory_allocated()`` over the second step less what the device
held before it that the profile does not count (cuBLAS's workspace: ``memory_allocated()`` less parameters,
buffers, optimizer state and the batch). The solver gets each peer's peak as its tensors' budget (the plan's
reserve for the CUDA context and the allocator added on top, as ``tests/gpu`` plans). Step times: interleaved
rounds, each step between two ``torch.cuda.synchronize()``; overheads against the mean of the two plain copies of
the round, as in ``vs_peers.py``.

    python benchmarks/vs_peers_cuda.py
    python benchmarks/vs_peers_cuda.py --layers 8 --hidden 1024 --seq 1024 --rounds 30
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from vs_peers import (  # noqa: E402
    GOALS,
    MIB,
    PEAK_GOAL,
    PEAK_SLACK,
    PEERS,
    Case,
    Config,
    applied,
    hf_llama,
    merged,
    overhead,
    peer_copy,
    plain_times,
    time_rounds,
)
from vs_peers import ratio_band as band_of  # noqa: E402

from lightning_sac import BudgetError, ModelProfile, Plan, profile_model, solve_plan  # noqa: E402
from lightning_sac.dryrun.step import model_inputs, model_loss, tensors_of, training_step  # noqa: E402
from lightning_sac.plan import device_reserve  # noqa: E402
from lightning_sac.solver import peer_plans  # noqa: E402

GIB = 2**30


def counted_bytes(tensors: list[torch.Tensor]) -> int:
    """What the profile counts for ``tensors``: each storage once, rounded up to the allocator's 512 bytes."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.is_cuda}
    return sum((n + 511) // 512 * 512 for n in storages.values())


def measured_peak(case: Case, model: nn.Module) -> int:
    """The second step's peak of ``model`` (which it trains: pass a copy), in the profile's terms."""
    inputs, loss = model_inputs(case.batch), model_loss(case.loss_fn)
    optimizer = case.optimizer(model.parameters())
    training_step(model, inputs, loss, optimizer)
    torch.cuda.synchronize()
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    counted = counted_bytes([*model.parameters(), *model.buffers(), *state, *tensors_of(inputs)])
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    training_step(model, inputs, loss, optimizer)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - (before - counted)
    del model, optimizer, state
    torch.cuda.empty_cache()
    return peak


def plan_for(profile: ModelProfile, tensors: int) -> Plan | None:
    """Our plan whose tensors' budget is ``tensors`` bytes: the device's reserve added, as the GPU suite plans."""
    budget = tensors + device_reserve(profile).total
    for _ in range(4):  # the plan's fragmentation comes out of the budget too: add it until the tensors get theirs
        try:
            plan = solve_plan(profile, budget / GIB)
        except BudgetError as err:
            print(f"no plan for {tensors / MIB:.1f} MiB of tensors ({err.minimum_bytes / MIB:.1f} MiB is the least)")
            return None
        if plan.tensor_budget_bytes >= tensors:
            break
        budget += tensors - plan.tensor_budget_bytes
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sweep", type=float, nargs="*", default=[0.8, 0.6, 0.5])
    args = parser.parse_args()
    args.dropout = 0.0
    if not torch.cuda.is_available():
        raise SystemExit("vs_peers_cuda.py needs a CUDA GPU; vs_peers.py measures on the CPU.")
    case = hf_llama(args)
    case.model.cuda()
    case.batch = {k: v.cuda() for k, v in case.batch.items()}

    def plain() -> nn.Module:
        return copy.deepcopy(case.model)

    configs = [Config("plain", plain), Config("plain B", plain)]
    configs[0].peak = configs[1].peak = measured_peak(case, plain())
    for name, wrap in PEERS.items():
        if wrap(copy.deepcopy(case.model)) is None:
            continue
        configs.append(Config(name, functools.partial(peer_copy, wrap, case)))
        configs[-1].peak = measured_peak(case, configs[-1].make())
    start = time.perf_counter()
    profile = profile_model(case.model, case.batch, optimizer_factory=case.optimizer, device="auto")
    profile_s = time.perf_counter() - start
    print(f"profiled in {profile_s:.1f} s; peers' peaks {[round(c.peak / MIB, 1) for c in configs]} MiB", flush=True)
    priced = peer_plans(profile)
    priced["HF checkpointing"] = priced["full AC"]
    planned: list[Config] = []
    targets = [(c.name, int(c.peak * (1 + PEAK_SLACK)), [c.name]) for c in configs[2:]]
    targets += [(f"{f:.0%}", int(configs[0].peak * f), []) for f in args.sweep]
    for label, tensors, peers in targets:
        plan = plan_for(profile, tensors)
        print(f"ours @ {label}: {'no plan' if plan is None else sorted(plan.decisions)}", flush=True)
        if plan is not None:
            planned.append(Config(f"ours @ {label}", functools.partial(applied, case, plan), plan=plan, peers=peers))
    planned = merged(planned)
    for o in planned:
        o.peak = measured_peak(case, o.make())
    configs += planned
    time_rounds(case, configs, args.rounds, sync=torch.cuda.synchronize)
    base = plain_times(configs[0], configs[1])
    print(
        f"{case.name}, batch {args.batch} x {args.seq}, fp32, AdamW, {torch.cuda.get_device_name()} (torch "
        f"{torch.__version__}); plain step {statistics.median(base) * 1e3:.1f} ms, peak {configs[0].peak / MIB:.1f} "
        f"MiB; profiled in {profile_s:.1f} s; {args.rounds} rounds; noise floor (plain B against plain) "
        f"{overhead(configs[1].times, configs[0].times):+.1%}"
    )
    print(f"{'configuration':>34} | {'peak MiB':>9} | {'/plain':>6} | {'predicted':>9} | {'overhead':>8} | predicted")
    for c in configs:
        pred_peak = f"{c.plan.predicted_peak_bytes / MIB:>9.1f}" if c.plan else f"{'':>9}"
        pred_t = f"{c.plan.predicted_step_ms / profile.step_ms - 1:.1%}" if c.plan else ""
        print(
            f"{c.name:>34} | {c.peak / MIB:>9.1f} | {c.peak / configs[0].peak:>6.3f} | {pred_peak} | "
            f"{c.overhead:>8.1%} | {pred_t}"
        )
    by_name = {c.name: c for c in configs}
    for o, peer_name in ((c, p) for c in planned for p in c.peers):
        peer = by_name[peer_name]
        ratio = o.overhead / peer.overhead if peer.overhead > 0 else float("inf")
        low, high = band_of(o, peer, base)
        above = o.peak / peer.peak - 1
        holds = ratio <= GOALS[peer_name] and above <= PEAK_GOAL
        theirs = priced[peer_name]
        assert o.plan is not None
        added = o.plan.predicted_recompute_ms + o.plan.predicted_overhead_ms
        print(
            f"at {peer_name}'s peak: our overhead {ratio:.2f}x theirs ({low:.2f}-{high:.2f}x; goal <= "
            f"{GOALS[peer_name]:.2f}x), our peak {above:+.2%} (goal <= {PEAK_GOAL:+.0%}): "
            f"{'holds' if holds else 'DOES NOT HOLD'}; by our cost model {added / theirs.added_ms:.2f}x (their peak "
            f"predicted at {theirs.peak_bytes / MIB:.1f} MiB)"
        )


if __name__ == "__main__":
    main()
