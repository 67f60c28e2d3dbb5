"""Plan a 70B-class Llama on the meta device: wall time and peak RSS of profile + solve.

The model is Hugging Face's ``LlamaForCausalLM`` built under ``torch.device("meta")`` (no weights exist), in bf16,
with grouped-query attention, trained with AdamW, planned for H100-SXM under FSDP over 64 GPUs (world size 64,
sharded). Printed: the time of ``profile_model`` and of ``solve_plan`` (wall, and the process's CPU time, which
other work on the machine disturbs less; with the load average when it started), the process's peak RSS before
and after, and the plan.

Run from the repository root::

    python benchmarks/plan_scale.py                       # 80 layers, hidden 8192, sequence 8192
    python benchmarks/plan_scale.py --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch

# Issue "The largest models": the 70B class in under 10 s, the 405B class in under 20 s, under 2 GiB of RSS.
GOAL_RSS_GIB = 2.0


def _goal_seconds(parameters: int) -> float:
    return 10.0 if parameters < 200e9 else 20.0


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=28672)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--budget-gb", type=float, default=60.0)
    parser.add_argument("--device", default="H100-SXM")
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from lightning_sac import profile_model, solve_plan

    hf_logging.set_verbosity_error()
    import_rss = _rss_gib()
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq,
        attn_implementation="sdpa",
        use_cache=False,
    )
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    built, cpu_start = time.perf_counter(), time.process_time()
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    profile = profile_model(model, batch, optimizer_factory=lambda ps: torch.optim.AdamW(ps), device=args.device)
    profiled = time.perf_counter()
    plan = solve_plan(profile, args.budget_gb, world_size=args.world_size, sharding="sharded")
    solved, cpu = time.perf_counter(), time.process_time() - cpu_start
    n = sum(p.numel() for p in model.parameters())
    wall = solved - built
    rss = _rss_gib()
    print(f"model: Llama {args.layers} x {args.hidden} (GQA {args.heads}/{args.kv_heads}), {n / 1e9:.1f}B parameters")
    print(f"batch {args.batch} x {args.seq}, bf16, AdamW, {args.device}, FSDP world size {args.world_size}")
    print(f"build on meta {built - start:.1f} s; profile {profiled - built:.1f} s; solve {solved - profiled:.1f} s")
    print(
        f"profile + solve: {wall:.1f} s (goal < {_goal_seconds(n):.0f} s), CPU {cpu:.1f} s; "
        f"load average {load:.1f} on {os.cpu_count()} cores at the start"
    )
    print(f"peak RSS {rss:.2f} GiB (after imports {import_rss:.2f} GiB; goal < {GOAL_RSS_GIB:.0f} GiB)")
    print(
        f"plan: {len(plan.decisions)} modules checkpointed, peak {plan.predicted_peak_bytes / 2**30:.1f} GiB "
        f"per device (budget {args.budget_gb} GiB, {plan.unconstrained_peak_bytes / 2**30:.1f} GiB without a plan), "
        f"{plan.predicted_recompute_ms:.0f} ms of recompute, solver {plan.solver_status}"
    )


if __name__ == "__main__":
    main()
