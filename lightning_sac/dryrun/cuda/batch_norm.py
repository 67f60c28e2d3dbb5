"""BatchNorm as CUDA runs it, for a CUDA target emulated on fake CPU tensors.

``torch.batch_norm`` goes through ``aten._batch_norm_impl_index``, whose composite kernel picks the backend by the
input's device (``aten/src/ATen/native/Normalization.cpp``): on an NVIDIA GPU, cuDNN's ``cudnn_batch_norm`` (and
``cudnn_batch_norm_backward``) when the call qualifies, otherwise ``native_batch_norm`` after an empty reserve. On
fake CPU tensors the CPU's choice is always the latter, so a plan made on a CPU for a GPU listed
``native_batch_norm`` where the GPU runs ``cudnn_batch_norm``: the planned module met another op at run time and
fell back (warned, values right, more recomputed than planned). While :class:`CudnnBatchNormEmulation` is active
the composite makes the GPU's choice, with the GPU's ops in the GPU's order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.library import Library

from lightning_sac.dryrun.cuda.autocast import KernelOverride
from lightning_sac.ops import suggested_format

__all__ = ["CUDNN_BN_MIN_EPSILON", "CudnnBatchNormEmulation", "cuda_batch_norm_impl_index", "uses_cudnn"]

aten = torch.ops.aten

#: cuDNN's least BatchNorm epsilon (``CUDNN_BN_MIN_EPSILON``); a smaller one runs the native kernel.
CUDNN_BN_MIN_EPSILON = 1e-5


def uses_cudnn(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    eps: float,
    cudnn_enabled: bool,
) -> bool:
    """Whether CUDA's ``_batch_norm_impl_index`` runs this call on cuDNN.

    The conditions of torch's current source: inputs of 3 or more dimensions only; releases that also ran 2-D
    inputs (``BatchNorm1d`` on ``(N, C)``) on cuDNN's per-activation mode differ for those.
    """
    if weight is None or bias is None or not cudnn_enabled or eps < CUDNN_BN_MIN_EPSILON:
        return False
    if torch.bfloat16 in (input.dtype, weight.dtype):
        return False
    if input.dtype == torch.float16 and weight.dtype != torch.float32:
        return False
    stats = running_mean is not None and running_var is not None
    if not stats and not (running_mean is None and running_var is None and training):
        return False
    if input.dim() < 3:
        return False
    return input.shape[0] <= (880801 if training else 65535)


def cuda_batch_norm_impl_index(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    cudnn_enabled: bool,
) -> tuple[Any, ...]:
    """``aten._batch_norm_impl_index`` as an NVIDIA GPU runs it: cuDNN's kernel when it qualifies, else native."""
    if uses_cudnn(input, weight, bias, running_mean, running_var, training, eps, cudnn_enabled):
        assert weight is not None and bias is not None  # uses_cudnn checked them
        out = aten.cudnn_batch_norm(
            input.contiguous(memory_format=suggested_format(input)),
            weight.contiguous(),
            bias.contiguous(),
            None if running_mean is None else running_mean.contiguous(),
            None if running_var is None else running_var.contiguous(),
            training,
            momentum,
            eps,
        )
        return (*out, 1)
    reserve = torch.empty((0,), dtype=torch.uint8, device=input.device)
    out = aten.native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    return (*out, reserve, 0)


class CudnnBatchNormEmulation(KernelOverride):
    """While active, ``aten._batch_norm_impl_index`` chooses as on an NVIDIA GPU (:func:`cuda_batch_norm_impl_index`).

    At the dispatcher, like the attention emulation, so that a model's own checkpoint recompute chooses the same.
    """

    def register(self, lib: Library) -> None:
        """CUDA's choice of BatchNorm kernel in place of the composite one."""
        lib.impl("_batch_norm_impl_index", cuda_batch_norm_impl_index, "CompositeImplicitAutograd")
