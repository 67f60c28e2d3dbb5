"""Plan quality: our plan's predicted recompute against the common manual choices, at budgets loose to tight.

For a GPT profiled for a target device, at budgets from the unconstrained peak down to the tightest one our
solver reaches, print the recompute each strategy adds per step and whether it fits the budget:

- ours: ``solve_plan`` (selective checkpointing, any non-leaf module, partial discards);
- full AC: every transformer block checkpointed whole (the usual manual setting);
- fewest blocks: the fewest whole blocks, first ones first, whose checkpointing fits the budget.

All three are evaluated with the same memory model over the same profile, so the ratios compare choices, not
models. Run from the repository root::

    python benchmarks/plan_quality.py
    python benchmarks/plan_quality.py --layers 16 --device A100-40GB
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from lightning_sac import BudgetError, profile_model, solve_plan  # noqa: E402
from lightning_sac.demos import GPT, GPTConfig  # noqa: E402
from lightning_sac.solver import find_candidates  # noqa: E402
from lightning_sac.solver.memory_model import memory_constraints, peak_with_plan  # noqa: E402

GIB = 2**30


def whole_block_plan(profile, blocks):  # noqa: ANN001, ANN201
    """Peak and recompute ms when ``blocks`` are checkpointed whole (all activations dropped, forward rerun)."""
    cands = {c.fqn: c for c in find_candidates(profile)}
    windows = {b: cands[b].window for b in blocks}
    constraints = memory_constraints(profile, windows)
    freed = {b: cands[b].retained for b in blocks}
    transient = {b: cands[b].transient for b in blocks}
    return peak_with_plan(constraints, freed, transient), sum(profile.modules[b].forward_ms for b in blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--device", default="H100-SXM")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()

    config = GPTConfig(vocab_size=32000, block_size=args.seq, n_layer=args.layers, n_head=16, n_embd=1024)
    with torch.device("meta"):
        model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    profile = profile_model(model, (idx,), optimizer_factory=lambda ps: torch.optim.AdamW(ps), device=args.device)
    blocks = [f"blocks.{i}" for i in range(args.layers)]
    full_peak, full_ms = whole_block_plan(profile, blocks)
    print(
        f"GPT {args.layers} blocks, d=1024, T={args.seq}, batch {args.batch}, AdamW, {args.device}: "
        f"unconstrained peak {profile.peak_bytes / GIB:.2f} GiB, step {profile.step_ms:.1f} ms; "
        f"full AC peak {full_peak / GIB:.2f} GiB at {full_ms:.1f} ms recompute"
    )
    print(
        f"{'budget GiB':>10} | {'ours ms':>8} | {'full AC ms':>10} | {'ours/full':>9} | {'fewest blocks':>13} | "
        f"{'ms':>8} | {'ours/fewest':>11}"
    )
    print("-" * 90)
    for fraction in (0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.35, 0.3):
        budget = profile.peak_bytes * fraction
        try:
            plan = solve_plan(profile, budget / GIB)
        except BudgetError:
            continue
        fewest = next((k for k in range(args.layers + 1) if whole_block_plan(profile, blocks[:k])[0] <= budget), None)
        fewest_ms = whole_block_plan(profile, blocks[:fewest])[1] if fewest is not None else float("nan")
        full = f"{full_ms:>10.2f}" if full_peak <= budget else f"{'no fit':>10}"
        ours = plan.predicted_recompute_ms
        ratio_full = f"{ours / full_ms:>9.3f}" if full_peak <= budget else f"{'-':>9}"
        ratio_fewest = f"{ours / fewest_ms:>11.3f}" if fewest and fewest_ms > 0 else f"{'-':>11}"
        few = f"{fewest if fewest is not None else 'none':>13}"
        row = f"{budget / GIB:>10.2f} | {ours:>8.2f} | {full} | {ratio_full} | {few} | {fewest_ms:>8.2f} | "
        print(row + ratio_fewest)
    print("\nours/full: recompute of our plan over full activation checkpointing of every block (lower is better);")
    print("ours/fewest: over checkpointing the fewest whole blocks that fit ('-' where none or zero are needed).")


if __name__ == "__main__":
    main()
