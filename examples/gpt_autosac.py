"""Train a small GPT on synthetic tokens with AutoSAC: plan, train, and check the predicted peak for real.

    python examples/gpt_autosac.py                              # CPU, a budget of 70% of the plain peak
    python examples/gpt_autosac.py --budget-gb 0.1              # your own budget, GiB
    python examples/gpt_autosac.py --device H100-SXM --budget-gb 1.5 --batch 32 --seq 1024
                                                                # plan for an H100 from this machine

On the CPU it finishes in about a minute: AutoSAC profiles one step on fake tensors, solves the plan, prints
it, applies it, trains; then the example measures one real planned step with torch.profiler's allocator events
and prints the predicted peak beside the measured one. With --device naming a GPU it prints that GPU's plan and
trains on the CPU with it (the predicted numbers are then the GPU's, so nothing is measured). AutoSAC itself
prints the plan when training begins and, after the first planned step, one line: the measured peak beside the
prediction and the budget, and whether it stayed within. The training loss,
the plan, its figures and the measured step go to TensorBoard: the last lines say where, and the command to
open them.
"""

from __future__ import annotations

import argparse
import copy

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_sac import AutoSAC, apply_plan, profile_model
from lightning_sac.demos import GPTConfig
from lightning_sac.demos.lightning import GPTModule
from lightning_sac.dryrun.measured import measure_training_step

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="target device name; default: this machine's")
    parser.add_argument("--budget-gb", type=float, default=None, help="default: 70%% of the unconstrained peak")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--backend", default="sac", choices=["sac", "graph"])
    parser.add_argument("--logdir", default="lightning_logs", help="TensorBoard log folder (default: %(default)s)")
    args = parser.parse_args()

    pl.seed_everything(0)
    config = GPTConfig(vocab_size=4096, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=256, dropout=0.1)
    module = GPTModule(config, lr=3e-3, batch_size=args.batch, n_samples=args.batch * args.steps)
    batch = next(iter(module.train_dataloader()))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

    def optimizer_factory(params):  # noqa: ANN001, ANN202
        return torch.optim.AdamW(params, lr=3e-3)

    budget = args.budget_gb
    if budget is None:
        plain = profile_model(
            module.model, (batch[0],), loss_fn=loss_fn, optimizer_factory=optimizer_factory, device=args.device or "cpu"
        )
        budget = 0.7 * plain.peak_bytes / 2**30
        print(f"unconstrained peak {plain.peak_bytes / MIB:.1f} MiB: budget {budget * 1024:.1f} MiB (70%)")

    autosac = AutoSAC(budget_gb=budget, device=args.device, backend=args.backend)
    # AutoSAC writes its panels to the trainer's TensorBoardLogger, beside the training loss.
    logger = TensorBoardLogger(args.logdir, name="gpt_autosac")
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        callbacks=[autosac],
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(module)
    plan = autosac.plan
    assert plan is not None  # AutoSAC printed it when training began
    print(f"loss: first {module.losses[0]:.3f}, last {module.losses[-1]:.3f} over {len(module.losses)} steps")
    if plan.device == "cpu":
        model = copy.deepcopy(module.model)
        prefixed = copy.deepcopy(plan)  # the plan names modules of the LightningModule: "model.blocks.0" ...
        prefixed.decisions = {("" if k == "model" else k.removeprefix("model.")): v for k, v in plan.decisions.items()}
        apply_plan(model, prefixed, backend=args.backend)
        measured = measure_training_step(model, (batch[0],), loss_fn=loss_fn, optimizer_factory=optimizer_factory)
        error = (measured.peak_bytes - plan.predicted_peak_bytes) / plan.predicted_peak_bytes
        print(
            f"peak: predicted {plan.predicted_peak_bytes / MIB:.2f} MiB, measured {measured.peak_bytes / MIB:.2f} MiB "
            f"({error:+.1%}; torch.profiler allocator events of one real planned step), without a plan "
            f"{plan.unconstrained_peak_bytes / MIB:.2f} MiB predicted"
        )

    print(f"TensorBoard logs (loss, plan, figures, measured step): {logger.log_dir}")
    print(f"  open them with: tensorboard --logdir {args.logdir}")


if __name__ == "__main__":
    main()
