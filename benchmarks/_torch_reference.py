"""Reference pipeline: PyTorch's private three-tracker estimation stack, driven the way its tests drive it.

``run_torch_pipeline`` gathers, with ``torch.distributed._tools``, the same three kinds of data that
``lightning_sac.profile_model`` gathers in one pass:

1. per-module memory        -- ``MemTracker`` over one training step (forward, backward, optimizer step),
                               after one untracked warm-up step that materializes the optimizer state
                               (``test_mem_tracker.py`` / ``test_runtime_estimator.py`` both warm up first);
2. per-module runtime       -- ``RuntimeEstimator("operator-level-cost-model")`` over its own training step
                               (``test_runtime_estimator.py::_runtime_estimate``);
3. SAC operator statistics  -- ``SACEstimator("operator-level-cost-model")`` around its own forward, followed by
                               the backward outside the estimator (``test_sac_estimator.py::_sac_estimation``).

Everything runs under one ``FakeTensorMode`` on the CPU device, with the model, optimizer and inputs built
inside the fake mode exactly as torch's tests build them (``with FakeTensorMode(): with torch.device(dev): ...``).

CPU patches (inputs and device checks only -- no tracker logic is replaced)
---------------------------------------------------------------------------
The roofline path of ``RuntimeEstimator`` (also used by ``SACEstimator``) needs CUDA for two reasons, and
``MemTracker`` needs nothing. ``cpu_patches(spec)`` applies exactly three ``unittest.mock.patch`` es:

* ``torch.utils._runtime_estimation.get_device_tflops`` -> ``spec.peak_tflops(dtype)`` (TFLOP/s).
  ``_runtime_estimation`` does ``from torch._inductor.utils import get_device_tflops, get_gpu_dram_gbps``, so its
  module globals are the use site (``flops_to_ns``). Unpatched it looks the *CUDA* device up in a datasheet table,
  and on a CUDA-less box returns 0.0 (compute time silently dropped from every estimate).
* ``torch.utils._runtime_estimation.get_gpu_dram_gbps`` -> ``spec.dram_gbps`` (GB/s). Use site:
  ``get_transfer_time``. Unpatched it calls ``triton.testing.get_dram_gbps()``, which needs a CUDA driver.
  (``runtime_estimator.py`` and ``sac_estimator.py`` do not import either name: they import
  ``get_compute_time`` / ``get_transfer_time`` / ``RuntimeEstimator._roofline_estimate``, so there is no other
  use site to patch.)
* ``torch.cuda.is_available`` -> ``True`` **only when called from** ``torch.distributed._tools.runtime_estimator``
  (its ``_roofline_estimate`` raises ``AssertionError("Roofline estimation needs to access CUDA capabilities ...")``
  otherwise); every other caller gets the real answer (``False``). The module calls it as the attribute
  ``torch.cuda.is_available`` on the global ``torch`` package, so there is no module-local name to patch; the
  patch is therefore installed on ``torch.cuda`` but scoped by the caller's module name, so nothing outside that
  single check (optimizer kernels, FakeTensorMode, autograd) ever sees a fake "CUDA available".

The CUDA-only bits that remain are not reached on CPU tensors: ``MemTracker`` / ``SACEstimator`` round storage sizes
up to 512 B only for ``device.type == "cuda"`` (CPU storages are counted at their exact size, which is the one
behavioural difference from a GPU run), and the ``operator-level-benchmark`` mode (CUDA events) is not used.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.runtime_estimator import RuntimeEstimator
from torch.distributed._tools.sac_estimator import SACEstimator
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["cpu_patches", "count_passes", "run_torch_pipeline"]

_RUNTIME_ESTIMATOR_MODULE = "torch.distributed._tools.runtime_estimator"


@contextlib.contextmanager
def cpu_patches(spec: Any) -> Iterator[None]:
    """Feed torch's roofline model the ``spec`` numbers and pass its CUDA check; see the module docstring."""
    real_is_available = torch.cuda.is_available

    def is_available_for_runtime_estimator() -> bool:
        # Scoped: only RuntimeEstimator's own `torch.cuda.is_available()` check sees True.
        if sys._getframe(1).f_globals.get("__name__") == _RUNTIME_ESTIMATOR_MODULE:
            return True
        return real_is_available()

    with (
        mock.patch(
            "torch.utils._runtime_estimation.get_device_tflops",
            new=lambda dtype: float(spec.peak_tflops(dtype)),
        ),
        mock.patch(
            "torch.utils._runtime_estimation.get_gpu_dram_gbps",
            new=lambda: float(spec.dram_gbps),
        ),
        mock.patch("torch.cuda.is_available", new=is_available_for_runtime_estimator),
    ):
        yield


