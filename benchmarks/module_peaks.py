"""Predicted against measured peak of plans made of one module kind at a time: where a memory-model miss lives.

The Llama of ``vs_peers_cuda.py`` (on a GPU) or of ``vs_peers.py`` (on the CPU), one plan per row, each
checkpointing a set of modules with nothing saved: every layer whole, every MLP, every attention, the norms, the
last layer's attention alone, the one before it. Each plan's predicted peak (``plan_peak`` of the profile) is
printed beside the measured peak of a real step. On an H200 (fp32, grouped-query attention, SDPA's math kernel)
every row landed within 0.1 MiB but the last layer's attention alone, 131.9 MiB over (docs/benchmarks.md, "On a
GPU"); ``--kv-heads 8`` (the memory-efficient kernel) landed every row.

    python benchmarks/module_peaks.py                      # the GPU if there is one, else the CPU
    python benchmarks/module_peaks.py --kv-heads 8
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from vs_peers import MIB, hf_llama  # noqa: E402
from vs_peers import measured_peak as cpu_peak  # noqa: E402

from lightning_sac import Plan, profile_model  # noqa: E402
from lightning_sac.apply import apply_plan  # noqa: E402
from lightning_sac.solver import find_candidates, least_kept_policy  # noqa: E402
from lightning_sac.solver.candidates import op_stats  # noqa: E402
from lightning_sac.solver.decisions import plan_peak, policy_decisions  # noqa: E402
from lightning_sac.solver.memory_model import memory_constraints  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=None, help="default 1024 on a GPU, 256 on the CPU")
    parser.add_argument("--seq", type=int, default=None, help="default 1024 on a GPU, 256 on the CPU")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    hidden, seq = args.hidden or (1024 if cuda else 256), args.seq or (1024 if cuda else 256)
    if cuda:
        from vs_peers_cuda import measured_peak
    else:
        measured_peak = cpu_peak
    # vs_peers' Llama (no dropout), with this script's key/value heads, on the device that measures it.
    case = hf_llama(argparse.Namespace(**{**vars(args), "hidden": hidden, "seq": seq, "dropout": 0.0}))
    if cuda:
        case.model.cuda()
        case.batch = {k: v.cuda() for k, v in case.batch.items()}
    profile = profile_model(case.model, case.batch, optimizer_factory=case.optimizer, device="auto" if cuda else "cpu")
    cands = find_candidates(profile, None)
    constraints = memory_constraints(profile, {c.fqn: c.window for c in cands})
    names = {c.fqn for c in cands}
    last = args.layers - 1
    layers = range(args.layers)
    attention = sorted({n for n in op_stats(profile, f"model.layers.{last}.self_attn").func_names if "softmax" in n})
    plain = measured_peak(case, copy.deepcopy(case.model))
    print(
        f"Llama {args.layers} layers, d={hidden}, KV heads {args.kv_heads}, batch {args.batch} x {seq}, "
        f"{torch.cuda.get_device_name() if cuda else 'CPU'}; attention's softmax ops {attention}; plain step "
        f"predicted {plan_peak(profile, constraints, {}, 'sac') / MIB:.1f} MiB, measured {plain / MIB:.1f}"
    )
    rows = {
        "every layer whole": [f"model.layers.{i}" for i in layers],
        "every MLP": [f"model.layers.{i}.mlp" for i in layers],
        "every attention": [f"model.layers.{i}.self_attn" for i in layers],
        "every norm": [f"model.layers.{i}.{n}_layernorm" for i in layers for n in ("input", "post_attention")],
        "the last layer whole": [f"model.layers.{last}"],
        "the last layer's attention": [f"model.layers.{last}.self_attn"],
        "the attention before it": [f"model.layers.{last - 1}.self_attn"],
    }
    for label, fqns in rows.items():
        fqns = [f for f in fqns if f in names]
        policies = {f: least_kept_policy(op_stats(profile, f)) for f in fqns}
        decisions = policy_decisions(profile, cands, policies, "sac", [0.0, 0.0], dict.fromkeys(fqns))
        predicted = plan_peak(profile, constraints, decisions, "sac")
        model = copy.deepcopy(case.model)
        apply_plan(model, Plan(decisions=decisions, budget_bytes=0))
        measured = measured_peak(case, model)
        print(
            f"{label:>28} ({len(fqns)} modules): predicted {predicted / MIB:9.1f} MiB, measured {measured / MIB:9.1f}, "
            f"{(measured - predicted) / MIB:+7.1f}"
        )


if __name__ == "__main__":
    main()
