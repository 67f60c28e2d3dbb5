"""Per-op runtime estimates: a roofline for any target, or timing real tensors on this machine.

Both are called once per op from inside the dry run's dispatch mode, with the op's fake arguments and output.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Protocol

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils.flop_counter import flop_registry

from lightning_sac.devices import DeviceSpec
from lightning_sac.dryrun.values.meta_fallback import grouped_mm_flops
from lightning_sac.ops import flat_tensors, is_sac_ignored, is_view_like

__all__ = [
    "BenchmarkEstimator",
    "RooflineEstimator",
    "RuntimeEstimator",
    "make_estimator",
    "op_flops",
    "real_tensor",
]

aten = torch.ops.aten

# torch's flop registry has no entry for the CPU flash-attention kernels, which do the same matmuls as the
# CUDA ones; without these the "cpu" target would see attention as free of compute.
_EXTRA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[aten._scaled_dot_product_flash_attention],
    aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_registry[
        aten._scaled_dot_product_flash_attention_backward
    ],
    # Mixture-of-experts layers (transformers' grouped-mm experts): torch's registry has no formula for it.
    aten._grouped_mm: grouped_mm_flops,
}


class RuntimeEstimator(Protocol):
    """Estimates one op's runtime in ms from its (fake) arguments and output."""

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
        """Return the estimated runtime of ``func`` in ms."""
        ...


def _no_kernel(func: Any) -> bool:
    # Views and the ops SAC ignores (detach, metadata queries) launch no kernel on a GPU.
    return is_view_like(func) or is_sac_ignored(func)


def op_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """Floating-point operations of one op call, from ``torch.utils.flop_counter``'s formulas (0 if none)."""
    packet: Any = getattr(func, "overloadpacket", None)
    formula = flop_registry.get(packet) or _EXTRA_FLOPS.get(packet)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


def _touched_bytes(tensor: torch.Tensor) -> int:
    # A broadcast (stride 0) dimension is read once, not once per element.
    n = 1
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        if stride != 0:
            n *= size
    return n * tensor.element_size()


class RooflineEstimator:
    """Runtime as the slower of compute and memory traffic at the target's peak rates.

    Args:
        spec: The target device.
        tf32: Whether fp32 matmuls run on TF32 tensor cores (``torch.backends.cuda.matmul.allow_tf32``).
    """

    def __init__(self, spec: DeviceSpec, *, tf32: bool = False) -> None:
        self.spec = spec
        self.tf32 = tf32

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
        """Return ``max(flops / peak, bytes / bandwidth)`` in ms."""
        if _no_kernel(func):
            return 0.0
        outs = flat_tensors(out)
        ins = flat_tensors(args) + flat_tensors(list(kwargs.values()))
        moved = sum(_touched_bytes(t) for t in ins) + sum(_touched_bytes(t) for t in outs)
        memory_s = moved / (self.spec.dram_gbps * 1e9)
        flops = op_flops(func, args, kwargs, out)
        if flops == 0:
            return memory_s * 1e3
        dtype = next((t.dtype for t in outs if t.is_floating_point()), torch.float32)
        compute_s = flops / (self.spec.peak_tflops(dtype, tf32=self.tf32) * 1e12)
        return max(compute_s, memory_s) * 1e3


def real_tensor(shape: tuple[int, ...], stride: tuple[int, ...], offset: int, dtype: torch.dtype) -> torch.Tensor:
    """A real CPU tensor of this layout holding valid indices and values of a typical scale."""
    # Allocate the extent the strides reach, fill it, then view it: broadcast (stride 0) and overlapping
    # layouts cannot be filled in place.
    numel = math.prod(shape)
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) if numel else 0
    base = torch.empty(extent + offset, dtype=dtype, device="cpu")
    # Zeros are valid indices for embedding, gather and losses. Floats get positive values of a typical scale:
    # a NaN from sqrt or log of a negative takes a slow path on CPUs (sqrt: 18x on this one), and AdamW's
    # sqrt of its second moment never sees one in training.
    if base.is_floating_point() or base.is_complex():
        base.uniform_(0.5, 1.5)
    else:
        base.zero_()
    return base.as_strided(shape, stride, offset)


def _real_like(x: Any) -> Any:
    """A real CPU tensor with the fake tensor's shape, strides and dtype (:func:`real_tensor`)."""
    if not isinstance(x, torch.Tensor):
        if isinstance(x, (list, tuple)):
            return type(x)(_real_like(v) for v in x)
        return x
    return real_tensor(tuple(x.shape), tuple(x.stride()), int(x.storage_offset()), x.dtype)