@contextlib.contextmanager
def count_passes(root_type: type[nn.Module] | tuple[type[nn.Module], ...]) -> Iterator[dict[str, int]]:
    """Count forward and backward traversals of any ``root_type`` module, and optimizer steps, globally.

    Observation only: a global forward hook counts root forwards and puts a gradient hook on the root's output to
    count backwards through it; a global optimizer post-step hook counts steps. Used for an untimed run, so the
    counting never distorts the timings.
    """
    counts = {"forward": 0, "backward": 0, "optimizer_step": 0}

    def on_bw(grad: torch.Tensor) -> None:
        counts["backward"] += 1

    def fw_hook(module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(module, root_type):
            counts["forward"] += 1
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(on_bw)

    def opt_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        counts["optimizer_step"] += 1

    h_fw = nn.modules.module.register_module_forward_hook(fw_hook)
    h_opt = register_optimizer_step_post_hook(opt_hook)
    try:
        yield counts
    finally:
        h_fw.remove()
        h_opt.remove()


def _to_fake(x: Any, fake_mode: FakeTensorMode) -> Any:
    """A fake CPU tensor with ``x``'s metadata (``x`` may be real, meta, or already fake)."""
    if not isinstance(x, torch.Tensor):
        return x
    if fake_mode.is_our_fake(x):
        return x
    if x.device.type == "meta":
        with fake_mode:
            return torch.zeros(x.shape, dtype=x.dtype, device="cpu")
    return fake_mode.from_tensor(x)


def _memory_data(mt: MemTracker) -> dict[str, Any]:
    modules = {}
    for stats in mt.memory_tracking.values():
        modules[stats.mod_fqn] = {
            "parameter_mem": getattr(stats, "parameter_mem", 0),
            "buffer_mem": getattr(stats, "buffer_mem", 0),
            "input_mem": getattr(stats, "input_mem", 0),
            "output_mem": getattr(stats, "output_mem", 0),
            "local_peak": {str(d): v for d, v in stats.local_peak.items()},
            "snapshots": {str(state.value): snaps for state, snaps in stats.snapshots.items()},
        }
    return {"modules": modules, "peak": mt.get_tracker_snapshot("peak")}


def _runtime_data(rt: RuntimeEstimator) -> dict[str, Any]:
    return {
        "modules": {fqn: dict(v) for fqn, v in rt.mod_runtimes.items()},
        "total_ms": rt.total_runtime,
        "fw_pre_order": list(rt.mod_fw_pre_order),
        "bw_pre_order": list(rt.mod_bw_pre_order),
    }


def run_torch_pipeline(
    model_factory: Callable[[], nn.Module],
    example_inputs: Sequence[Any],
    optimizer_factory: Callable[[Any], torch.optim.Optimizer],
    spec: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    tradeoff_curves: bool = False,
    quiet: bool = True,
) -> dict[str, Any]:
    """Gather per-module memory, per-module runtime and SAC statistics with torch's three trackers.

    Args:
        model_factory: Builds the model; called inside ``FakeTensorMode`` under ``torch.device("cpu")``.
        example_inputs: Positional model inputs (real, meta or fake tensors; converted to fake CPU tensors).
        optimizer_factory: Maps the model's parameters to an optimizer.
        spec: Device spec with ``peak_tflops(dtype)`` (TFLOP/s) and ``dram_gbps`` (GB/s).
        loss_fn: Maps the model output to a scalar loss; defaults to ``out.sum()``.
        tradeoff_curves: Also fit SACEstimator's piecewise-linear trade-off curves (``pwlf``), as its test does.
        quiet: Swallow the trackers' own prints (``RuntimeEstimator.__exit__`` prints the total).

    Returns:
        ``{"memory", "runtime", "sac", "stage_seconds", "passes"}`` where ``passes`` counts the forward/backward
        traversals and optimizer steps issued by this driver.
    """
    loss_fn = loss_fn if loss_fn is not None else (lambda out: out.sum())
    stage: dict[str, float] = {}
    passes = {"forward": 0, "backward": 0, "optimizer_step": 0}

    def forward(model: nn.Module, inputs: Sequence[Any]) -> torch.Tensor:
        passes["forward"] += 1
        return loss_fn(model(*inputs))

    def backward(loss: torch.Tensor) -> None:
        passes["backward"] += 1
        loss.backward()

    def step(optimizer: torch.optim.Optimizer) -> None:
        passes["optimizer_step"] += 1
        optimizer.step()
        optimizer.zero_grad()

    def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: Sequence[Any]) -> None:
        backward(forward(model, inputs))
        step(optimizer)

    out_ctx = contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext()
    with out_ctx, cpu_patches(spec), FakeTensorMode() as fake_mode:
        t = time.perf_counter()
        with torch.device("cpu"):
            model = model_factory()
        inputs = tuple(_to_fake(x, fake_mode) for x in example_inputs)
        optimizer = optimizer_factory(model.parameters())
        stage["build"] = time.perf_counter() - t

        # 0. Warm-up step: materializes optimizer state and gradients' first allocation (untracked).
        t = time.perf_counter()
        train_step(model, optimizer, inputs)
        stage["warmup"] = time.perf_counter() - t

        # 1. MemTracker over one training step.
        t = time.perf_counter()
        mem_tracker = MemTracker()
        mem_tracker.track_external(model, optimizer, *inputs)
        with mem_tracker as mt:
            train_step(model, optimizer, inputs)
        memory = _memory_data(mt)
        stage["mem_tracker"] = time.perf_counter() - t

        # 2. RuntimeEstimator (roofline) over its own training step.
        t = time.perf_counter()
        runtime_estimator = RuntimeEstimator()
        with runtime_estimator(estimate_mode_type="operator-level-cost-model"):
            train_step(model, optimizer, inputs)
        runtime = _runtime_data(runtime_estimator)
        stage["runtime_estimator"] = time.perf_counter() - t

        # 3. SACEstimator (roofline): forward inside the estimator, backward after it (as in its test).
        t = time.perf_counter()
        sace = SACEstimator()
        with sace(estimate_mode_type="operator-level-cost-model"):
            loss = forward(model, inputs)
        backward(loss)
        model.zero_grad(set_to_none=True)
        if tradeoff_curves:
            sace.pwlf_sac_tradeoff_curve(n_segments=2, save_tradeoff_graphs=False)
        sac = {
            "stats": dict(sace.sac_mod_stats),
            "greedy_order": dict(sace.sac_mod_greedy_order_meta),
            "tradeoff": dict(sace.sac_mod_tradeoff_stats),
        }
        stage["sac_estimator"] = time.perf_counter() - t

    passes["fwd_bwd_passes"] = min(passes["forward"], passes["backward"])
    return {"memory": memory, "runtime": runtime, "sac": sac, "stage_seconds": stage, "passes": passes}
