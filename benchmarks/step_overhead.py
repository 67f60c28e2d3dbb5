"""Step overhead: the real CPU step time a plan adds, against the recompute share the plan predicts.

A GPT is profiled for this CPU with ``estimate="benchmark"`` (every op timed on real tensors of its shapes),
planned at three budgets, and trained for real with each plan applied and without one, interleaved in one run.
The measured extra time of a planned step over a plain one, as a share of the plain step, is printed beside the
plan's predicted share: ``(predicted_recompute_ms + predicted_overhead_ms) / profile.step_ms``, the recompute
the plan's backend really runs (``lightning_sac.solver.recompute``) and what else wrapping each module costs, measured
by the profile on a real copy of the module (``lightning_sac.profiling.calibrate``). Goal: within 25% of the
prediction.

The extra is measured two ways, both against the mean of two plain copies: the fastest planned step against
the fastest plain one, and the median over rounds of each planned step minus the plain steps of the same round
(the goal uses this one: drift cancels within a round). Two reference rows show what is not recompute: the
second plain copy against the first ("plain B": the noise floor), and the tightest plan's modules wrapped with
every op saved ("keep all": the wrapper's cost plus that of keeping every op's output, nothing recomputed; its
prediction is the measured overhead alone).

By default the script re-runs itself with glibc's malloc told never to hand memory back to the OS
(``MALLOC_MMAP_MAX_=0``, ``MALLOC_TRIM_THRESHOLD_`` huge), so that the CPU reuses freed memory across steps the
way a GPU's caching allocator does. With glibc's defaults every step re-faults the pages of its peak memory,
which costs time in proportion to the peak; a plan lowers the peak and so also saves part of that, which is a
property of the CPU allocator and not of recompute. ``--system-malloc`` measures with the defaults instead.

    python benchmarks/step_overhead.py
    python benchmarks/step_overhead.py --backend graph
    python benchmarks/step_overhead.py --system-malloc
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_sac import Plan, profile_model, solve_plan  # noqa: E402
from lightning_sac.apply import apply_plan  # noqa: E402
from lightning_sac.demos import GPT, GPTConfig  # noqa: E402
from lightning_sac.dryrun.step import model_loss, training_step  # noqa: E402
from lightning_sac.plan import BACKENDS  # noqa: E402
from lightning_sac.solver.recompute import overhead_ms  # noqa: E402

GIB = 2**30
# glibc reads these at start-up: never return freed memory to the OS (no mmap'd chunks, no heap trimming).
CACHING_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=25, help="timed rounds (one step of each configuration)")
    parser.add_argument("--backend", default="sac", choices=BACKENDS)
    parser.add_argument("--fractions", type=float, nargs=3, default=[0.7, 0.55, 0.4])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: steadier timings)")
    parser.add_argument("--system-malloc", action="store_true", help="keep glibc's defaults (see above)")
    args = parser.parse_args()
    if not args.system_malloc and any(os.environ.get(k) != v for k, v in CACHING_MALLOC.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **CACHING_MALLOC})
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

    profile_start = time.perf_counter()
    profile = profile_model(
        model, (idx,), loss_fn=loss_fn, optimizer_factory=optimizer, device="cpu", estimate="benchmark"
    )
    profile_s = time.perf_counter() - profile_start
    plans = [solve_plan(profile, profile.peak_bytes * f / GIB, backend=args.backend) for f in args.fractions]
    # A second plain copy measured like the plans: its "extra" is the noise floor of this machine and method.
    # Then the tightest plan's modules wrapped with every op saved: what the backend costs besides recompute.
    models = [copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)]
    keep_all = Plan(
        decisions={
            fqn: dataclasses.replace(d, op_policy=[1] * len(d.op_policy), recompute_ms=0.0)
            for fqn, d in plans[-1].decisions.items()
        },
        budget_bytes=0,
    )
    apply_plan(models[2], keep_all, backend=args.backend)
    for plan in plans:
        m = copy.deepcopy(model)
        apply_plan(m, plan, backend=args.backend)
        models.append(m)
    opts = [optimizer(m.parameters()) for m in models]
    times: list[list[float]] = [[] for _ in models]
    order = list(range(len(models)))
    shuffle = random.Random(0)
    for i in range(args.steps + 2):
        # Interleaved, so that drift hits all alike, in a new order every round, so that what runs just before a
        # configuration (a cold cache after the heaviest plan...) is not always the same.
        shuffle.shuffle(order)
        for k in order:
            m, opt = models[k], opts[k]
            start = time.perf_counter()
            training_step(m, (idx,), model_loss(loss_fn), opt)
            if i >= 2:  # two warm-up steps
                times[k].append(time.perf_counter() - start)
    # The baseline is the mean of two plain copies: their difference, shown as the first row, is the noise
    # floor (two copies of one model differ by a percent or two here, e.g. where their memory landed).
    baseline = [(a + b) / 2 for a, b in zip(times[0], times[1], strict=True)]
    plain = (min(times[0]) + min(times[1])) / 2

    def extra(t: list[float], base: list[float] = baseline, fastest_base: float = plain) -> tuple[float, float]:
        # The fastest step against the fastest plain one (interference on a shared machine only ever adds
        # time), and the median of the differences to the plain steps of the same round (drift cancels).
        paired = statistics.median(a - b for a, b in zip(t, base, strict=True))
        return (min(t) - fastest_base) / fastest_base, paired / statistics.median(base)

    print(
        f"GPT {args.layers} blocks, d=256, T={args.seq}, batch {args.batch}, AdamW, CPU ({torch.get_num_threads()} "
        f"threads), backend {args.backend}: plain step {plain * 1e3:.1f} ms measured, {profile.step_ms:.1f} ms "
        f"predicted (profiled in {profile_s:.1f} s); {args.steps} interleaved rounds; malloc: "
        f"{'glibc defaults' if args.system_malloc else 'freed memory kept (MALLOC_MMAP_MAX_=0)'}"
    )
    kinds = {
        m.module_type: m.measured_overhead[args.backend]
        for m in profile.modules.values()
        if args.backend in m.measured_overhead
    }
    print(
        "Measured on a copy of each module (fixed ms, recompute factor): "
        + ", ".join(f"{k} {v[0]:.1f} ms, {v[1]:.3f}" for k, v in kinds.items())
    )
    header = (
        f"{'budget':>8} | {'modules':>7} | {'fastest ms':>10} | {'extra, fastest':>14} | {'extra, paired':>13} | "
        f"{'predicted':>9} | {'fastest/pred':>12} | {'paired/pred':>11} | recompute + overhead"
    )
    print(header)
    print("-" * len(header))
    # Keeping every op recomputes nothing: what the profile predicts for it is the backend's overhead alone.
    per_op_us = profile.backend_overhead_us[args.backend]
    keep_all_ms = sum(
        overhead_ms(
            profile.modules[fqn].op_stats,  # type: ignore[arg-type]
            d.op_policy,
            args.backend,
            per_op_us,
            profile.modules[fqn].measured_overhead.get(args.backend),
        )
        for fqn, d in keep_all.decisions.items()
    )
    for label, n, t, pred in [
        ("plain B", 0, times[1], 0.0),
        ("keep all", len(keep_all.decisions), times[2], keep_all_ms / profile.step_ms),
    ]:
        fastest, paired = extra(t, times[0], min(times[0])) if label == "plain B" else extra(t)
        ratios = f"{fastest / pred:>12.2f} | {paired / pred:>11.2f} | {0:>9.1%} + {pred:.1%}" if pred else ""
        print(
            f"{label:>8} | {n:>7} | {min(t) * 1e3:>10.1f} | {fastest:>14.1%} | {paired:>13.1%} | {pred:>9.1%} | "
            + ratios
        )
    ok = True
    for fraction, plan, t in zip(args.fractions, plans, times[3:], strict=True):
        fastest, paired = extra(t)
        predicted = (plan.predicted_recompute_ms + plan.predicted_overhead_ms) / profile.step_ms
        ok &= abs(paired / predicted - 1) <= 0.25
        print(
            f"{fraction:>7.0%} | {len(plan.decisions):>7} | {min(t) * 1e3:>10.1f} | {fastest:>14.1%} | "
            f"{paired:>13.1%} | {predicted:>9.1%} | {fastest / predicted:>12.2f} | {paired / predicted:>11.2f} | "
            f"{plan.predicted_recompute_ms / profile.step_ms:>9.1%} + "
            f"{plan.predicted_overhead_ms / profile.step_ms:.1%}"
        )
    print(
        "Goal: measured extra (paired) within 25% of the predicted share (recompute and the backend's overhead): "
        f"{'HOLDS' if ok else 'DOES NOT HOLD'}."
    )


if __name__ == "__main__":
    main()
