"""CUDA's autocast policy, applied to the fake CPU tensors a CUDA target is profiled on.

Autocast picks each op's dtype by a per-device table, and the CPU's is not CUDA's. Under ``bf16-mixed`` CUDA runs
``layer_norm``, ``softmax``, ``log_softmax``, ``sum``, ``pow``, ``exp`` and the losses in fp32 (a GPT-2 GELU's
``pow`` turns its whole chain into fp32 activations), while the CPU leaves them in their input's dtype and instead
casts ``cross_entropy``, ``cat`` and ``stack``. Profiling a GPU plan under CPU autocast would record the CPU's
dtypes, so for as long as :class:`CudaAutocastPolicy` is active, the CPU's autocast kernels follow CUDA's table:
the op lists of ``ATen/autocast_mode.h`` (``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``, ``AT_FORALL_PROMOTE``) and the
CUDA-only registrations of ``autocast_mode.cpp``, vendored here and checked against the ``AutocastCUDA`` kernels of
the installed torch by the tests. CPU-only entries fall through (no cast). The casts are the same ``_to_copy`` ops
autocast makes, recorded and saved for backward like the real ones.

Lightning runs autocast with ``cache_enabled=False``, so every use of a weight casts it again. A region the model
opens itself (``torch.autocast("cuda")`` caches by default) keeps each weight's cast until the outermost autocast
region exits, as ``cached_cast`` in ``autocast_mode.cpp`` does: the same cast tensor serves every use.

Written in the model, ``torch.autocast("cuda", ...)`` (and ``torch.amp.autocast``, ``torch.cuda.amp.autocast``)
would do nothing to the CPU tensors the target is profiled on (on a machine without CUDA it even disables itself);
while :class:`CudaAutocastRegions` is active it opens a CPU autocast region with the same dtype (CUDA's default,
float16, when none is given), enabled flag and cache setting, which :class:`CudaAutocastPolicy` runs by CUDA's table.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.library import Library, fallthrough_kernel

__all__ = ["CUDA_AUTOCAST_POLICY", "CudaAutocastPolicy", "CudaAutocastRegions", "KernelOverride"]

_LOWER = (
    "_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input "
    "conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm "
    "baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell "
    "rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention "
    "cudnn_convolution cudnn_convolution_transpose"  # registered for CUDA only, in autocast_mode.cpp
)
_FP32 = (
    "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar "
    "pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm.dim "
    "nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d "
    "hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss "
    "multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits "
    "dist pdist cdist renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d "
    "_upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d "
    "_upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa"
)
_FP32_SET_OPT_DTYPE = (
    "prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm linalg_matrix_norm "
    "linalg_matrix_norm.str_ord sum sum.dim_IntList"
)
_PROMOTE = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"
# fp32_append_dtype: the op is redispatched to its overload with a trailing dtype.
_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}

#: CUDA's autocast policy by aten op (``name`` or ``name.overload``): ``"lower"`` (the autocast dtype),
#: ``"fp32"``, ``"fp32_set_opt_dtype"``, ``"fp32_append_dtype"``, ``"promote"`` (the widest floating dtype among
#: the arguments) or ``"banned"`` (CUDA refuses the op under autocast).
CUDA_AUTOCAST_POLICY: dict[str, str] = {
    **dict.fromkeys(_LOWER.split(), "lower"),
    **dict.fromkeys(_FP32.split(), "fp32"),
    **dict.fromkeys(_FP32_SET_OPT_DTYPE.split(), "fp32_set_opt_dtype"),
    **dict.fromkeys(_APPEND_DTYPE, "fp32_append_dtype"),
    **dict.fromkeys(_PROMOTE.split(), "promote"),
    "binary_cross_entropy": "banned",
}

_KEY = "AutocastCPU"


def _op(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _eligible(t: Any) -> bool:
    # autocast's is_eligible: a floating tensor of the autocast device, not fp64.
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and t.device.type == "cpu"


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if _eligible(x) and x.dtype != dtype else x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def _cast_call(args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype) -> tuple[tuple[Any, ...], dict]:
    """Cast a call's arguments in the order autocast's C++ kernels do: last argument first.

    The kernels cast in a parameter pack expansion, ``F(cached_cast(dtype, args)...)``, which GCC (PyTorch's Linux
    builds) evaluates right to left: ``addmm(bias, x, w)`` casts ``w``, then ``x``, then ``bias``. The casts are ops
    a checkpoint policy counts, so their order must be CUDA's for a plan's op indices to match the run.
    """
    cast_kwargs = {k: _cast_lower(kwargs[k], dtype) for k in reversed(list(kwargs))}
    cast_args = [_cast_lower(a, dtype) for a in reversed(args)][::-1]
    return tuple(cast_args), {k: cast_kwargs[k] for k in kwargs}


def _widest(x: Any, dtype: torch.dtype) -> torch.dtype:
    if isinstance(x, torch.Tensor):
        return torch.promote_types(dtype, x.dtype) if _eligible(x) else dtype
    if isinstance(x, (list, tuple, dict)):
        for v in x.values() if isinstance(x, dict) else x:
            dtype = _widest(v, dtype)
    return dtype


_HALF_TO_FLOAT = {
    torch.ops.aten.softmax.int: torch.ops.aten._softmax.default,
    torch.ops.aten.log_softmax.int: torch.ops.aten._log_softmax.default,
}


def _cached(t: Any) -> bool:
    # What autocast's cache would hold: a cast of an fp32 leaf that requires grad (a weight) to the autocast dtype.
    return _eligible(t) and t.dtype == torch.float32 and t.requires_grad and t.is_leaf and not t._is_view()


# Weight casts kept while a caching autocast region is open, by the weight's id: (weight, its cast).
_CAST_CACHE: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _cast_lower(x: Any, dtype: torch.dtype) -> Any:
    # cached_cast: with the cache on, a weight's cast to the autocast dtype is made once and reused in the region.
    if not (torch.is_autocast_cache_enabled() and _cached(x) and dtype != torch.float32):
        return _cast(x, dtype)
    hit = _CAST_CACHE.get(id(x))
    if hit is not None and hit[0] is x:
        return hit[1]
    cast = x.to(dtype)
    _CAST_CACHE[id(x)] = (x, cast)
    return cast


def _clear_cast_cache() -> None:
    _CAST_CACHE.clear()


def _with_float_dtype(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fp32_set_opt_dtype``: an unset ``dtype`` argument becomes fp32 when the first argument is eligible."""
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor) or not _eligible(first):
        return op(*args, **kwargs)
    index = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")
    explicit = args[index] if index < len(args) else kwargs.get("dtype")
    if explicit is None and first.dtype == torch.float16 and op in _HALF_TO_FLOAT and isinstance(first, FakeTensor):
        # CUDA's softmax of fp16 into fp32 is one fused kernel (half_to_float): no fp32 copy of its input. The CPU
        # has no such kernel, so a real tensor (a value computed from the batch) takes the copy.
        return _HALF_TO_FLOAT[op](first, args[1], True)
    if explicit is not None:
        return op(*args, **kwargs)
    if index < len(args):
        args = (*args[:index], torch.float32, *args[index + 1 :])
    else:
        kwargs = {**kwargs, "dtype": torch.float32}
    return op(*args, **kwargs)


