"""The graph backend replays CUDA's random numbers: with dropout recomputed, gradients equal the plain model's.

The plan recomputes every op of the outermost checkpointable modules that a policy may recompute, so the dropout
ops (CUDA's fused ``native_dropout``, and SDPA's dropout through its philox seed and offset) run again in backward
from the generator state the graph recorded for them. Same seed, same batch: bit-equal to the plain model.
"""

from __future__ import annotations

import pytest

from lightning_sac import apply_plan
from lightning_sac.apply import graph as graph_ac

from .harness import (
    SEED,
    build,
    deterministic,
    differences,
    profile_for,
    recompute_everything,
    recomputed_random_ops,
    state_after_steps,
)

# Models with dropout: the demo GPT (attention and residual dropout) and Hugging Face's GPT-2 (embedding, attention
# and residual dropout, SDPA with a padding mask).
CASES = [("gpt", "fp32"), ("gpt", "bf16"), ("gpt2", "fp32"), ("gpt2", "bf16")]


@pytest.mark.parametrize(("name", "precision"), CASES, ids=["-".join(c) for c in CASES])
def test_graph_backend_replays_cuda_dropout(name, precision, figure):
    # Bit for bit, as in test_cuda_planned: deterministic kernels, the same seeds; recompute reruns each op with
    # the generator state recorded when it first ran. Profiled under the same mode, which picks the kernels.
    with deterministic():
        profile = profile_for(name, precision, "cuda")
        plan = recompute_everything(profile, backend="graph")
        random_ops = recomputed_random_ops(plan, profile)
        figure("checkpointed", ", ".join(sorted(plan.decisions)))
        figure("recomputed_random_ops", len(random_ops))
        assert random_ops, "the plan recomputes no random op, so it tests no RNG replay"
        plain = state_after_steps(build(name, "cuda"), precision)
        other_seed = state_after_steps(build(name, "cuda"), precision, seed=SEED + 100)
        case = build(name, "cuda")
        handle = apply_plan(case.model, plan, backend="graph")
        before = graph_ac.recompute_count()
        planned = state_after_steps(case, precision)
        recomputed = graph_ac.recompute_count() - before
    diff = differences(planned, plain)
    figure("graph_recomputed_op_calls", recomputed)
    figure("tensors_differing", len(diff))
    # Dropout decides the gradients: other masks give other ones, so a replay with the wrong masks would show.
    assert differences(other_seed, plain), "another seed gave the same gradients: dropout does not matter here"
    assert recomputed > 0, "backward recomputed nothing: the plan did not run as the graph backend"
    assert all(w.calls == 3 and w.mismatched_calls == 0 for w in handle.wrappers.values()), {
        f: w.last_mismatch for f, w in handle.wrappers.items()
    }
    assert not diff, f"{name} {precision} under the graph backend differs from the plain model: {diff[:10]}"
