"""What wrapping a module costs on this CPU, measured on the module itself (``estimate="benchmark"``).

The per-op figures of :mod:`lightning_sac.profiling.overhead` come from a chain of tiny ops, and on a real
module they fall short (a GPT block of this repository's benchmark pays 1.5-2x as much):

* Under any Python dispatch mode, which both backends run their forward in, ATen treats every tensor as a
  subclass, and composite ops take their out-of-place paths: the CPU's math attention adds its mask into a new
  tensor (``add``) where the plain forward writes in place (``add_``). The profile cannot tell, since its own
  dry run runs under such a mode and sees the out-of-place path.
* A saved output stays alive in memory the cache no longer holds, where the plain forward would have reused it.
* An op rerun in backward runs slower than the same op timed in isolation.

So for each module a plan may wrap, a copy of the real module is run on synthetic inputs of its profiled shapes:
plainly, and under each backend with every op saved and with every op recomputed that may be (a BatchNorm's output
stays saved: :func:`~lightning_sac.solver.knapsack.least_kept_policy`). From their times, per
backend, two numbers (``ModuleProfile.measured_overhead[backend]``):

* ``fixed_ms``: the keep-all step minus the plain one: what wrapping costs whatever the policy;
* ``recompute_factor``: the recompute-all backward minus the keep-all one, over the recompute the profile
  predicts for that policy (:func:`lightning_sac.solver.recompute.recompute_ms`): how much slower the rerun is for
  real (0.9-1.1 on a GPT block here);
* for SAC, when the module's most-discarding policy saves nothing, a third, ``whole_ms``: what that policy
  costs in all (recompute included) when it runs as the plain checkpoint it is applied as
  (:mod:`lightning_sac.apply.sac`), without the selective policy's dispatch modes.

A policy in between is interpolated by its predicted recompute (:func:`lightning_sac.solver.recompute.overhead_ms`).
Modules are measured once per class, parameter shapes and input signature, in interleaved rounds: each figure is
the median over rounds of a configuration's difference from its reference in the same round. Not measured (the
per-op figures apply): modules called more than once, the root and any module that runs more than half the
step's forward ops (timing it would double the profile's time; counted in ops, not timed, so that which modules
are measured never depends on how busy the machine was), and models whose weights are not real CPU tensors
(built on the meta device). A module that cannot run on synthetic inputs is named in one warning.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_sac.dryrun import ModuleProfile, materialize, tensors_of
from lightning_sac.plan import BACKENDS
from lightning_sac.profiling.overhead import whole_module_plan
from lightning_sac.solver import recompute_ms, skipped_ops

__all__ = ["calibrate_modules"]

# The interleaved measurement runs one warm-up round, then rounds until at least _MIN_ROUNDS and _MIN_SECONDS
# (small modules: their differences are a fraction of a millisecond), at most _MAX_ROUNDS; the median of the
# differences within rounds counts.
_MIN_ROUNDS, _MAX_ROUNDS, _MIN_SECONDS = 8, 20, 0.5


def _is_real_cpu(module: nn.Module) -> bool:
    tensors = [*module.parameters(), *module.buffers()]
    return all(t.device.type == "cpu" and not isinstance(t, torch.nn.parameter.UninitializedParameter) for t in tensors)


def _most_ops(modules: Mapping[str, ModuleProfile]) -> float:
    # Half the forward ops of the step: the root's, or the largest module's where the root has no statistics.
    # Op counts, not the profile's times: a block timed at 0.42 of the step once read above half on a busy machine.
    root = modules.get("")
    if root is not None and root.op_stats is not None:
        return len(root.op_stats.func_names) / 2
    return max((len(p.op_stats.func_names) for p in modules.values() if p.op_stats is not None), default=0) / 2


def calibrate_modules(
    model: nn.Module,
    modules: Mapping[str, ModuleProfile],
    specs: Mapping[str, Any],
    *,
    share: tuple[object, ...] = (),
    autocast_dtype: torch.dtype | None = None,
) -> None:
    """Fill ``measured_overhead`` of the modules a plan may wrap (see the module docstring).

    Args:
        model: The user's model, with real weights on the CPU; only copies of its modules run.
        modules: The profile's modules, updated in place.
        specs: Per fqn, :func:`input_spec` of the module's forward inputs in the profiled step.
        share: Objects reachable from the modules that must not be copied.
        autocast_dtype: The autocast dtype the step ran its forward in, if any.
    """
    done: dict[Any, dict[str, list[float]]] = {}
    failed: list[str] = []
    named = dict(model.named_modules())
    bound = _most_ops(modules)
    for fqn, prof in modules.items():
        stats = prof.op_stats
        module = named.get(fqn)
        if stats is None or module is None or prof.calls != 1 or fqn not in specs or not stats.func_names:
            continue
        # The root's forward and backward are the whole step but the loss: never measured.
        if not fqn or len(stats.func_names) > bound or not _is_real_cpu(module):
            continue
        spec = specs[fqn]
        params = tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())
        key = (type(module), params, module.training, repr(spec))
        if key not in done:
            try:
                done[key] = _measure(module, spec, prof, share, autocast_dtype)
            except Exception as err:  # noqa: BLE001 - the module keeps the per-op figures, and the user is told
                failed.append(f"{fqn!r} ({type(err).__name__}: {err})")
                done[key] = {}
        prof.measured_overhead = {k: list(v) for k, v in done[key].items()}
    if failed:
        warnings.warn(
            "lightning-sac could not run these modules for real on synthetic inputs to measure what "
            f"checkpointing them costs on this CPU: {', '.join(failed)}. Their overhead is estimated per op "
            "instead, which underestimates it on large tensors.",
            stacklevel=3,
        )


def _measure(
    module: nn.Module,
    spec: Any,
    prof: ModuleProfile,
    share: tuple[object, ...],
    autocast_dtype: torch.dtype | None,
) -> dict[str, list[float]]:
    # The appliers and the knapsack import the profiler's data model: imported here to avoid a cycle.
    from lightning_sac.apply import apply_plan, runs_whole, whole_checkpoints
    from lightning_sac.solver import least_kept_policy

    stats = prof.op_stats
    assert stats is not None  # checked by the caller
    twin = copy.deepcopy(module, memo={id(o): o for o in share})
    n = len(stats.func_names)
    # "recompute": the most a policy can discard. A module with a BatchNorm inside (a ResNet block) must keep
    # that op's output, so a budget of 0 has no policy.
    policies = {"keep": [1] * n, "recompute": least_kept_policy(stats)}
    plans = {
        which: whole_module_plan(stats.func_names, policy, skipped_ops(stats, policy))
        for which, policy in policies.items()
    }
    configs: list[tuple[str, str]] = [("plain", "")] + [(b, p) for b in BACKENDS for p in policies]
    # A policy that saves nothing runs a plain checkpoint (lightning_sac.apply.sac), timed on its own.
    whole = not any(policies["recompute"]) and runs_whole(module, plans["recompute"].decisions[""])
    if whole:
        configs.append(("sac", "whole"))
        plans["whole"] = plans["recompute"]
    # Each configuration's whole step and backward, per round.
    steps: dict[tuple[str, str], list[float]] = {c: [] for c in configs}
    backwards: dict[tuple[str, str], list[float]] = {c: [] for c in configs}
    autocast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    # The user's RNG stream must not move: synthetic inputs and dropout draw from the global generator.
    # Every apply makes a new wrapper, which would warn about a mismatch once each: a mismatch raises instead.
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args, kwargs = materialize(spec)
        start, rounds = time.perf_counter(), -1  # round -1 warms up
        while rounds < _MIN_ROUNDS or (time.perf_counter() - start < _MIN_SECONDS and rounds < _MAX_ROUNDS):
            rounds += 1
            for backend, which in configs:
                if which:
                    plan = plans[which]
                    with whole_checkpoints(which == "whole"), apply_plan(twin, plan, backend=backend) as handle:
                        if which == "whole":  # a kind of call runs once under the policy first (apply.sac)
                            _step(twin, args, kwargs, autocast)
                        took, backward = _step(twin, args, kwargs, autocast)
                    mismatch = handle.wrappers[""].last_mismatch
                    if mismatch is not None:
                        # Synthetic values took another code path than the profiled step: the timings are not
                        # of the plan.
                        raise RuntimeError(f"on synthetic inputs it ran other ops than in the profile ({mismatch})")
                else:
                    took, backward = _step(twin, args, kwargs, autocast)
                if rounds:
                    steps[backend, which].append(took)
                    backwards[backend, which].append(backward)

    def extra(series: dict[tuple[str, str], list[float]], config: tuple[str, str], base: tuple[str, str]) -> float:
        # The median over rounds of the difference within a round, ms. The difference of each one's fastest
        # round moved by 5-26 ms between calibrations of the same Llama layer on this CPU (the heap and caches
        # differ from one moment to the next, and the fastest rounds of two configurations need not share one);
        # paired within rounds, by 12-18 ms, nearer the 13 ms the same policy costs the layer in the real step.
        return statistics.median(a - b for a, b in zip(series[config], series[base], strict=True)) * 1e3

    result = {}
    for backend in BACKENDS:
        # The factor compares backwards only: a forward that keeps nothing is also a little faster than one that
        # keeps everything, and on a small module that saving is as large as the recompute it would be mixed in
        # with. Leaving it out overstates a recompute-heavy policy's cost by that saving.
        rerun = extra(backwards, (backend, "recompute"), (backend, "keep"))
        predicted = recompute_ms(stats, policies["recompute"], backend)
        factor = rerun / predicted if predicted > 0 else 1.0
        result[backend] = [max(0.0, extra(steps, (backend, "keep"), ("plain", ""))), max(0.0, factor)]
    if whole:
        result["sac"].append(extra(steps, ("sac", "whole"), ("plain", "")))
    return result


def _step(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], autocast: Any) -> tuple[float, float]:
    """Forward and backward of ``module`` through every float output: (both, backward) in seconds.

    Gradients are reset after.
    """
    start = time.perf_counter()
    with autocast:
        out = module(*args, **kwargs)
    grads = [t.float().sum() for t in tensors_of(out) if t.requires_grad]
    middle = time.perf_counter()
    if grads:
        torch.stack(grads).sum().backward()
    end = time.perf_counter()
    module.zero_grad(set_to_none=True)
    for t in tensors_of((args, kwargs)):
        t.grad = None
    return end - start, end - middle