def _kernel(name: str, policy: str) -> Callable[..., Any]:
    op = _op(name)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
            lower = torch.get_autocast_dtype("cpu")
            if policy == "banned":
                raise RuntimeError(
                    f"aten::{name} is unsafe to autocast on CUDA, which refuses it under torch.autocast: use "
                    "binary_cross_entropy_with_logits (BCEWithLogitsLoss), as CUDA's error says."
                )
            if policy in ("lower", "fp32", "promote"):
                dtype = {"lower": lower, "fp32": torch.float32}.get(policy) or _widest((args, kwargs), lower)
                cast_args, cast_kwargs = _cast_call(args, kwargs, dtype)
                return op(*cast_args, **cast_kwargs)
            if policy == "fp32_append_dtype":
                if not _eligible(args[0]):
                    return op(*args, **kwargs)
                return _op(_APPEND_DTYPE[name])(*args, dtype=torch.float32, **kwargs)
            return _with_float_dtype(op, args, kwargs)

    return kernel


class KernelOverride:
    """While active, Python kernels replace some of the dispatcher's (the originals come back on exit).

    Subclasses say which in :meth:`register`, on the ``aten`` library it is given, or on another namespace's from
    :meth:`library`. torch warns that kernels are overridden: that is the point, and it lasts only until exit, so
    the warning is silenced. A registration that fails takes back the ones made before it: a later entry (the next
    profile) finds the dispatcher as torch left it.
    """

    def __init__(self) -> None:
        self._libs: dict[str, Library] = {}

    def register(self, lib: Library) -> None:
        """Register the replacement kernels on ``lib`` (``aten``'s)."""
        raise NotImplementedError

    def library(self, namespace: str) -> Library:
        """The ``IMPL`` library of ``namespace`` this override registers on (made on first use)."""
        if namespace not in self._libs:
            self._libs[namespace] = Library(namespace, "IMPL")
        return self._libs[namespace]

    def __enter__(self) -> KernelOverride:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.register(self.library("aten"))
        except BaseException:
            self._destroy()
            raise
        return self

    def _destroy(self) -> None:
        for lib in self._libs.values():
            lib._destroy()
        self._libs.clear()

    def __exit__(self, *exc: object) -> None:
        self._destroy()


