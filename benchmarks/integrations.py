"""The plan in a Hugging Face Trainer fine-tune and a Lightning Fabric loop, measured from the outside, one process.

Runs the single-process loops of ``tests/test_integrations.py`` (a tiny Hugging Face Llama, bf16 autocast, gradient
accumulation 2): each plain, then planned at ``--fraction`` of its own measured plain peak, every optimizer step's
peak from torch.profiler's allocator events (``tests/loop_harness.py``). Prints, per loop, the plain and planned
peaks, the budget, the prediction, and whether the losses and weights are bit-equal.

    python benchmarks/integrations.py
    python benchmarks/integrations.py --fraction 0.7
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_integrations import _equal_weights, _fabric_loop, _hf_fit, _losses  # noqa: E402

from lightning_sac.integrations.hf import AutoSACCallback  # noqa: E402


def _row(name: str, plain: int, budget: int, planned: int, predicted: int, equal: bool) -> str:
    return (
        f"| {name} | {plain:,} | {budget:,} | {planned:,} ({planned / budget - 1:+.2%}) | {predicted:,} "
        f"({predicted / planned - 1:+.3%}) | {'yes' if equal else 'NO'} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fraction", type=float, default=0.8, help="budget as a fraction of the plain peak")
    args = parser.parse_args()
    print("| loop | plain peak | budget | planned peak (vs budget) | predicted (vs planned) | losses, weights equal |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as out:
        plain, plain_peaks = _hf_fit(out, [], bf16=True, k=2)
        budget = int(args.fraction * max(plain_peaks.peaks[1:]))
        sac = AutoSACCallback(budget_gb=budget / 2**30, measure=False)
        planned, peaks = _hf_fit(out, [sac], bf16=True, k=2)
        assert sac.plan is not None
        equal = _losses(planned) == _losses(plain) and _equal_weights(planned.model, plain.model)
        peak = max(peaks.peaks[1:])
        name = "HF Trainer, bf16, accumulation 2"
        print(_row(name, max(plain_peaks.peaks[1:]), budget, peak, sac.plan.predicted_peak_bytes, equal))
    fabric_plain, plain_losses, (_, plain_model) = _fabric_loop(None, "bf16-mixed", 2)
    budget = int(args.fraction * max(fabric_plain[1:]))
    fabric_peaks, losses, (handle, model) = _fabric_loop(budget, "bf16-mixed", 2)
    equal = losses == plain_losses and _equal_weights(model, plain_model)
    peak = max(fabric_peaks[1:])
    name = "Fabric, bf16-mixed, accumulation 2"
    print(_row(name, max(fabric_plain[1:]), budget, peak, handle.plan.predicted_peak_bytes, equal))


if __name__ == "__main__":
    main()
