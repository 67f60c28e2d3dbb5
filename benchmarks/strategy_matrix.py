"""Predicted vs measured per-rank peak in every strategy x precision x world-size cell (issue "FSDP").

Runs the cells of ``tests/test_strategy_matrix.py`` (``tests/sharded_fits.py``: a tiny Hugging Face Llama, fitted
plain and then with AutoSAC at 80% of its own measured per-rank peak, every rank measured by torch.profiler) and
prints, per cell, the prediction's error for the plain and the planned step and the planned peak over the budget.

    python benchmarks/strategy_matrix.py            # world sizes 1, 2 and 4 (about 6 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from sharded_fits import run_cells  # noqa: E402

NAMES = {
    "single": "single device",
    "ddp": "DDP",
    "fsdp2": "FSDP2",
    "fsdp2-mp": "FSDP2, bf16 parameters, fp32 reduction",
    "fsdp2-keep": "FSDP2, `reshard_after_forward=False`",
    "fsdp2-reshard2": "FSDP2, `reshard_after_forward=2`",
    "hsdp": "HSDP 2 x 2",
    "fsdp1": "FSDP1",
}
# The strategies of each world size, as tests/test_strategy_matrix.py runs them (the FSDP2 variants in "32-true").
STRATEGIES = {
    1: ("single", "ddp", "fsdp2", "fsdp2-mp", "fsdp1"),
    2: ("ddp", "fsdp2", "fsdp2-mp", "fsdp2-keep", "fsdp1"),
    4: ("ddp", "fsdp2", "fsdp2-mp", "fsdp2-keep", "fsdp2-reshard2", "hsdp", "fsdp1"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    # plain, planned: predicted vs measured peak of the highest rank
    print("| strategy | precision | ranks | plain | planned | planned / budget |")
    print("|---|---|---|---|---|---|")
    for ws in args.world_sizes:
        strategies = STRATEGIES[ws]
        out = Path(tempfile.mkdtemp(prefix=f"strategy_matrix_ws{ws}_"))
        for (strategy, precision), ranks in run_cells(strategies, ws, ("32-true", "bf16-mixed"), out).items():
            plain = max(max(r.plain_peaks) for r in ranks)
            planned = max(max(r.planned_peaks) for r in ranks)
            first = ranks[0]
            print(
                f"| {NAMES[strategy]} | {precision} | {ws} | {100 * (first.predicted_plain / plain - 1):+.1f}% "
                f"| {100 * (first.predicted_peak / planned - 1):+.1f}% | {planned / first.budget_bytes:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
