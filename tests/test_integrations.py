"""The plan outside Lightning's Trainer: a Hugging Face Trainer's callback and a Fabric loop (issue "Beyond the
Lightning Trainer").

Each planned run is measured from the outside (:mod:`loop_harness`: torch.profiler's allocator events of every step)
against a budget of 80% of the same loop's own measured plain peak, and trained beside the plain run from the same
weights on the same batches: the losses and every parameter after training must be equal (the recompute runs the
same kernels on the same values, so equal means bit-equal). The budget bound is the issue's: the planned step's
measured peak at most 2% above the budget.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from loop_harness import LoopPeaks, TokenDataset, hf_llama, hf_peaks_callback, llama_loss
from processes import start_ranks

from lightning_sac.errors import LightningSACError, ProfilingError

BUDGET_BOUND = 0.02  # the issue's: a planned step's measured peak at most 2% above the budget


def _hf_fit(
    out: str, callbacks: list[Any], *, bf16: bool, k: int, train: bool = True, steps: int = 2
) -> tuple[Any, LoopPeaks]:
    from transformers import Trainer, TrainingArguments

    model, peaks = hf_llama(), LoopPeaks()
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=k,
        bf16=bf16,
        max_steps=steps,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        ddp_backend="gloo" if dist.is_available() and os.environ.get("WORLD_SIZE", "1") != "1" else None,
    )
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset() if train else None)
    for cb in [*callbacks, hf_peaks_callback(peaks, lambda: trainer)]:
        trainer.add_callback(cb)
    trainer.train()
    return trainer, peaks


def _losses(trainer: Any) -> list[float]:
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


def _equal_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def _unwrapped(model: torch.nn.Module) -> bool:
    # accelerate's mixed precision sets the root's forward (autocast around the model's own): never a submodule's.
    return not any("forward" in m.__dict__ for name, m in model.named_modules() if name)


@pytest.fixture(scope="module")
def hf_plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LoopPeaks]:
    # The acceptance's harder configuration: bf16 autocast (accelerate's, weight casts cached) and accumulation 2.
    return _hf_fit(str(tmp_path_factory.mktemp("hf_plain")), [], bf16=True, k=2)


def test_hf_trainer_plan_keeps_the_budget_and_the_losses(hf_plain, tmp_path):
    from lightning_sac.integrations.hf import AutoSACCallback

    plain, plain_peaks = hf_plain
    budget = int(0.8 * max(plain_peaks.peaks[1:]))  # the first step makes the optimizer's state
    sac = AutoSACCallback(budget_gb=budget / 2**30, measure=False)
    planned, peaks = _hf_fit(str(tmp_path), [sac], bf16=True, k=2)
    assert sac.plan is not None and sac.plan.decisions, "an 80% budget needs a plan"
    assert max(peaks.peaks[1:]) <= budget * (1 + BUDGET_BOUND), (peaks.peaks, budget)
    # The prediction is of the step as the Trainer runs it: within 1% of the measured (8 bytes apart when written).
    assert abs(sac.plan.predicted_peak_bytes / max(peaks.peaks[1:]) - 1) < 0.01
    assert _losses(planned) == _losses(plain) and len(_losses(plain)) == 2
    assert _equal_weights(planned.model, plain.model)
    assert _unwrapped(planned.model), "the model gets its own forwards back at the end of training"


def test_hf_callback_measures_its_planned_step_and_replaces_the_model_s_checkpointing(hf_plain, tmp_path):
    from transformers import Trainer, TrainingArguments

    from lightning_sac.integrations.hf import AutoSACCallback

    budget = int(0.8 * max(hf_plain[1].peaks[1:]))
    # The model checkpoints its layers itself (the Trainer's gradient_checkpointing=True): the plan replaces that.
    sac = AutoSACCallback(budget_gb=budget / 2**30, measure=True, log_figures=False, replace_existing=True)
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, bf16=True,
        max_steps=2, use_cpu=True, report_to="tensorboard", save_strategy="no", seed=0, disable_tqdm=True,
        gradient_checkpointing=True,
    )  # fmt: skip
    model = hf_llama()
    Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[sac]).train()
    assert sac.measured is not None and sac.plan is not None and sac.plan.replaces_checkpointing
    # Its own measurement of the second optimizer step agrees with the prediction as the outside one does.
    assert abs(sac.measured.peak_bytes / sac.plan.predicted_peak_bytes - 1) < 0.01
    assert sac.measured.peak_bytes <= budget * (1 + BUDGET_BOUND)
    assert model.is_gradient_checkpointing and _unwrapped(model), "the model's own checkpointing is back"
    events = list((tmp_path / "runs" / "lightning_sac").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0, "report_to='tensorboard': the plan's panels are written"


def test_hf_trainer_without_a_train_dataset_stops_before_training(tmp_path):
    from lightning_sac.integrations.hf import AutoSACCallback

    sac = AutoSACCallback(budget_gb=0.01)
    with pytest.raises(ValueError, match="train_dataset"):
        _hf_fit(str(tmp_path), [sac], bf16=False, k=1, train=False)
    assert sac.plan is None


class _NoLabels(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.arange(16) % 7}


def test_hf_model_that_cannot_be_dry_run_stops_before_training_untouched(tmp_path):
    from transformers import Trainer, TrainingArguments

    from lightning_sac.integrations.hf import AutoSACCallback

    model = hf_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, use_cpu=True,
                             report_to="none", save_strategy="no", disable_tqdm=True)  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=_NoLabels(), callbacks=[AutoSACCallback(budget_gb=0.01)])
    with pytest.raises(ProfilingError, match="returned no loss .*pass labels"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and _unwrapped(model)


def test_hf_trainer_with_its_own_compute_loss_is_dry_run_through_it(tmp_path):
    from torch._subclasses.fake_tensor import FakeTensor
    from transformers import Trainer, TrainingArguments

    from lightning_sac.integrations.hf import AutoSACCallback

    fake_calls: list[bool] = []

    class OwnLoss(Trainer):  # next-token loss from the logits: the batch has no labels
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN201
            fake_calls.append(isinstance(next(model.parameters()), FakeTensor))
            logits = model(input_ids=inputs["input_ids"]).logits
            targets = inputs["input_ids"][:, 1:].flatten()
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets)

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, use_cpu=True,
                             report_to="none", save_strategy="no", disable_tqdm=True)  # fmt: skip
    sac = AutoSACCallback(budget_gb=1.0, report_only=True)
    trainer = OwnLoss(model=hf_llama(), args=args, train_dataset=_NoLabels(), callbacks=[sac])
    sac.trainer = trainer
    trainer.train()
    assert fake_calls[0] and sac.profile is not None and sac.plan is not None  # the dry run ran its compute_loss
    assert fake_calls[-1] is False and trainer.state.global_step == 1


def _fabric_loop(
    budget: int | None, precision: str, k: int, devices: int = 1, steps: int = 2
) -> tuple[list[int], list[float], Any]:
    import lightning as L

    from lightning_sac.integrations.fabric import plan_and_apply

    fabric = L.Fabric(
        accelerator="cpu", devices=devices, precision=precision, strategy="ddp" if devices > 1 else "auto"
    )
    fabric.launch()  # ranks launched outside (the test's processes): this joins the process group
    model = hf_llama()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    data = [TokenDataset(n=4, seed=10 * fabric.global_rank + s)[:] for s in range(2 * k)]
    data = [{"input_ids": b["input_ids"], "labels": b["labels"]} for b in data]
    handle = None
    if budget is not None:
        handle = plan_and_apply(
            fabric, model, optimizer, data[0], llama_loss, budget / 2**30, accumulate_grad_batches=k
        )
    peaks, losses = LoopPeaks(), []
    peaks.start()
    for step in range(steps):
        peaks.step_begin(model.module, optimizer, model._forward_module)
        for j in range(k):
            loss = llama_loss(model, data[(step * k + j) % len(data)]) / k
            fabric.backward(loss)
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        peaks.step_end()
    return peaks.finish(), losses, (handle, model.module)


def test_fabric_loop_plan_keeps_the_budget_and_the_losses():
    plain_peaks, plain_losses, (_, plain_model) = _fabric_loop(None, "bf16-mixed", 2)
    budget = int(0.8 * max(plain_peaks[1:]))
    peaks, losses, (handle, model) = _fabric_loop(budget, "bf16-mixed", 2)
    assert handle is not None and handle.plan.decisions
    assert max(peaks[1:]) <= budget * (1 + BUDGET_BOUND), (peaks, budget)
    assert abs(handle.plan.predicted_peak_bytes / max(peaks[1:]) - 1) < 0.01
    assert losses == plain_losses and _equal_weights(model, plain_model)
    handle.remove()
    assert _unwrapped(model)


def test_fabric_step_that_is_not_a_loss_is_refused_untouched():
    import lightning as L

    from lightning_sac.integrations.fabric import plan_and_apply

    fabric = L.Fabric(accelerator="cpu", devices=1)
    model, optimizer = fabric.setup(*(lambda m: (m, torch.optim.SGD(m.parameters())))(hf_llama()))
    batch = TokenDataset(n=2)[:]
    with pytest.raises(ValueError, match="must return a scalar floating-point tensor, got a tensor of shape"):
        plan_and_apply(fabric, model, optimizer, batch, lambda m, b: m(**b).logits, budget_gb=0.01)
    assert _unwrapped(model.module)
    with pytest.raises(ValueError, match="accumulate_grad_batches must be at least 1"):
        plan_and_apply(fabric, model, optimizer, batch, llama_loss, budget_gb=0.01, accumulate_grad_batches=0)


def _ddp_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")  # fmt: skip
    torch.set_num_threads(1)
    from lightning_sac.integrations.hf import AutoSACCallback

    result: dict[str, Any] = {}
    plain, plain_peaks = _hf_fit(os.path.join(out, "plain"), [], bf16=False, k=1, steps=3)
    peak = torch.tensor(plain_peaks.peaks[2])  # the third step (see the test below)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    budget = int(0.8 * int(peak))
    sac = AutoSACCallback(budget_gb=budget / 2**30, measure=False)
    planned, peaks = _hf_fit(os.path.join(out, "planned"), [sac], bf16=False, k=1, steps=3)
    assert sac.plan is not None
    result["hf"] = {
        "budget": budget, "peaks": peaks.peaks, "predicted": sac.plan.predicted_peak_bytes,
        "equal": _losses(planned) == _losses(plain) and _equal_weights(planned.model, plain.model),
        "plan": sac.plan.to_json(), "unwrapped": _unwrapped(planned.model),
    }  # fmt: skip
    fabric_plain, plain_losses, (_, plain_model) = _fabric_loop(None, "32-true", 1, devices=2, steps=3)
    peak = torch.tensor(fabric_plain[2])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    budget = int(0.8 * int(peak))
    fabric_peaks, losses, (handle, model) = _fabric_loop(budget, "32-true", 1, devices=2, steps=3)
    result["fabric"] = {
        "budget": budget, "peaks": fabric_peaks, "predicted": handle.plan.predicted_peak_bytes,
        "equal": losses == plain_losses and _equal_weights(model, plain_model), "plan": handle.plan.to_json(),
        "unwrapped": True,
    }  # fmt: skip
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_hf_trainer_and_fabric_under_ddp_on_two_processes(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_ranks(_ddp_rank, (port, str(tmp_path)), 2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for loop in ("hf", "fabric"):
        assert ranks[0][loop]["plan"] == ranks[1][loop]["plan"], "every rank applies rank 0's plan"
        for r in ranks:
            res = r[loop]
            assert res["equal"] and res["unwrapped"], loop
            # The third step: DDP rebuilds its gradient buckets in the second one, and the free of the first ones,
            # made before the profiler started, is not in its record (+ the buckets' bytes, plain or planned).
            peak = res["peaks"][2]
            assert peak <= res["budget"] * (1 + BUDGET_BOUND), (loop, res["peaks"], res["budget"])
            assert abs(res["predicted"] / peak - 1) < 0.01, (loop, res["peaks"], res["predicted"])


def test_planning_errors_reach_every_rank():
    from lightning_sac.integrations.planner import plan_on_rank_zero

    sent: list[Any] = []

    def broadcast(obj: Any) -> Any:  # rank 0's object, as the other ranks would receive it
        sent.append(obj)
        return obj

    def fail() -> None:
        raise ProfilingError("no loss")

    with pytest.raises(ProfilingError):
        plan_on_rank_zero(True, fail, broadcast)
    assert sent == [{"error": "ProfilingError", "message": "no loss"}]
    with pytest.raises(LightningSACError, match="failed on global rank 0: ProfilingError: no loss"):
        plan_on_rank_zero(False, fail, lambda obj: sent[0])


def test_a_batch_larger_than_planned_is_said_once():
    from lightning_sac.integrations.shapes import ShapeWatch, planned_shapes

    class Echo(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return input_ids

    said: list[str] = []
    batch = TokenDataset(n=4)[:]
    watch = ShapeWatch(planned_shapes(batch), said.append)
    model = Echo()
    watch.attach(model)
    model(**batch)
    model(input_ids=batch["input_ids"][:, :32], labels=batch["labels"][:, :32])  # shorter: the plan holds
    assert said == []
    longer = torch.cat([batch["input_ids"], batch["input_ids"]], dim=1)
    model(input_ids=longer, labels=longer)
    model(input_ids=longer, labels=longer)
    assert len(said) == 1 and "input_ids is [4, 128], larger than the [4, 64]" in said[0]
    watch.detach()
    assert not model._forward_pre_hooks
