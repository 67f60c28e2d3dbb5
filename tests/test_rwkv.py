"""A recurrent LM that fills its output by slice writes (transformers' RWKV on its CPU path), planned and trained.

``rwkv_linear_attention_cpu`` makes ``output = torch.zeros_like(key)`` and writes ``output[:, t]`` once per token;
the blocks take ``state=`` by keyword. The plain prediction holds against torch.profiler's allocator events of a
real step; a plan at 80% of the peak recomputes the attention's output buffer, and applied with either backend it
rebuilds it with every write: loss, every gradient and every buffer equal the plain model's over two optimizer
steps, and the step measures at most 2% above its prediction and never above the unplanned one.
"""

from __future__ import annotations

import pytest
from test_real_models import measured_planned_peak, reference, train_planned

from lightning_sac import solve_plan
from lightning_sac.solver.recompute import recomputed_ops

GIB = 2**30
BUFFER = "aten.zeros_like.default"


@pytest.mark.slow  # a long real-model cell: the matrix tier (the mechanism's unit tests are quick)
def test_the_plain_prediction_matches_a_real_step():
    ref = reference("rwkv")
    predicted = ref.profile.plain_peak_bytes
    assert abs(predicted - ref.plain_peak) <= 0.02 * ref.plain_peak, (predicted, ref.plain_peak)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sac", "graph"])
def test_a_plan_at_80_percent_replays_the_slice_writes_and_holds(backend):
    ref = reference("rwkv")
    plan = solve_plan(ref.profile, 0.8 * ref.profile.peak_bytes / GIB, backend=backend)
    # The plan recomputes a scan's output buffer: the recompute must replay every one of its slice writes.
    scans = []
    for fqn, decision in plan.decisions.items():
        stats = ref.profile.modules[fqn].op_stats
        assert stats is not None
        for i, name in enumerate(decision.op_names):
            writes = [op for op, parent in stats.inplace_ops if parent == i and op != i]
            if name == BUFFER and not decision.op_policy[i] and len(writes) == ref.family.batch["input_ids"].shape[1]:
                scans.append(fqn)
                if backend == "sac":  # SAC reruns the forward: the buffer and every write into it
                    assert {i, *writes} <= set(recomputed_ops(stats, decision.op_policy, "sac"))
    assert scans
    wrappers = train_planned(ref, plan, exact=True)
    assert all(w.calls == 2 for w in wrappers)
    measured = measured_planned_peak(ref, plan)
    assert measured <= 1.02 * plan.predicted_peak_bytes, (measured, plan.predicted_peak_bytes)
    assert measured <= ref.plain_peak
