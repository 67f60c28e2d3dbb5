"""Which kernel CUDA's ``scaled_dot_product_attention`` runs for a call, and what that kernel keeps.

On a GPU, ``F.scaled_dot_product_attention`` picks a kernel per call (``select_sdp_backend`` in
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``): it walks torch's priority order (by default flash,
memory-efficient, math, cuDNN; cuDNN first on SM 9.0 and 10.0, see :func:`priority_order`) and takes the first
backend the user has not disabled (``sdpa_kernel``, ``torch.backends.cuda.enable_*_sdp``) whose constraints the
call meets. The kernels keep very different tensors for
backward: flash and memory-efficient keep q, k, v, the output and a log-sum-exp (O(T) per head), the math path keeps
the T x T attention matrix, and in fp32 when q is half precision (``allowFP16BF16ReductionMathSDP`` is off by
default). A CUDA target profiled on fake CPU tensors therefore makes the same choice here, from the target's compute
capability (:attr:`~lightning_sac.devices.spec.DeviceSpec.compute_capability`) and torch's own switches, and runs that
kernel's aten op so that autograd saves what the GPU would.

The constraints checked are those of the dense (not nested) path: 4-D inputs; flash: no explicit mask, fp16/bf16,
head dims equal and at most 256, SM 8.0 or newer (SM 8.6/8.9 refuse training with head dim in (192, 224], or above
224 with dropout), causal only for square attention, grouped-query attention natively; memory-efficient: SM 5.0 or
newer, fp16/fp32 (and bf16 from SM 8.0), head dims divisible by the GEMM alignment (8 for half precision, 4 for fp32
from SM 8.0), equal head counts; cuDNN: fp16/bf16, head dims at most 128 and divisible by 8, SM 8.0 to 10.x, not
under ``torch.use_deterministic_algorithms(True)`` (Lightning's ``deterministic=True``) unless ``warn_only``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lightning_sac.devices import DeviceSpec

__all__ = [
    "CUDNN",
    "CUDNN_FIRST",
    "DEFAULT_ORDER",
    "EFFICIENT",
    "FLASH",
    "MATH",
    "attention_workspace_bytes",
    "choose_backend",
    "cuda_sdpa",
    "priority_order",
]

aten = torch.ops.aten

# torch's SDPBackend values, as torch._C._get_sdp_priority_order() reports them.
MATH, FLASH, EFFICIENT, CUDNN = 0, 1, 2, 3
_HALF = (torch.float16, torch.bfloat16)


def _heads_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> bool:
    # check_batch_size_and_num_heads_dense: equal batch sizes; equal heads, or q's a multiple of k's (= v's) with GQA.
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return False
    if q.shape[1] == k.shape[1] == v.shape[1]:
        return True
    return gqa and k.shape[1] == v.shape[1] and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0


def _dense_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    # check_tensor_shapes, check_nonzero_sequence_lengths_dense, check_last_dim_stride_equals_1_dense.
    four_d = q.dim() == k.dim() == v.dim() == 4
    return (
        four_d and q.shape[-2] > 0 and k.shape[-2] > 0 and all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in (q, k, v))
    )


def _grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _flash_ok(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, p: float, causal: bool, gqa: bool, sm: Any
) -> bool:
    d = q.shape[-1]
    if not torch.backends.cuda.flash_sdp_enabled() or mask is not None or not _dense_ok(q, k, v):
        return False
    if not (d == k.shape[-1] == v.shape[-1] and d <= 256) or q.dtype not in _HALF:
        return False
    if sm is not None:
        if sm < (8, 0):
            return False
        if (8, 6) <= sm <= (8, 9) and _grad(q, k, v) and (192 < d <= 224 or (d > 224 and p > 0.0)):
            return False
    if causal and q.shape[-2] != k.shape[-2]:
        return False
    # ROCm's flash kernels take no grouped-query attention.
    return _heads_ok(q, k, v, gqa and sm is not None)


def _efficient_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm: Any) -> bool:
    if not torch.backends.cuda.mem_efficient_sdp_enabled() or not _dense_ok(q, k, v):
        return False
    half = q.dtype in _HALF
    allowed = (torch.float16, torch.float32) + ((torch.bfloat16,) if sm is None or sm >= (8, 0) else ())
    if sm is not None and sm < (5, 0) or q.dtype not in allowed:
        return False
    # minimum_gemm_alignment: 4 from SM 8.0, at least 128 bits when tensor cores run (SM 8.0+, or half on SM 7.x).
    tensor_cores = sm is None or sm >= (8, 0) or (sm >= (7, 0) and half)
    alignment = max(4 if sm is None or sm >= (8, 0) else 1, (128 // (16 if half else 32)) if tensor_cores else 1)
    dq, dv = q.shape[-1], v.shape[-1]
    if not (dq == k.shape[-1] and dq > 0 and dv > 0 and dq % alignment == 0 and dv % alignment == 0):
        return False
    return _heads_ok(q, k, v, False)


def _cudnn_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm: Any) -> bool:
    if not torch.backends.cuda.cudnn_sdp_enabled() or sm is None or not (8, 0) <= sm < (11, 0):
        return False
    # check_cudnn_deterministic: cuDNN attention is refused under deterministic algorithms (warn_only lets it run).
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    if not _dense_ok(q, k, v) or q.dtype not in _HALF:
        return False
    dq, dv = q.shape[-1], v.shape[-1]
    # check_cudnn_tensor_shapes: head dims up to 256 on SM 9.0 (cuDNN >= 9.10), else 128; multiples of 8.
    limit = 256 if sm == (9, 0) else 128
    return dq <= limit and dv <= limit and dq % 8 == 0 and dv % 8 == 0 and q.shape[-2] > 1 and k.shape[-2] > 1


#: torch's default priority order of the SDPA backends, and the one ``check_prefer_cudnn_attention`` installs.
DEFAULT_ORDER = (FLASH, EFFICIENT, MATH, CUDNN)
CUDNN_FIRST = (CUDNN, FLASH, EFFICIENT, MATH)


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None:
        return None
    return value.strip().lower() not in ("0", "false", "off", "no", "")


def priority_order(spec: DeviceSpec) -> tuple[int, ...]:
    """The order CUDA's selection tries the backends in on ``spec``.

    ``check_prefer_cudnn_attention`` (``sdp_utils.cpp``) puts cuDNN first on SM 9.0 and 10.0 (H100, H200, B200)
    with the cuDNN torch's CUDA wheels ship (9.9 and later), unless ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is set (or,
    in torch 2.11 and older, ``TORCH_CUDNN_SDPA_PREFERRED=0``); it does so only over the default order, so an order
    the user set (``sdpa_kernel(..., set_priority=True)``) stands. This machine's torch reports the order it would
    use (``torch._C._get_sdp_priority_order``), which a CPU build never re-orders.
    """
    order = tuple(torch._C._get_sdp_priority_order())
    preferred = not _env_flag("TORCH_CUDNN_SDPA_DEPRIORITIZED") and _env_flag("TORCH_CUDNN_SDPA_PREFERRED") is not False
    if preferred and spec.compute_capability in ((9, 0), (10, 0)) and order[: len(DEFAULT_ORDER)] == DEFAULT_ORDER:
        return CUDNN_FIRST + order[len(DEFAULT_ORDER) :]
    return order


def choose_backend(
    spec: DeviceSpec,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> int:
    """The backend CUDA's ``select_sdp_backend`` picks for this call on ``spec`` (:data:`FLASH`, ...).

    Raises:
        RuntimeError: Every backend is disabled or refuses the call, as CUDA raises "No available kernel".
    """
    sm = spec.compute_capability
    for backend in priority_order(spec):
        if backend == FLASH and _flash_ok(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, sm):
            return FLASH
        if backend == EFFICIENT and _efficient_ok(query, key, value, sm):
            return EFFICIENT
        if backend == MATH and torch.backends.cuda.math_sdp_enabled():
            return MATH
        if backend == CUDNN and _cudnn_ok(query, key, value, sm):
            return CUDNN
    raise RuntimeError(
        f"No available kernel for scaled_dot_product_attention on {spec.name}: query {tuple(query.shape)} "
        f"{query.dtype}, mask {'given' if attn_mask is not None else 'none'}; every backend enabled "
        "(torch.nn.attention.sdpa_kernel) refuses this call, as CUDA would. Enable the math backend."
    )


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # convert_boolean_attn_mask: True takes part; the kernels take an additive bias. The same ops as ATen's
    # (torch >= 2.6: ``at::where(mask, 0.0, at::scalar_tensor(-inf))``, two scalar_tensor calls and a where), so that
    # a plan made from this profile meets the GPU's op sequence; the value of cuDNN's variant differs, not its ops.
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, 0.0, torch.scalar_tensor(float("-inf"), dtype=dtype, device=mask.device))


def _efficient_bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # preprocess_mask: expanded to 4-D; a last dim not a multiple of 16 is padded (a copy) and sliced back, and a
    # bias whose strides are not multiples of 16 is made contiguous.
    bias = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if bias.shape[-1] % 16:
        pad = 16 - bias.shape[-1] % 16
        return torch.nn.functional.pad(bias, (0, pad))[..., : bias.shape[-1]]
    if any(s % 16 for s in bias.stride()[:3]):
        return bias.contiguous()
    return bias


def cuda_sdpa(
    spec: DeviceSpec,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` through the aten op of the kernel :func:`choose_backend` picks."""
    backend = choose_backend(spec, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if backend == FLASH:
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    needs_lse = _grad(query, key, value)
    if backend == CUDNN:
        bias = _additive(attn_mask, query.dtype)
        return aten._scaled_dot_product_cudnn_attention(
            query, key, value, bias, needs_lse, dropout_p, is_causal, False, scale=scale
        )[0]
    if backend == EFFICIENT:
        bias = _additive(attn_mask, query.dtype)
        bias = None if bias is None else _efficient_bias(bias, query, key)
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, needs_lse, dropout_p, is_causal, scale=scale
        )[0]
    return aten._scaled_dot_product_attention_math(
        query,
        key,
        value,
        _additive(attn_mask, query.dtype),
        dropout_p,
        is_causal,
        None,
        scale=scale,
        enable_gqa=enable_gqa,
    )[0]


