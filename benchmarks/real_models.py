"""Predicted against measured peaks on models we did not write, plain and planned, per backend.

The families of ``tests/zoo.py`` (tiny random-init Hugging Face models called with keyword batches, LoRA through
PEFT, a torchvision-style ResNet, an LSTM language model, a model that checkpoints itself), on this CPU with
AdamW. For each: the plain step's predicted peak (with the model's KV caches on, as it runs without a plan)
against torch.profiler's allocator events of a real step; then plans at 85% of that peak and at 1.02x the minimum
achievable peak, applied with each backend, predicted against measured. Prints a Markdown table.

    python benchmarks/real_models.py [--families gpt2 bert ...]
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from zoo import FAMILIES  # noqa: E402

from lightning_sac import BudgetError, apply_plan, profile_model, solve_plan  # noqa: E402
from lightning_sac.dryrun.measured import measure_training_step  # noqa: E402

MIB, GIB = 2**20, 2**30
DEFAULT = ["gpt2", "llama", "llama_lora", "bert", "t5", "resnet", "lstm", "self_checkpointing"]


def measured(family, plan=None) -> int:  # noqa: ANN001
    model = copy.deepcopy(family.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if plan is not None:
            apply_plan(model, plan)
        step = measure_training_step(model, family.batch, loss_fn=family.loss_fn, optimizer_factory=family.optimizer)
    return step.peak_bytes


def cell(predicted: int, real: int) -> str:
    return f"{predicted / MIB:.2f} / {real / MIB:.2f} ({100 * (real / predicted - 1):+.1f}%)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="*", default=DEFAULT, choices=sorted(FAMILIES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| family | plain: predicted / measured (MiB) | budget | SAC: predicted / measured | graph: same |")
    print("|---|---|---|---|---|")
    for name in args.families:
        family = FAMILIES[name]()
        profile = profile_model(
            family.model, family.batch, loss_fn=family.loss_fn, optimizer_factory=family.optimizer, device="cpu"
        )
        plain = measured(family)
        try:
            solve_plan(profile, 1e-6)
            minimum = 0
        except BudgetError as err:
            minimum = err.minimum_bytes
        budgets = [("85%", 0.85 * profile.plain_peak_bytes), ("1.02 x min", 1.02 * minimum)]
        for i, (label, budget) in enumerate(budgets):
            cells = []
            for backend in ("sac", "graph"):
                try:
                    plan = solve_plan(profile, budget / GIB, backend=backend)
                    cells.append(cell(plan.predicted_peak_bytes, measured(family, plan)))
                except BudgetError:
                    cells.append("below the minimum")
            first = f"| {name} | {cell(profile.plain_peak_bytes, plain)} " if i == 0 else "| | "
            print(f"{first}| {label} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
