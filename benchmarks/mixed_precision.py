"""AutoSAC under Lightning's mixed precision on this CPU: predicted against measured peaks of real fits.

For each module of ``tests/test_loop_precision.py`` (tiny Hugging Face GPT-2, Llama and ALBERT fine-tuning modules,
and a wide residual MLP): a plain 3-step ``Trainer.fit`` measured batch by batch with torch.profiler
(``tests/fit_harness.py``) gives the plain peak P; a fit with ``AutoSAC(budget_gb=0.8 * P)`` beside the same
measurement gives the planned peaks. Prints a Markdown table: the dry run's plain prediction against P, and the
plan's prediction against the highest planned batch. ``16-mixed`` runs as ``bf16-mixed`` on CPU (Lightning
switches it).

    python benchmarks/mixed_precision.py [--modules gpt2 llama ...] [--precision bf16-mixed]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_loop_precision import MODULES, fit  # noqa: E402

from lightning_sac import AutoSAC, BudgetError  # noqa: E402

MIB, GIB = 2**20, 2**30


def error(predicted: int, measured: int) -> str:
    return f"{predicted / MIB:.2f} / {measured / MIB:.2f} ({100 * (predicted / measured - 1):+.2f}%)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", nargs="*", default=["gpt2", "llama", "albert", "residual_mlp"], choices=MODULES)
    parser.add_argument("--precision", default="bf16-mixed")
    args = parser.parse_args()
    print(
        "| module | plain: predicted / measured P (MiB) | budget 0.8 P | planned: predicted / measured | "
        "highest batch / budget |"
    )
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.modules:
            _, peaks, _ = fit(name, Path(tmp), [], args.precision)
            peak = max(peaks)
            sac = AutoSAC(budget_gb=0.8 * peak / GIB, measure=False, log_figures=False)
            try:
                _, planned, _ = fit(name, Path(tmp), [sac], args.precision)
            except BudgetError:
                # The dry run profiled before refusing: its plain prediction is still there.
                plain = error(sac.profile.plain_peak_bytes, peak) if sac.profile else "-"
                print(f"| {name} | {plain} | {0.8 * peak / MIB:.2f} | below the minimum peak | - |")
                continue
            assert sac.profile is not None and sac.plan is not None
            plan = sac.plan
            print(
                f"| {name} | {error(sac.profile.plain_peak_bytes, peak)} | {plan.budget_bytes / MIB:.2f} | "
                f"{error(plan.predicted_peak_bytes, max(planned))} | {max(planned) / plan.budget_bytes:.4f} |"
            )


if __name__ == "__main__":
    main()
