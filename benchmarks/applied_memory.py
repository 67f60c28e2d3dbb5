"""Applied plans, measured: the peak of a real CPU step with a plan, by torch.profiler, against the plan's.

The GPT of ``tests/conftest.py`` (2 blocks, d=128, T=128, batch 4, dropout 0.1, AdamW) is profiled for the CPU
and planned at 90%, 75% and 60% of its unconstrained peak for each backend; each plan is applied to a copy and
one real training step is measured by the allocator events of torch.profiler (``measure_training_step``).
``tests/test_apply.py -k measured`` asserts the same within 10% and a falling peak.

    python benchmarks/applied_memory.py
"""

from __future__ import annotations

import copy
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from conftest import adamw, gpt_case  # noqa: E402

from lightning_sac import profile_model, solve_plan  # noqa: E402
from lightning_sac.apply import apply_plan  # noqa: E402
from lightning_sac.dryrun.measured import measure_training_step  # noqa: E402

MIB = 2**20
GIB = 2**30


def main() -> None:
    case = gpt_case()
    profile = profile_model(case.model, case.inputs, loss_fn=case.loss_fn, optimizer_factory=adamw, device="cpu")

    def measured(model) -> float:  # noqa: ANN001
        step = measure_training_step(model, case.inputs, loss_fn=case.loss_fn, optimizer_factory=adamw)
        return step.peak_bytes / MIB

    print(f"plain: predicted {profile.peak_bytes / MIB:.2f} MiB, measured {measured(copy.deepcopy(case.model)):.2f}")
    print("budget | backend | modules | predicted peak MiB | measured MiB | error | predicted recompute ms")
    for fraction in (0.9, 0.75, 0.66):
        for backend in ("sac", "graph"):
            plan = solve_plan(profile, profile.peak_bytes * fraction / GIB, backend=backend)
            model = copy.deepcopy(case.model)
            apply_plan(model, plan)
            peak, predicted = measured(model), plan.predicted_peak_bytes / MIB
            print(
                f"{fraction:>6.0%} | {backend:>7} | {len(plan.decisions):>7} | {predicted:>18.2f} | {peak:>12.2f} | "
                f"{peak / predicted - 1:>+5.1%} | {plan.predicted_recompute_ms:.2f}"
            )


if __name__ == "__main__":
    main()
