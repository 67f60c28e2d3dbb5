"""Where the step time goes when every layer of a decoder is checkpointed, mechanism by mechanism, in the real step.

The Hugging Face Llama of ``vs_peers.py`` (4 layers, d=256, GQA 8/4, no dropout, batch 8 x 256, AdamW, one CPU
thread) is trained for real with each of these applied to every decoder layer, interleaved with the plain model in
rounds:

- full AC: ``torch.utils.checkpoint`` of the layer (the peer);
- ours, whole: our plan's policy that saves nothing, run as the plain checkpoint it is applied as, whose recompute
  would skip an op nothing in backward needs; on this Llama there is none (torch's checkpoint stops its recompute
  at the last saved tensor, ``down_proj``'s input), so this is torch's checkpoint timed a second time: the
  difference between the first two rows is the noise of one mechanism;
- ours, selective, nothing saved: the same policy run under the selective policy's dispatch modes;
- ours, selective, all saved: the selective policy keeping every op (the wrapper and the keeping alone, no
  recompute);
- torchtitan op-SAC (the peer of ``_peers.py``).

Per mechanism: the median over rounds of its step minus the plain step of the same round, per layer, beside what
the profile's calibration (``estimate="benchmark"``, the layer alone on synthetic inputs) predicts for it. Like
``vs_peers.py`` the script re-runs itself with glibc's malloc told to keep freed memory.

    python benchmarks/checkpoint_costs.py
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _peers import full_ac, titan_op_sac, transformer_blocks  # noqa: E402
from torch import nn  # noqa: E402
from vs_peers import CACHING_MALLOC, hf_llama  # noqa: E402

from lightning_sac import profile_model  # noqa: E402
from lightning_sac.apply import apply_plan, whole_checkpoints  # noqa: E402
from lightning_sac.dryrun import ModuleOpStats  # noqa: E402
from lightning_sac.dryrun.step import model_inputs, model_loss, training_step  # noqa: E402
from lightning_sac.profiling.overhead import whole_module_plan  # noqa: E402
from lightning_sac.solver import least_kept_policy, recompute_ms, skipped_ops  # noqa: E402


def every_layer(model: nn.Module, policy: list[int], stats: ModuleOpStats, whole: bool) -> nn.Module:
    """``model`` with one policy applied to each of its layers: as a plain checkpoint where it may run as one."""
    one = whole_module_plan(stats.func_names, policy, skipped_ops(stats, policy))
    plan = dataclasses.replace(one, decisions={name: one.decisions[""] for name, _ in transformer_blocks(model)})
    with whole_checkpoints(whole):
        apply_plan(model, plan)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if any(os.environ.get(k) != v for k, v in CACHING_MALLOC.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **CACHING_MALLOC})
    torch.set_num_threads(1)
    case = hf_llama(argparse.Namespace(layers=4, hidden=256, batch=8, seq=256, dropout=0.0))
    profile = profile_model(
        case.model, case.batch, optimizer_factory=case.optimizer, device="cpu", estimate="benchmark"
    )
    layer = profile.modules[transformer_blocks(case.model)[0][0]]
    stats, (fixed, factor, whole_ms) = layer.op_stats, layer.measured_overhead["sac"]
    assert stats is not None
    n, none = len(stats.func_names), least_kept_policy(stats)
    rerun = recompute_ms(stats, none)
    # What the calibration predicts per layer (see lightning_sac.solver.recompute.overhead_ms).
    predicted = {"ours, whole": whole_ms, "ours, selective, nothing saved": fixed + factor * rerun}
    predicted["ours, selective, all saved"] = fixed

    def fresh() -> nn.Module:
        return copy.deepcopy(case.model)

    makers: dict[str, Callable[[], nn.Module]] = {
        "plain": fresh,
        "full AC": lambda: full_ac(fresh()),
        "ours, whole": lambda: every_layer(fresh(), none, stats, True),
        "ours, selective, nothing saved": lambda: every_layer(fresh(), none, stats, False),
        "ours, selective, all saved": lambda: every_layer(fresh(), [1] * n, stats, False),
        "torchtitan op-SAC": lambda: titan_op_sac(fresh()),
    }
    names = list(makers)
    models = [makers[k]() for k in names]
    opts = [case.optimizer(m.parameters()) for m in models]
    inputs, loss = model_inputs(case.batch), model_loss(None)
    times: dict[str, list[float]] = {k: [] for k in names}
    order, shuffle = list(range(len(names))), random.Random(0)
    for r in range(args.rounds + 2):  # two warm-up rounds
        shuffle.shuffle(order)
        for k in order:
            start = time.perf_counter()
            training_step(models[k], inputs, loss, opts[k])
            if r >= 2:
                times[names[k]].append(time.perf_counter() - start)
    layers = len(transformer_blocks(case.model))
    plain = statistics.median(times["plain"]) * 1e3
    print(
        f"{case.name}, batch 8 x 256, AdamW, one CPU thread, malloc keeps freed memory; plain step {plain:.0f} ms, "
        f"{args.rounds} rounds; the layer's recompute by the profile's op times: {rerun:.1f} ms"
    )
    print(f"{'every layer':>32} | {'step overhead':>13} | {'per layer, ms':>13} | {'calibration, ms':>15}")
    for name in names[1:]:
        extra = statistics.median(a - b for a, b in zip(times[name], times["plain"], strict=True)) * 1e3
        cal = f"{predicted[name]:>15.1f}" if name in predicted else f"{'':>15}"
        print(f"{name:>32} | {extra / plain:>13.1%} | {extra / layers:>13.1f} | {cal}")


if __name__ == "__main__":
    main()
