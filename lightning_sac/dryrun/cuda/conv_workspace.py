"""cuDNN's convolution workspaces: measured on this GPU, or bounded for a CUDA target emulated on the CPU.

A fake convolution makes its outputs and nothing else, but cuDNN's kernels run with a workspace that torch takes
from the caching allocator for the call and frees after it (``run_conv_plan`` in ATen's
``native/cudnn/Conv_v8.cpp``: ``CUDACachingAllocator::get()->allocate(plan.getWorkspaceSize())``). Its size is the
chosen engine's, and torch chooses as follows (same file):

* ``torch.backends.cudnn.benchmark`` off: the engine configurations cuDNN's heuristics rank first
  (``CUDNN_HEUR_MODE_INSTANT``, or mode B under ``TORCH_CUDNN_USE_HEURISTIC_MODE_B``), minus those with numerical
  notes torch refuses (non-deterministic ones under deterministic algorithms; TF32 tensor-core ones for float32
  when ``allow_tf32`` is off; down-converting ones always). The first that builds, and whose workspace the allocator
  can give, runs (``try_configs``: an out-of-memory error moves on to the next configuration, so a workspace never
  causes an OOM by itself: under a tight budget cuDNN runs a slower engine instead).
* ``benchmark`` on: every plan whose workspace fits the allocator's largest cached free block
  (``get_available_workspace`` reads ``cacheInfo``) is timed once with one shared workspace of the largest such size
  (halved until it allocates), and the fastest runs from then on. That search happens at a signature's first call
  and within memory already reserved; the steps after it hold the fastest plan's workspace.

cuDNN's heuristics are not published, so the size cannot be derived from a formula: on a GPU, the dry run measures
it, running each distinct signature (operation, shapes, strides, dtype, cuDNN flags) twice on zero tensors of this
GPU and taking the second call's allocated peak beyond its outputs, as a training step after the first one holds it.
For an emulated target (planning for a named GPU on a machine without it) the workspace is bounded by
:data:`BOUND_RATIOS` (:data:`POINTWISE_BOUND` and :data:`STRIDED_POINTWISE_BOUND` for 1x1 kernels): per
precision, layout, stride and direction, the largest workspace measured on an H100 (cuDNN 9.19,
``tests/gpu/test_cuda_workspace.py``, figures in docs/benchmarks.md) as a multiple of the larger of the call's input
and output. It is an upper bound of those measurements, not a prediction of the engine cuDNN will pick.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from lightning_sac.devices import DeviceSpec, driver_name_entry
from lightning_sac.dryrun.cpu.scratch import call_signature, real_zeros_like
from lightning_sac.dryrun.cuda.sdpa import attention_workspace_bytes
from lightning_sac.ops import composite_scratch

__all__ = [
    "BOUND_RATIOS",
    "CONVOLUTION_OPS",
    "POINTWISE_BOUND",
    "STRIDED_POINTWISE_BOUND",
    "CudaWorkspace",
    "CudnnWorkspace",
    "WorkspaceBound",
    "bound_bytes",
    "cuda_workspace",
    "cudnn_flags",
    "cudnn_workspace",
]

aten = torch.ops.aten
GIB = 2**30
_BLOCK = 512  # the caching allocator's rounding (CUDACachingAllocator.cpp, kMinBlockSize)

_FORWARD = aten.convolution.default
_BACKWARD = aten.convolution_backward.default
CONVOLUTION_OPS = frozenset({_FORWARD, _BACKWARD})


@dataclass(frozen=True)
class WorkspaceBound:
    """The largest workspace measured, as a multiple of the larger of a convolution's input and output.

    Attributes:
        forward: For ``aten.convolution`` (input, output).
        backward: For ``aten.convolution_backward`` (input, grad_output: the input and output of the forward).
    """

    forward: float
    backward: float


# (half precision, channels-last, strided) -> bound, for kernels larger than 1x1. Half precision: bfloat16 and float16
# operands. The largest of the signatures measured on an H100 80GB HBM3 with cuDNN 9.19 and torch 2.11, benchmark on
# and off (docs/benchmarks.md), rounded up; in brackets the signature that sets it. Strided convolutions run other
# engines: a 3x3/2 16->32 backward on 512 x 32 x 32 holds 1.5x its input where the 3x3/1 16->16 one holds 17.5x.
BOUND_RATIOS: dict[tuple[bool, bool, bool], WorkspaceBound] = {
    (False, False, False): WorkspaceBound(forward=2.4, backward=18.0),  # [3x3 256->256 at 14 x 14]; [3x3 16->16]
    (False, True, False): WorkspaceBound(forward=0.03, backward=8.3),  # [3x3 64->64]; [depthwise 7x7]
    (True, False, False): WorkspaceBound(forward=2.4, backward=2.4),  # [3x3 256->256 at 14 x 14]; [the same]
    (True, True, False): WorkspaceBound(forward=0.25, backward=0.3),  # [3x3 256->256 at 14 x 14]; [the same]
    (False, False, True): WorkspaceBound(forward=1.2, backward=1.55),  # [7x7/2 stem]; [3x3/2 16->32]
    (False, True, True): WorkspaceBound(forward=0.2, backward=1.55),  # [7x7/2 stem]; [3x3/2 16->32]
    (True, False, True): WorkspaceBound(forward=1.55, backward=1.65),  # [7x7/2 stem]; [7x7/2 stem, 3x3/2 16->32]
    (True, True, True): WorkspaceBound(forward=0.53, backward=0.62),  # [7x7/2 stem]; [7x7/2 stem]
}
# 1x1 convolutions (a GEMM for cuDNN): at most 0.1x in every precision and layout measured (a channels-last bf16
# 64->256 backward on 32 x 56 x 56), except strided ones on a contiguous input, below.
POINTWISE_BOUND = WorkspaceBound(forward=0.05, backward=0.15)
# A strided 1x1 convolution on a contiguous input (ResNet's downsampling shortcut) holds about its input once more:
# 1.06x forward in bf16 (0 in fp32) and 1.12x backward, 256->64 at stride 2 on 32 x 56 x 56; channels-last, 0.06x.
STRIDED_POINTWISE_BOUND = WorkspaceBound(forward=1.1, backward=1.15)


def _round(nbytes: float) -> int:
    return int(-(-int(nbytes) // _BLOCK) * _BLOCK)


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _channels_last(x: torch.Tensor) -> bool:
    return x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def bound_bytes(func: Any, args: tuple[Any, ...], out: Any = None) -> int:
    """The workspace bound of a convolution call for an emulated CUDA target (:data:`BOUND_RATIOS`), in bytes.

    Args:
        func: ``aten.convolution.default`` or ``aten.convolution_backward.default``; anything else gets 0.
        args: The call's arguments.
        out: The forward's output (its size is the base when larger than the input); unused for backward.
    """
    if func is _FORWARD:
        x, base_other = args[0], _nbytes(out)
        ratio_of = "forward"
    elif func is _BACKWARD:
        x, base_other = args[1], _nbytes(args[0])  # the forward's input, and grad_output: its output's size
        ratio_of = "backward"
    else:
        return 0
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        return 0  # 1-D and 3-D convolutions were not measured: charged nothing, as before (docs/methodology.md)
    weight = args[1] if func is _FORWARD else args[2]
    pointwise = isinstance(weight, torch.Tensor) and tuple(weight.shape[2:]) == (1, 1)
    half = x.dtype in (torch.bfloat16, torch.float16)
    stride = args[3] if func is _FORWARD else args[4]
    strided = any(int(s) > 1 for s in stride)
    if pointwise:
        bound = STRIDED_POINTWISE_BOUND if strided and not _channels_last(x) else POINTWISE_BOUND
    else:
        bound = BOUND_RATIOS[(half, _channels_last(x), strided)]
    return _round(getattr(bound, ratio_of) * max(_nbytes(x), base_other))


def cudnn_flags() -> tuple[bool, bool, bool, bool]:
    """What decides torch's choice of cuDNN engine: enabled, benchmark, deterministic, allow_tf32."""
    ctx = torch.backends.cudnn
    deterministic = bool(ctx.deterministic) or torch.are_deterministic_algorithms_enabled()
    return bool(ctx.enabled), bool(ctx.benchmark), deterministic, bool(ctx.allow_tf32)


