"""The host time our selective policy adds per op, against torchtitan's op-SAC policy deciding the same ops.

Both sides checkpoint every decoder layer of a Hugging Face Llama with torchtitan's op-level decisions (ours as a
plan, ``lightning_sac.solver.peer_plans``; theirs as the runtime policy of ``benchmarks/_peers.py``): the same ops
saved and recomputed, so the difference is what each policy costs to ask. The model is tiny (width 32, 8 tokens),
so that a step is host time, not arithmetic. Steps alternate between the two, and the medians are printed with
the difference per layer and per policy call.

    python benchmarks/policy_host_cost.py
    python benchmarks/policy_host_cost.py --steps 600 --layers 8
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _peers import titan_op_sac  # noqa: E402
from torch import nn  # noqa: E402
from vs_peers import hf_llama  # noqa: E402

from lightning_sac import apply_plan, profile_model, solve_plan  # noqa: E402
from lightning_sac.solver import peer_plans  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    case = hf_llama(argparse.Namespace(layers=args.layers, hidden=32, batch=1, seq=8, dropout=0.0))
    profile = profile_model(case.model, case.batch, optimizer_factory=case.optimizer, device="cpu")
    titan = peer_plans(profile)["torchtitan op-SAC"]
    # A plan object carrying torchtitan's decisions: solved at the plain peak (nothing to do), decisions replaced.
    plan = dataclasses.replace(solve_plan(profile, profile.peak_bytes / 2**30), decisions=titan.decisions)
    ours = copy.deepcopy(case.model)
    handle = apply_plan(ours, plan)
    theirs = titan_op_sac(copy.deepcopy(case.model))
    plain = copy.deepcopy(case.model)

    def step(model: nn.Module) -> None:
        model(**case.batch).loss.backward()

    times: dict[str, list[float]] = {"plain": [], "torchtitan's policy": [], "ours": []}
    models = dict(zip(times, (plain, theirs, ours), strict=True))
    for i in range(args.steps + 20):
        for name, model in models.items():
            start = time.perf_counter()
            step(model)
            if i >= 20:  # warm-up steps left out
                times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    calls = sum(len(w.names) for w in handle.wrappers.values())  # policy calls per forward of every layer
    extra = med["ours"] - med["torchtitan's policy"]
    print(f"HF Llama, {args.layers} layers of width 32, 8 tokens, one thread; median of {args.steps} steps each")
    for name, ms in med.items():
        print(f"  {name:>20}: {ms:.2f} ms")
    print(
        f"ours - torchtitan's: {extra:+.2f} ms per step, {extra / args.layers:+.3f} ms per layer, "
        f"{extra / calls * 1e3:+.1f} us per op the policy decides ({calls} per step)"
    )


if __name__ == "__main__":
    main()
