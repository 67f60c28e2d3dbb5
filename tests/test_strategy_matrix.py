"""Issue "FSDP": AutoSAC in every strategy x precision x world size, measured per rank from the outside.

The strategies: one device, DDP, FSDP2, FSDP2 with its own mixed precision (``fsdp2-mp``: bf16 parameters gathered
and computed, fp32 reduction, Lightning's "32-true"; the dry run computes as the unit casts), FSDP2 with
``reshard_after_forward=False`` (``fsdp2-keep``) and ``=2`` on 4 ranks (``fsdp2-reshard2``), HSDP on 4 ranks
(``hsdp``: 2 x 2, replicate x shard), tensor parallelism 2 x FSDP2 2 on 4 ranks (``tp2-fsdp2``: each decoder layer's
linears column- and row-parallel as torchtitan's plan without sequence parallelism, then ``fully_shard`` over the
data-parallel mesh dim), FSDP1. FSDP2 with ``CPUOffloadPolicy`` is listed and skipped (see ``OFFLOAD``).

Each cell fits plain, then with AutoSAC at 80% of the cell's own measured plain per-rank peak (the highest over
ranks and batches), on a tiny Hugging Face Llama (see ``sharded_fits``). Accept: a non-empty plan, identical on
every rank (fingerprint and per-op decisions); losses equal the plain fit's; every rank's measured planned batch
peaks within the budget + 2%, and AutoSAC's predicted peak within 5% of the rank's measured one (3% in the cells of
issue "Sharded training as large models really run": FSDP2's mixed precision, reshard_after_forward, HSDP, TP).
Every cell is in the matrix tier, which CI runs: multi-process cells (world size 2 and 4: 2 or 4 processes on this
2-core machine, 30 to 70 s each) and the one-rank cells too (40 s for the four of a precision), whose behaviour the
quick tier covers with shorter fits (tests/test_callback.py, tests/test_fsdp_apply.py, tests/test_loop_precision.py).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
from sharded_fits import CellResult, run_cells

PRECISIONS = ("32-true", "bf16-mixed")
SHARDED_AS_LARGE_MODELS_RUN = ("fsdp2-mp", "fsdp2-keep", "fsdp2-reshard2", "hsdp", "tp2-fsdp2")


@functools.cache
def _group(world_size: int, precisions: tuple[str, ...]) -> dict[tuple[str, str], list[CellResult]]:
    # One set of processes per world size runs every strategy of it, in the given precisions (see run_cells).
    by_size = {
        1: ("single", "ddp", "fsdp2", "fsdp2-mp", "fsdp1"),
        2: ("ddp", "fsdp2", "fsdp2-mp", "fsdp2-keep", "fsdp1"),
        4: ("ddp", "fsdp2", "fsdp2-mp", "fsdp2-keep", "fsdp2-reshard2", "hsdp", "tp2-fsdp2", "fsdp1"),
    }
    strategies = by_size[world_size]
    out = Path(tempfile.mkdtemp(prefix=f"matrix_ws{world_size}_"))
    return run_cells(strategies, world_size, precisions, out)


def _cells() -> list:
    cells = [("single", 1)] + [(s, w) for s in ("ddp", "fsdp2", "fsdp1") for w in (1, 2, 4)]
    params = [pytest.param(s, w, p, id=f"{s}-{p}-ws{w}", marks=pytest.mark.slow) for s, w in cells for p in PRECISIONS]
    # FSDP2's MixedPrecisionPolicy (bf16 parameters, fp32 reduction) under Lightning's "32-true" (FSDP casts, not
    # autocast), reshard_after_forward=False, and HSDP (a 2 x 2 replicate x shard mesh).
    extra = [("fsdp2-mp", 1), ("fsdp2-mp", 2), ("fsdp2-mp", 4), ("fsdp2-keep", 2), ("fsdp2-keep", 4)]
    extra += [("fsdp2-reshard2", 4), ("hsdp", 4)]  # reshard_after_forward=2: half of each unit kept after forward
    extra += [("tp2-fsdp2", 4)]  # tensor parallel 2 inside each layer, FSDP2 over the 2 data-parallel ranks
    params += [pytest.param(s, w, "32-true", id=f"{s}-32-true-ws{w}", marks=pytest.mark.slow) for s, w in extra]
    return [*params, pytest.param("fsdp2-offload", 2, "32-true", id="fsdp2-offload-32-true-ws2", marks=OFFLOAD)]


# FSDP2's CPUOffloadPolicy cannot be measured on this machine: its copy of a shard to a CPU device is the shard itself
# (tests/test_sharded_memory.py::test_offload_moves_nothing_on_a_cpu_device), so the measured peak is the same with
# offload as without. The memory model's offload rules are tested by hand in tests/test_sharded_memory.py.
OFFLOAD = [
    pytest.mark.slow,
    pytest.mark.skip(
        reason="offload moves nothing on a CPU device (FSDP2 copies a shard to the device as the shard itself): "
        "what it takes off a GPU cannot be measured here; the memory model's offload rules are tested by hand"
    ),
]


@pytest.mark.parametrize(("strategy", "world_size", "precision"), _cells())
def test_autosac_holds_in_the_cell(strategy: str, world_size: int, precision: str) -> None:
    # A world size's cells of one tier share their processes; the one-rank cells of each tier run apart.
    precisions = (precision,) if world_size == 1 else PRECISIONS
    ranks = _group(world_size, precisions)[strategy, precision]
    assert len(ranks) == world_size
    first = ranks[0]
    assert first.decisions, "the budget at 80% of the plain peak needs a plan"
    for r in ranks:
        assert r.fingerprint == first.fingerprint
        assert r.decisions == first.decisions  # every rank applies rank 0's plan
        assert r.planned_losses == r.plain_losses  # bit-equal: the plan changes no value
        assert len(r.planned_peaks) == len(r.plain_peaks) > 0
        measured = max(r.planned_peaks)
        assert measured <= r.budget_bytes * 1.02, (r.rank, measured, r.budget_bytes)
        # The prediction of the planned step within 5% of what the rank measured (3% in the later cells: issue bounds).
        bound = 0.03 if strategy in SHARDED_AS_LARGE_MODELS_RUN else 0.05
        assert abs(r.predicted_peak - measured) <= bound * measured, (r.rank, r.predicted_peak, measured)
        # And the plain step's, which the budget was set from.
        assert abs(r.predicted_plain - max(r.plain_peaks)) <= 0.05 * max(r.plain_peaks)
