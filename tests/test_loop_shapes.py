"""Variable batch shapes in a fit: AutoSAC re-plans before a batch outside its plan, on every rank alike.

Each fit test measures the plain fit's peak P with the independent harness (``fit_harness.BatchPeaks``), then
fits with ``AutoSAC(budget_gb=0.8 * P)``: the fit completes with a non-empty plan, its losses are the plain fit's,
and every batch's measured peak is within the budget + 2% (the harness's own allowance for allocator events
the memory model does not see: issue "AutoSAC in real training loops").
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from fit_harness import BatchPeaks, batch_peaks
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from processes import start_ranks
from test_callback import trainer
from test_callback_real_models import HFModule
from torch.utils.data import DataLoader
from zoo import gpt2, lm_batch

import lightning_sac.lightning.fit_step as fit_step_module
from lightning_sac import AutoSAC, LightningSACError
from lightning_sac.lightning.batch_shapes import Signature, grow_batch, max_shapes_signature, signature_of
from lightning_sac.lightning.shape_plans import planning_batch, step_maximum

GIB = 2**30
SLACK = 1.02  # the allowance over the budget for a measured batch peak


def lengths_batch(length: int) -> dict[str, torch.Tensor]:
    """A collated batch of 4 sequences padded to ``length``: one row's last quarter is padding, as collators do."""
    return lm_batch(128, batch=4, seq=length, pad_from=3 * length // 4)


class LengthsModule(HFModule):
    """The Hugging Face fine-tuning module over batches of the given sequence lengths, in order.

    ``lengths_by_rank[r]`` are global rank ``r``'s lengths: each rank reads its own list (a per-rank dataset,
    so the trainer runs with ``use_distributed_sampler=False``).
    """

    def __init__(self, model: torch.nn.Module, lengths_by_rank: list[list[int]]) -> None:
        super().__init__(model)
        self.lengths_by_rank = lengths_by_rank

    def train_dataloader(self) -> DataLoader:
        lengths = self.lengths_by_rank[self.global_rank]
        return DataLoader([lengths_batch(n) for n in lengths], batch_size=None)


class Record(Callback):
    """Per rank, after AutoSAC's hook: each batch's sequence length, applied plan and wrapped modules; the losses."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001, ANN201
        sac = next((c for c in trainer.callbacks if isinstance(c, AutoSAC)), None)
        plan = None if sac is None or sac.plan is None else sac.plan.to_dict()
        wrapped = sorted(n for n, m in pl_module.named_modules() if "forward" in m.__dict__)
        self.steps.append({"length": batch["input_ids"].shape[1], "plan": plan, "wrapped": wrapped})

    def on_train_end(self, trainer, pl_module):  # noqa: ANN001, ANN201
        sac = next((c for c in trainer.callbacks if isinstance(c, AutoSAC)), None)
        record = {
            "steps": self.steps,
            "losses": pl_module.losses,
            "replans": None if sac is None else sac.shape_plans.replans,
        }
        (self.out / f"record_rank{trainer.global_rank}.json").write_text(json.dumps(record))


def fit(
    model: torch.nn.Module, lengths_by_rank: list[list[int]], out: Path, sac: AutoSAC | None, **kwargs: Any
) -> list[dict[str, Any]]:
    """A fit over one batch per length; every rank's records, with its batch peaks under ``"peaks"``."""
    out.mkdir()
    world_size = kwargs.get("devices", 1)
    callbacks = [*([sac] if sac else []), BatchPeaks(out_dir=out), Record(out)]
    pl.seed_everything(0)
    module = LengthsModule(copy.deepcopy(model), lengths_by_rank)
    steps = len(lengths_by_rank[0])
    trainer(callbacks, out, max_steps=steps, use_distributed_sampler=False, **kwargs).fit(module)
    records = [json.loads((out / f"record_rank{r}.json").read_text()) for r in range(world_size)]
    for record, peaks in zip(records, batch_peaks(out, world_size), strict=True):
        record["peaks"] = peaks
    return records


def check_fit(plain: list[dict[str, Any]], planned: list[dict[str, Any]], budget_bytes: int) -> None:
    """The planned fit's plan is non-empty, its losses are the plain fit's, every batch is within the budget."""
    for rank, (p, q) in enumerate(zip(plain, planned, strict=True)):
        assert q["steps"][-1]["plan"]["decisions"], f"rank {rank}: the budget is below the plain peak"
        assert q["losses"] == p["losses"] and len(q["losses"]) == len(q["steps"]), f"rank {rank}"
        over = [(i, n / budget_bytes) for i, n in enumerate(q["peaks"]) if n > budget_bytes * SLACK]
        assert not over, f"rank {rank}: batches above the budget + 2% (batch, peak / budget): {over}"


# --------------------------------------------------------------------------- fits


@pytest.mark.slow
def test_growing_lengths_replan_before_the_longer_batch(tmp_path):
    # Grows after the first batch, then shrinks: 96 and 64 run on the plan made for 128, which covers them.
    lengths = [32, 64, 128, 96, 64]
    model = gpt2().model
    plain = fit(model, [lengths], tmp_path / "plain", None)
    peak = max(plain[0]["peaks"])
    # Memory grows with the sequence length (what "covered" relies on), measured on the real step: past the
    # first batch (which also creates the optimizer's state), a longer batch's peak is higher.
    by_length = sorted(zip(lengths[1:], plain[0]["peaks"][1:], strict=True))
    assert all(a[1] <= b[1] for a, b in zip(by_length, by_length[1:], strict=False)), by_length
    sac = AutoSAC(budget_gb=0.8 * peak / GIB, measure=False, log_figures=False)
    planned = fit(model, [lengths], tmp_path / "autosac", sac)
    check_fit(plain, planned, sac.plan.budget_bytes)
    # Re-planned twice, before the batches of 64 and 128, and never again: the 128 plan covers 96 and 64.
    assert sac.shape_plans.replans == 2 and sac.shape_plans.switches == 0
    assert [e.signature.shapes[0] for e in sac.shape_plans.entries] == [(4, 32), (4, 64), (4, 128)]
    planned_for = [s["plan"]["fingerprint"] for s in planned[0]["steps"]]
    fingerprints = [e.plan.fingerprint for e in sac.shape_plans.entries]
    assert planned_for == [fingerprints[0], fingerprints[1], fingerprints[2], fingerprints[2], fingerprints[2]]
    assert sac.plan is sac.shape_plans.current.plan
    # The plan for the longest batch saves less than the one for the shortest.
    assert len(sac.shape_plans.entries[2].plan.decisions) >= len(sac.shape_plans.entries[0].plan.decisions)


@pytest.mark.slow
def test_ddp_ranks_with_different_lengths_apply_one_plan_for_the_longest(tmp_path):
    # Rank 1's batches are longer than rank 0's at every step: both ranks plan for rank 1's.
    lengths_by_rank = [[32, 32, 64, 32], [64, 128, 96, 128]]
    model = gpt2().model
    ddp = dict(strategy="ddp_spawn", devices=2)
    plain = fit(model, lengths_by_rank, tmp_path / "plain", None, **ddp)
    peak = max(max(r["peaks"]) for r in plain)
    sac = AutoSAC(budget_gb=0.8 * peak / GIB, measure=False, log_figures=False)
    planned = fit(model, lengths_by_rank, tmp_path / "autosac", sac, **ddp)
    assert [[s["length"] for s in r["steps"]] for r in planned] == lengths_by_rank
    check_fit(plain, planned, planned[0]["steps"][-1]["plan"]["budget_bytes"])
    # Every rank applied the identical plan before every batch, and re-planned at the same two steps.
    steps0, steps1 = planned[0]["steps"], planned[1]["steps"]
    assert all(a["plan"] == b["plan"] and a["wrapped"] == b["wrapped"] for a, b in zip(steps0, steps1, strict=True))
    assert planned[0]["replans"] == planned[1]["replans"] == 2
    # Before batch 0 the plan for rank 1's 64 replaced rank 0's first plan (for 32); before batch 1, the plan for
    # 128, which covers the rest.
    fingerprints = [s["plan"]["fingerprint"] for s in steps0]
    assert fingerprints[0] != fingerprints[1] and fingerprints[1:] == [fingerprints[1]] * 3


def test_max_shapes_plans_once_for_the_largest_batch(tmp_path, monkeypatch):
    lengths = [32, 64, 128, 96]
    model = gpt2().model
    plain = fit(model, [lengths], tmp_path / "plain", None)
    peak = max(plain[0]["peaks"])
    calls = []
    profile_step = fit_step_module.profile_step

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(signature_of(args[1]))
        return profile_step(*args, **kwargs)

    monkeypatch.setattr(fit_step_module, "profile_step", counted)
    largest = {"input_ids": (4, 128), "attention_mask": (4, 128), "labels": (4, 128)}
    sac = AutoSAC(budget_gb=0.8 * peak / GIB, measure=False, log_figures=False, max_shapes=largest)
    planned = fit(model, [lengths], tmp_path / "autosac", sac)
    check_fit(plain, planned, sac.plan.budget_bytes)
    # One dry run, of the first batch grown to the hint; no re-plan, no switch.
    assert len(calls) == 1 and calls[0].shapes == ((4, 128),) * 3
    assert sac.shape_plans.replans == sac.shape_plans.switches == 0 and len(sac.shape_plans.entries) == 1
    assert len({s["plan"]["fingerprint"] for s in planned[0]["steps"]}) == 1


@pytest.mark.slow
def test_resume_reuses_the_plans_by_shape_without_profiling(tmp_path, monkeypatch):
    # The first fit plans for 32 and 128 and saves both in its checkpoint; the resumed one starts on 32, then
    # meets 96: the restored plans cover both (the one for 32, then the one for 128), so nothing is profiled.
    lengths = [32, 128, 96, 64]
    model = gpt2().model
    plain = fit(model, [lengths], tmp_path / "plain", None)
    budget = 0.8 * max(plain[0]["peaks"]) / GIB
    first = AutoSAC(budget_gb=budget, measure=False, log_figures=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    pl.seed_everything(0)
    module = LengthsModule(copy.deepcopy(model), [lengths])
    trainer([first, ckpt], tmp_path, enable_checkpointing=True, max_steps=2).fit(module)
    assert first.shape_plans.replans == 1 and len(first.shape_plans.entries) == 2

    def no_profiling(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("resuming must not profile again")

    monkeypatch.setattr(fit_step_module, "profile_step", no_profiling)
    second = AutoSAC(budget_gb=budget, measure=False, log_figures=False)
    record = Record(tmp_path)
    resumed = LengthsModule(copy.deepcopy(model), [[32, 96, 64]])  # its weights come from the checkpoint
    trainer([second, record], tmp_path, max_steps=5).fit(resumed, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    seen = [s["length"] for s in record.steps]
    assert seen[0] == 32 and 96 in seen, seen  # (which batches a mid-epoch resume replays is Lightning's choice)
    assert not second.profiled and second.shape_plans.replans == 0 and second.shape_plans.switches == 1
    assert second.plan == first.shape_plans.entries[1].plan  # the plan for 128 covers 96 and 64
    assert [e.plan for e in second.shape_plans.entries] == [e.plan for e in first.shape_plans.entries]


# --------------------------------------------------------------------------- signatures and hints


def test_a_plan_covers_batches_no_larger_in_any_dim_of_the_same_tensors():
    planned = signature_of(lengths_batch(64))
    assert planned.covers(signature_of(lengths_batch(32)))
    assert planned.covers(planned)
    longer = signature_of(lengths_batch(96))
    assert not planned.covers(longer)
    assert planned.outside(longer) == "input_ids is [4, 96], larger than the [4, 64] planned for"
    assert longer.describe() == "input_ids, attention_mask, labels int64[4, 96]"
    wider = signature_of(lm_batch(128, batch=8, seq=32))
    assert not planned.covers(wider)  # more rows, though shorter
    assert planned.maximum(wider).shapes == ((8, 64),) * 3
    fewer = signature_of({k: v for k, v in lengths_batch(32).items() if k != "labels"})
    assert not planned.covers(fewer) and "the plan's were" in planned.outside(fewer)
    as_float = signature_of({**lengths_batch(32), "labels": torch.zeros(4, 32)})
    assert not planned.covers(as_float)  # another dtype is another step
    assert Signature.from_dict(json.loads(json.dumps(planned.to_dict()))) == planned


def test_grow_batch_repeats_the_last_entry_along_each_grown_dim():
    batch = lengths_batch(32)  # row 1 is padded from 24 on
    target = max_shapes_signature(batch, {"input_ids": (6, 48), "attention_mask": (6, 48), "labels": None})
    assert target.shapes == ((6, 48), (6, 48), (4, 32))
    grown = grow_batch(batch, target)
    ids, mask = grown["input_ids"], grown["attention_mask"]
    assert ids.shape == (6, 48) and grown["labels"] is batch["labels"]  # not grown: the same tensor
    assert torch.equal(ids[:4, :32], batch["input_ids"])
    assert torch.equal(ids[:4, 32:], batch["input_ids"][:, -1:].expand(4, 16))  # the last token, repeated
    assert torch.equal(ids[4:], ids[3:4].expand(2, 48))  # the last row, repeated
    assert mask[1, 24:].eq(0).all() and mask[0].eq(1).all()  # the padded row stays padded, the others unpadded


def test_max_shapes_never_shrinks_a_batch_and_names_a_bad_hint():
    batch = lengths_batch(64)
    assert max_shapes_signature(batch, {"input_ids": (4, 32)}).shapes == ((4, 64),) * 3
    with pytest.raises(ValueError, match=r"a dict with keys .*it has no 'input_id'"):
        max_shapes_signature(batch, {"input_id": (4, 128)})
    with pytest.raises(ValueError, match=r"gives \(128,\) for batch\['labels'\], a tensor of shape \[4, 64\]"):
        max_shapes_signature(batch, {"labels": (128,)})
    with pytest.raises(ValueError, match=r"a tuple of 2 items: expected one entry per item"):
        max_shapes_signature((torch.zeros(2, 3), torch.zeros(2)), (4, 8))
    assert max_shapes_signature((torch.zeros(2, 3), torch.zeros(2)), ((4, 8), None)).shapes == ((4, 8), (2,))


@pytest.mark.parametrize(
    ("hint", "error", "match"),
    [
        ("8x512", TypeError, r"max_shapes must be a shape \(a tuple of ints\), got '8x512'"),
        (
            {"input_ids": (8, 51.2)},
            TypeError,
            r"max_shapes\['input_ids'\] must be a shape \(a tuple of ints\), got \(8",
        ),
        ({"input_ids": (8, -1)}, ValueError, r"max_shapes\['input_ids'\] = \(8, -1\) has a negative dim"),
    ],
)
def test_a_malformed_max_shapes_fails_in_the_constructor(hint, error, match):
    with pytest.raises(error, match=match):
        AutoSAC(budget_gb=1.0, max_shapes=hint)


# --------------------------------------------------------------------------- the ranks' collectives


class _Strategy:
    """What planning_batch needs of a Lightning strategy: the rank and a broadcast from any rank."""

    def __init__(self, rank: int) -> None:
        self.global_rank = rank

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]


def _agree(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    cpu, strategy, result = torch.device("cpu"), _Strategy(rank), {}
    # Rank 1's batch is longer: rank 0 plans with it, as rank 1 sent it.
    batch = lengths_batch([64, 128][rank])
    target = step_maximum(signature_of(batch), 2, cpu)
    source = planning_batch(batch, target, strategy, 2)
    result["longer"] = [target.shapes[0], source.rank, source.grown, source.batch is None]
    if rank == 0:
        result["received"] = torch.equal(source.batch["input_ids"], lengths_batch(128)["input_ids"])
    # Rank 0 has more rows, rank 1 longer rows: nobody's batch has both, so rank 0 grows the larger one (a tie in
    # elements: the lower rank's, its own).
    batch = [lm_batch(128, batch=8, seq=32), lm_batch(128, batch=4, seq=64)][rank]
    target = step_maximum(signature_of(batch), 2, cpu)
    source = planning_batch(batch, target, strategy, 2)
    result["crossed"] = [target.shapes[0], source.rank, source.grown]
    if rank == 0:
        result["grown"] = list(source.batch["input_ids"].shape)
    # Different tensors on the two ranks: both raise, neither waits for the other.
    batch = lengths_batch(32) if rank == 0 else {k: v for k, v in lengths_batch(32).items() if k != "labels"}
    try:
        step_maximum(signature_of(batch), 2, cpu)
    except LightningSACError as err:
        result["error"] = str(err)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.slow  # two processes importing torch and Lightning: about 25 s here
def test_ranks_agree_on_the_largest_shapes_and_rank_zero_gets_a_batch_of_them(tmp_path):
    start_ranks(_agree, (str(tmp_path / "init"), str(tmp_path)), 2)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["longer"] == [[4, 128], 1, False, False] and r1["longer"] == [[4, 128], 1, False, True]
    assert r0["received"] is True
    assert r0["crossed"] == r1["crossed"] == [[8, 64], 0, True] and r0["grown"] == [8, 64]
    for r in (r0, r1):
        assert "rank 0: input_ids, attention_mask, labels int64[4, 32]; rank 1: input_ids, attention_mask" in r["error"]