def _round(x: int, m: int) -> int:
    return -(-x // m) * m


def attention_workspace_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any = None) -> int:
    """Bytes a CUDA attention kernel allocates and frees inside one call, invisible to fake tensors.

    Flash attention's backward (``mha_bwd`` of FlashAttention-2 in torch) holds ``softmax_d``, fp32 of
    (batch, heads, seq_q rounded to 128), and ``dq_accum``, fp32 of (batch, seq_q rounded to 128, heads, head dim
    rounded to 32, or 64 above 128); with grouped-query attention also dK and dV expanded to every query head, in the
    input's dtype. The memory-efficient backward accumulates dQ in fp32 when its inputs are half precision.
    """
    if func is aten._scaled_dot_product_flash_attention_backward.default:
        q, k = args[1], args[2]
        b, h, sq, d = q.shape
        sk = k.shape[2]
        workspace = b * h * _round(sq, 128) * 4
        workspace += b * _round(sq, 128) * h * _round(d, 32 if d <= 128 else 64) * 4
        if k.shape[1] != h:
            workspace += 2 * b * sk * h * d * q.element_size()
        return int(workspace)
    if func is aten._scaled_dot_product_efficient_attention_backward.default:
        q = args[1]
        return int(q.numel() * 4) if q.dtype in _HALF else 0
    return 0