def _out_variant(func: Any, out: Any) -> tuple[Any, dict[str, torch.Tensor]] | None:
    """The ``out=`` overload of ``func`` and real tensors to write ``out`` into, or ``None`` if it has none.

    The overload must take exactly ``func``'s arguments plus one ``out`` argument per tensor output.
    """
    if not isinstance(func, torch._ops.OpOverload) or func._schema.is_mutable:
        return None
    outputs = flat_tensors(out)
    if not outputs or len(outputs) != len(func._schema.returns):
        return None
    signature = [(a.name, str(a.type)) for a in func._schema.arguments]
    packet = func.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        arguments = candidate._schema.arguments
        outs = [a for a in arguments if a.is_out]
        if len(outs) == len(outputs) and [(a.name, str(a.type)) for a in arguments if not a.is_out] == signature:
            return candidate, {a.name: _real_like(o) for a, o in zip(outs, outputs, strict=True)}
    return None


def _signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_signature(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _signature(v)) for k, v in x.items()))
    return repr(x)


class BenchmarkEstimator:
    """Runtime measured by running each op on real CPU tensors of the same shapes (this machine only).

    Results are cached by operator and argument signature, so a 32-block model times each distinct op once.
    An op is timed through its ``out=`` overload when it has one, writing into the same preallocated outputs
    every repeat: a fresh multi-MiB output per call would be new pages from the OS each time, and their page
    faults can cost more than the kernel (4x for an elementwise add), which neither a training step (that
    reuses freed memory) nor a GPU's caching allocator pays.

    Args:
        min_seconds: Keep repeating an op until this much time has been measured.
        max_repeats: Upper bound on repetitions per op.
    """

    def __init__(self, *, min_seconds: float = 2e-3, max_repeats: int = 20) -> None:
        self.min_seconds = min_seconds
        self.max_repeats = max_repeats
        self._cache: dict[Any, float] = {}
        self._warned: set[str] = set()

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
        """Return the measured runtime of ``func`` on real tensors, ms."""
        if _no_kernel(func):
            return 0.0
        key = (func, _signature(args), _signature(kwargs))
        if key in self._cache:
            return self._cache[key]
        # fork_rng: synthetic inputs and random ops draw from the global generator, which is the user's.
        with unset_fake_temporarily(), torch.no_grad(), torch.random.fork_rng(devices=[]):
            real_args, real_kwargs = _real_like(args), {k: _real_like(v) for k, v in kwargs.items()}
            variant = _out_variant(func, out)
            if variant is not None:
                func, outs = variant
                real_kwargs.update(outs)
            try:
                func(*real_args, **real_kwargs)  # warm-up: first calls pay for lazy initialisation
            except RuntimeError as err:
                # Synthetic values can be invalid for a few ops (e.g. multinomial on zero weights). Such an op
                # falls back to 0 ms, and the user is told once which op it was.
                if str(func) not in self._warned:
                    self._warned.add(str(func))
                    warnings.warn(
                        f"lightning-sac could not time {func} on synthetic inputs ({err}); its runtime is "
                        "counted as 0 ms. Use estimate='roofline' if this op matters.",
                        stacklevel=2,
                    )
                self._cache[key] = 0.0
                return 0.0
            # The fastest repeat: on a shared CPU interference only ever adds time.
            elapsed, n, best = 0.0, 0, float("inf")
            while n < self.max_repeats and (elapsed < self.min_seconds or n < 3):
                start = time.perf_counter()
                func(*real_args, **real_kwargs)
                took = time.perf_counter() - start
                elapsed, n, best = elapsed + took, n + 1, min(best, took)
        ms = best * 1e3
        self._cache[key] = ms
        return ms


def make_estimator(kind: str, spec: DeviceSpec) -> RuntimeEstimator:
    """Build the estimator named by ``kind`` (``"roofline"`` or ``"benchmark"``) for ``spec``.

    Raises:
        ValueError: ``kind`` is neither, or ``"benchmark"`` is asked for a device this machine is not.
    """
    if kind == "roofline":
        tf32 = spec.is_cuda and torch.get_float32_matmul_precision() != "highest"
        return RooflineEstimator(spec, tf32=tf32)
    if kind == "benchmark":
        if spec.is_cuda:
            raise ValueError(
                f"estimate='benchmark' times ops on this machine's CPU, so it cannot estimate {spec.name!r}. "
                "Use estimate='roofline' to plan for a GPU, or device='cpu' to benchmark the CPU."
            )
        return BenchmarkEstimator()
    raise ValueError(f"estimate must be 'roofline' or 'benchmark', got {kind!r}.")
