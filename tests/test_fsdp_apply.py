"""Issue "FSDP": a plan applies to the sharded model whether a planned module is an FSDP unit, inside one, or
contains several, and holds op for op (FSDP's own gathers and casts in a checkpoint region are not counted).

FSDP2 (``fully_shard`` per decoder layer, then the model) and FSDP1 (Lightning's ``FSDPStrategy`` wrapping each
decoder layer) on 2 gloo processes; ``candidates`` restricts the plan to the modules under test. Each: the plan
is non-empty and identical on both ranks, losses equal the plain fit's bit for bit, every planned call ran the
profiled ops (no mismatch), and each rank's measured batch peaks stay within the budget + 2%.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
from sharded_fits import CellResult, run_cells
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


@functools.cache
def _group(units: str) -> dict[tuple[str, str], list[CellResult]]:
    # Decoder layers are the only candidates; they are the units, or each contains two (attention and MLP). FSDP2
    # and FSDP1 share one set of 2 processes. The layers' group also fits each planned cell a third time with
    # AutoSAC's own measurement (test_autosacs_own_measurement_under_fsdp_agrees_with_an_outside_one).
    out = Path(tempfile.mkdtemp(prefix=f"fsdp_apply_{units}_"))
    own = units == "layers"
    return run_cells(
        ("fsdp2", "fsdp1"), 2, ("32-true",), out, candidates=[LlamaDecoderLayer], units=units, own_measure=own
    )


@pytest.mark.slow  # 2 processes, about 25 s per units
@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1"])
@pytest.mark.parametrize("units", ["layers", "sublayers"], ids=["is-a-unit", "contains-two-units"])
def test_plan_holds_for_a_planned_module_that(strategy: str, units: str) -> None:
    ranks = _group(units)[strategy, "32-true"]
    first = ranks[0]
    assert first.decisions
    assert all(f.startswith("model.model.layers.") and f.count(".") == 3 for f in first.decisions)
    for r in ranks:
        assert (r.fingerprint, r.decisions) == (first.fingerprint, first.decisions)
        assert r.planned_losses == r.plain_losses
        assert r.calls and all(calls > 0 and mismatched == 0 for calls, mismatched in r.calls.values()), r.calls
        assert max(r.planned_peaks) <= r.budget_bytes * 1.02, (r.rank, max(r.planned_peaks), r.budget_bytes)


@pytest.mark.slow  # the third fit of each strategy in the layers' group: about 10 s more
def test_autosacs_own_measurement_under_fsdp_agrees_with_an_outside_one() -> None:
    # AutoSAC's measure=True inside a sharded fit (on global rank 0, as it plans) against torch.profiler's batch
    # peaks (fit_harness.BatchPeaks) of the same planned fit run again: the second step, within 1.5% (the issue's
    # bound).
    cells = _group("layers")
    for strategy in ("fsdp2", "fsdp1"):
        zero, one = cells[strategy, "32-true"]
        assert one.own_measured is None  # rank 1 measures nothing
        assert zero.own_measured is not None, strategy
        assert zero.own_measured == pytest.approx(zero.planned_peaks[1], rel=0.015), strategy


def test_a_strategy_other_than_single_ddp_fsdp_or_tp_is_refused_with_what_to_pass() -> None:
    from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

    from lightning_sac.lightning.args import check_strategy

    # FSDP2 and tensor parallelism: accepted (which TP styles are planned is checked on the model,
    # tests/test_tensor_parallel.py)
    check_strategy(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))
    check_strategy(ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="got DeepSpeedStrategy"):
        check_strategy(DeepSpeedStrategy.__new__(DeepSpeedStrategy))