class CudaAutocastPolicy(KernelOverride):
    """While active, ``torch.autocast("cpu")`` casts as CUDA autocast does (see the module docstring).

    Entering registers Python kernels for the ``AutocastCPU`` dispatch key; leaving removes them, which gives the
    CPU's own kernels back. The weight-cast cache is dropped where torch drops its own: when the outermost autocast
    region exits (``torch.clear_autocast_cache``).
    """

    def __enter__(self) -> CudaAutocastPolicy:
        super().__enter__()
        original = torch.clear_autocast_cache

        def clear() -> None:
            _clear_cast_cache()
            original()

        self._original_clear = original
        torch.clear_autocast_cache = clear
        return self

    def __exit__(self, *exc: object) -> None:
        torch.clear_autocast_cache = self._original_clear
        _clear_cast_cache()
        super().__exit__(*exc)

    def register(self, lib: Library) -> None:
        """CUDA's policy for the ops it lists; every other op the CPU's autocast casts falls through uncast.

        Other libraries' ops (torchvision's ``nms`` and ``roi_align``...) keep their own CPU autocast kernel when
        the library registers one for CUDA too (it casts alike on both), and fall through when it does not, as
        CUDA's autocast passes an op with no kernel of its own.
        """
        for name, policy in CUDA_AUTOCAST_POLICY.items():
            if hasattr(torch.ops.aten, name.partition(".")[0]):
                lib.impl(name, _kernel(name, policy), _KEY)
        on_cuda = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
        for qualified in sorted(torch._C._dispatch_get_registrations_for_dispatch_key(_KEY)):
            namespace, _, name = qualified.partition("::")
            if namespace == "aten":
                if name not in CUDA_AUTOCAST_POLICY:
                    lib.impl(name, fallthrough_kernel, _KEY)
            elif qualified not in on_cuda:
                self.library(namespace).impl(name, fallthrough_kernel, _KEY)


class CudaAutocastRegions:
    """While active, autocast regions the model opens for ``"cuda"`` autocast the fake CPU tensors instead.

    ``torch.autocast`` is one class (``torch.amp.autocast`` and the deprecated ``torch.cuda.amp.autocast`` construct
    it), so its ``__init__`` is wrapped for as long as the context is active: a ``"cuda"`` region becomes a
    ``"cpu"`` one with the same settings and CUDA's default dtype, and runs under :class:`CudaAutocastPolicy`. A
    region built before (``@torch.autocast("cuda")`` on a function) was disabled by torch when it was built on a
    machine without CUDA, which also forgets whether it was asked to be enabled: entering one warns once per region.
    """

    def __enter__(self) -> CudaAutocastRegions:
        cls = torch.amp.autocast_mode.autocast
        original = cls.__init__
        cuda_default = torch.get_autocast_dtype("cuda")

        def __init__(
            region: Any,
            device_type: str,
            dtype: torch.dtype | None = None,
            enabled: bool = True,
            cache_enabled: bool | None = None,
        ) -> None:
            if device_type == "cuda":
                device_type, dtype = "cpu", cuda_default if dtype is None else dtype
            original(region, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

        enter = cls.__enter__

        def __enter__(region: Any) -> Any:
            if region.device == "cuda" and not getattr(region, "_lsac_warned", False):
                region._lsac_warned = True
                warnings.warn(
                    "lightning-sac: a torch.autocast('cuda') region built before profiling (a decorator, or an "
                    "instance made at import) cannot be read on a machine without CUDA: torch disabled it when it was "
                    "built, so whether it is enabled on the GPU is unknown, and it is profiled as disabled. Open it "
                    "inside forward (`with torch.autocast('cuda', ...)`) or plan on the GPU.",
                    UserWarning,
                    stacklevel=2,
                )
            return enter(region)

        self._cls, self._original, self._enter = cls, original, enter
        cls.__init__ = __init__  # type: ignore[method-assign, assignment]
        cls.__enter__ = __enter__  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self._cls.__init__ = self._original  # type: ignore[method-assign]
        self._cls.__enter__ = self._enter  # type: ignore[method-assign]
