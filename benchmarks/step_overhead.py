"""Step overhead: the real CPU step time a plan adds, against the recompute share the plan predicts.

A GPT is profiled for this CPU with ``estimate="benchmark"`` (every op timed on real tensors of its shapes),
planned at three budgets, and trained for real with each plan applied and without one, interleaved in one run.
The measured extra time of a planned step over a plain one, as a share of the plain step, is printed beside the
plan's predicted share (``predicted_recompute_ms / profile.step_ms``). Goal: within 25% of the prediction.

    python benchmarks/step_overhead.py
    python benchmarks/step_overhead.py --backend graph --steps 15
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_sac import profile_model, solve_plan  # noqa: E402
from lightning_sac.apply import apply_plan  # noqa: E402
from lightning_sac.demos import GPT, GPTConfig  # noqa: E402
from lightning_sac.profiling.step import model_loss, training_step  # noqa: E402

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration (fastest taken)")
    parser.add_argument("--backend", default="sac", choices=["sac", "graph"])
    parser.add_argument("--fractions", type=float, nargs=3, default=[0.85, 0.7, 0.55])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: steadier timings)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=4096, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=256, dropout=0.1)
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    targets = torch.randint(0, config.vocab_size, (args.batch, args.seq))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def optimizer(params):  # noqa: ANN001, ANN202
        return torch.optim.AdamW(params, lr=1e-4)

    profile = profile_model(
        model, (idx,), loss_fn=loss_fn, optimizer_factory=optimizer, device="cpu", estimate="benchmark"
    )
    plans = [solve_plan(profile, profile.peak_bytes * f / GIB) for f in args.fractions]
    models = [copy.deepcopy(model)]
    for plan in plans:
        m = copy.deepcopy(model)
        apply_plan(m, plan, backend=args.backend)
        models.append(m)
    opts = [optimizer(m.parameters()) for m in models]
    times: list[list[float]] = [[] for _ in models]
    for i in range(args.steps + 2):
        for k, (m, opt) in enumerate(zip(models, opts, strict=True)):  # interleaved: drift hits all alike
            start = time.perf_counter()
            training_step(m, (idx,), model_loss(loss_fn), opt)
            if i >= 2:  # two warm-up steps
                times[k].append(time.perf_counter() - start)
    # The fastest step: interference on a shared machine only ever adds time, and recompute is a few percent.
    plain = min(times[0])
    print(
        f"GPT {args.layers} blocks, d=256, T={args.seq}, batch {args.batch}, AdamW, CPU ({torch.get_num_threads()} "
        f"threads), backend {args.backend}: plain step {plain * 1e3:.1f} ms measured, {profile.step_ms:.1f} ms "
        f"predicted; fastest of {args.steps} steps"
    )
    print(
        f"{'budget':>8} | {'modules':>7} | {'step ms':>8} | {'measured extra':>14} | {'predicted extra':>15} | "
        f"{'measured/predicted':>18}"
    )
    print("-" * 86)
    ok = True
    for fraction, plan, t in zip(args.fractions, plans, times[1:], strict=True):
        step = min(t)
        measured = (step - plain) / plain
        predicted = plan.predicted_recompute_ms / profile.step_ms
        ratio = measured / predicted if predicted else float("nan")
        ok &= abs(ratio - 1) <= 0.25
        print(
            f"{fraction:>7.0%} | {len(plan.decisions):>7} | {step * 1e3:>8.1f} | {measured:>14.1%} | "
            f"{predicted:>15.1%} | {ratio:>18.2f}"
        )
    print(f"Goal: measured extra within 25% of the predicted recompute share: {'HOLDS' if ok else 'DOES NOT HOLD'}.")


if __name__ == "__main__":
    main()