class CudnnWorkspace:
    """The workspace of convolution calls on this GPU: measured once per signature and cached for the process.

    Args:
        limit_bytes: Operands above this many bytes are not allocated (the bound is charged instead); ``None``: 1 GiB
            or a quarter of the GPU's free memory, whichever is less.

    Attributes:
        measured: How many signatures were run on the GPU.
    """

    def __init__(self, *, limit_bytes: int | None = None) -> None:
        self.limit_bytes = limit_bytes
        self.measured = 0
        self._cache: dict[Any, int] = {}

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
        """Bytes cuDNN's workspace takes within this call on this GPU (0 for other ops)."""
        if func not in CONVOLUTION_OPS:
            return 0
        device = next((str(t.device) for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)), None)
        key = (func, device, call_signature(args), call_signature(tuple(sorted(kwargs.items()))), cudnn_flags())
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        operands = sum(_nbytes(t) for t in tree_flatten((args, kwargs, out))[0])
        limit = self.limit_bytes
        if limit is None:
            free, _ = torch.cuda.mem_get_info()
            limit = min(GIB, free // 4)
        # The measurement resets the allocator's peak counter, which a running measurement (a profiler's window in
        # a fit) reads: bound it then, uncached.
        if operands > limit or torch.autograd._profiler_enabled():
            return bound_bytes(func, args, out)
        self._cache[key] = self._measure(func, args, kwargs)
        self.measured += 1
        return self._cache[key]

    @staticmethod
    def _measure(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        # Outside every mode (fake, recorder, real values), without autograd or autocast: the call is real, unseen,
        # and sees the dtypes the dry run recorded.
        with (
            _disable_current_modes(),
            torch._C.DisableTorchFunction(),
            torch.no_grad(),
            torch.autocast("cuda", enabled=False),
        ):
            real_args, real_kwargs = tree_map(real_zeros_like, (args, kwargs))
            scratch = 0
            for _ in range(2):  # the first call picks (with benchmark on: times) the engine; a step holds the second's
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                result = func(*real_args, **real_kwargs)
                torch.cuda.synchronize()
                kept = sum(_round(_nbytes(t)) for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor))
                scratch = max(0, torch.cuda.max_memory_allocated() - before - kept)
                del result
        return scratch


class CudaWorkspace:
    """The workspace of a CUDA target's kernels: attention's from its formulas, convolutions' measured or bounded.

    Args:
        attention: Attention kernels' workspace (:func:`~lightning_sac.dryrun.cuda.sdpa.attention_workspace_bytes`).
        convolution: The measurement on this GPU, or ``None`` for an emulated target (the bound).
    """

    def __init__(self, attention: Callable[..., int], convolution: CudnnWorkspace | None) -> None:
        self.attention = attention
        self.convolution = convolution

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any = None) -> int:
        """Bytes the kernel of ``func`` allocates and frees within this call on the target."""
        if func in CONVOLUTION_OPS:
            return self.convolution(func, args, kwargs, out) if self.convolution else bound_bytes(func, args, out)
        # A composite's own scratch, each allocation in the caching allocator's blocks.
        return self.attention(func, args, kwargs, out) + sum(_round(n) for n in composite_scratch(func, args))


cudnn_workspace = CudnnWorkspace()
"""The process's measurements: every dry run on this GPU measures through it."""


def cuda_workspace(spec: DeviceSpec) -> CudaWorkspace:
    """The workspace model of a dry run for the CUDA target ``spec``.

    Convolutions are measured when the dry run runs on the GPU ``spec`` describes (its driver name, or the table
    entry that name matches), and bounded otherwise: a target emulated on the CPU, or another GPU than this one.
    """
    here = False
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        here = spec.name in (name, driver_name_entry(name))
    return CudaWorkspace(attention_workspace_bytes, cudnn_workspace if here else None)
