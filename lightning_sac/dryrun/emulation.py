"""Fake copies of the user's model and inputs, and emulation of a CUDA target on fake CPU tensors.

Fake CUDA tensors cannot run backward on a machine without a GPU, so a CUDA target is profiled on fake CPU
tensors. What differs by device is then put back: the allocator's rounding (in :mod:`memory`), throughput
and bandwidth (in :mod:`runtime`), and here the kernels whose saved tensors differ by device and, under mixed
precision, CUDA's autocast policy (:mod:`lightning_sac.dryrun.cuda.autocast`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.library import Library

from lightning_sac.devices import DeviceSpec
from lightning_sac.dryrun.cpu.kernels import reduced_loss_bytes, reduced_loss_scratch, rnn_layer_memory
from lightning_sac.dryrun.cpu.promotion import promotion_bytes
from lightning_sac.dryrun.cpu.scratch import kernel_scratch
from lightning_sac.dryrun.cuda.autocast import CudaAutocastPolicy, CudaAutocastRegions, KernelOverride
from lightning_sac.dryrun.cuda.batch_norm import CudnnBatchNormEmulation
from lightning_sac.dryrun.cuda.sdpa import cuda_sdpa
from lightning_sac.dryrun.modules.hooks import history_tensors
from lightning_sac.dryrun.values.real_values import REAL_LIMIT_BYTES
from lightning_sac.ops import composite_scratch
from lightning_sac.sharding import check_tensor_parallel, is_sharded, unsharded_memo

__all__ = ["CudaAttentionEmulation", "CudaEmulation", "cpu_output_bytes", "cpu_workspace_bytes", "fake_copy"]

aten = torch.ops.aten


def _fake_like(t: torch.Tensor, mode: FakeTensorMode, device: str) -> torch.Tensor:
    # empty_strided, not from_tensor: it works the same for real and meta tensors and never reads their data.
    with mode:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)


def _is_constant(b: torch.Tensor) -> bool:
    """Whether buffer ``b`` is a model constant the dry run may read: integer or boolean, with values, not too large."""
    return (
        not (b.is_floating_point() or b.is_complex())
        and b.device.type != "meta"
        and not isinstance(b, FakeTensor)
        and b.numel() * b.element_size() <= REAL_LIMIT_BYTES
    )


def _real_constant(b: torch.Tensor, device: str) -> torch.Tensor:
    # A copy: the dry run's step may write to it (BatchNorm counts its batches) and the user's buffer stays as is.
    # A convolution's stride and padding kept as int64 buffers (EnCodec, Mimi: F.pad by them), a counter, positions:
    # read on the host, they answer as in training, where a fake tensor's read is refused as weight-derived.
    return b.detach().to(device, copy=True)


def fake_copy(
    model: nn.Module,
    mode: FakeTensorMode,
    device: str,
    *,
    share: Iterable[object] = (),
    wrapper: nn.Module | None = None,
    constants: bool = False,
) -> nn.Module:
    """Deep-copy ``model`` with every parameter and buffer replaced by a fake tensor of the same metadata.

    No parameter data is read or copied, so a meta-device model of billions of parameters copies in
    seconds. Tied parameters stay tied. The user's model, its parameters and their ``.grad`` are untouched.
    A sharded model (FSDP2 or FSDP1) is copied unsharded: its modules as before sharding, its parameters of
    their global shapes (:mod:`lightning_sac.sharding.unsharded`); under tensor parallelism, of their shapes on
    one rank, without the TP styles' hooks.

    Args:
        model: The model to copy.
        mode: The fake mode the copies belong to.
        device: Device of the fake tensors (``"cpu"`` or ``"cuda"``).
        share: Objects the copy should reference rather than copy (e.g. a Lightning trainer).
        wrapper: An FSDP1 unit wrapping ``model`` itself (Lightning's ``trainer.strategy.model``), if any.
        constants: Copy integer and boolean buffers for real (:func:`_is_constant`), for a dry run that runs ops
            on real values (:class:`~lightning_sac.dryrun.values.real_values.RealValuesMode`).
    """
    memo: dict[int, Any] = {id(o): o for o in share}
    for b in model.buffers():
        memo[id(b)] = _real_constant(b, device) if constants and _is_constant(b) else _fake_like(b, mode, device)
    # State a forward with gradients left on a module (RecurrentGemma's recurrent_states after a step): torch
    # cannot deep-copy a tensor with a gradient history. The copy gets it without one, as the next step reads it.
    for m in model.modules():
        for _, t in history_tensors(m):
            if id(t) not in memo:
                memo[id(t)] = _fake_like(t.detach(), mode, device)
    # A TP style the per-rank copy does not reproduce is refused here, before anything runs, FSDP or not.
    tensor_parallel = check_tensor_parallel(model)
    if is_sharded(wrapper if wrapper is not None else model) or tensor_parallel:

        def make_fake(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
            with mode:
                return torch.empty(tuple(shape), dtype=dtype, device=device)

        unsharded_memo(model, wrapper, make_fake, memo)
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(_fake_like(p, mode, device), requires_grad=p.requires_grad)
    return copy.deepcopy(model, memo)


def _cuda_dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``aten.dropout`` as CUDA runs it: the fused kernel, which saves a one-byte mask per element.

    On CPU, ``aten.dropout`` decomposes into ``bernoulli_`` on a tensor of the input's dtype, which saves a
    four-byte mask per element for fp32; CUDA takes the fused ``native_dropout`` whenever ``0 < p < 1``
    (``is_fused_kernel_acceptable``), and otherwise does what the CPU does. The in-place variant decomposes on
    both devices, so it is left alone.
    """
    if train and 0.0 < p < 1.0 and input.numel() > 0:
        return aten.native_dropout(input, p, True)[0]
    if not train or p == 0.0 or input.numel() == 0:
        return input
    return input * input.new_zeros(())


class CudaAttentionEmulation(KernelOverride):
    """Route attention and dropout to the kernels CUDA runs on ``spec`` while profiling fake CPU tensors.

    Attention goes through the kernel CUDA's selection picks for each call (:mod:`~lightning_sac.dryrun.cuda.sdpa`:
    flash, memory-efficient, math or cuDNN, honouring ``sdpa_kernel``). The two ops' composite kernels are replaced
    at the dispatcher while the context is active (the CPU's come back on exit): unlike a torch function mode, which
    is off in a checkpoint's recompute during backward, the dispatcher also serves the recompute of a model that
    checkpoints itself, so that it saves what its forward saved.
    """

    def __init__(self, spec: DeviceSpec) -> None:
        super().__init__()
        self.spec = spec

    def register(self, lib: Library) -> None:
        """CUDA's attention and dropout kernels in place of the composite ones."""
        lib.impl("scaled_dot_product_attention", functools.partial(cuda_sdpa, self.spec), "CompositeImplicitAutograd")
        lib.impl("dropout", _cuda_dropout, "CompositeImplicitAutograd")


class CudaEmulation(contextlib.ExitStack):
    """A CUDA target on fake CPU tensors: CUDA's attention, dropout and BatchNorm kernels, CUDA's autocast policy.

    ``torch.autocast("cuda")`` regions in the model become CPU autocast regions under CUDA's policy
    (:class:`~lightning_sac.dryrun.cuda.autocast.CudaAutocastRegions`). See :class:`CudaAttentionEmulation` and
    :class:`~lightning_sac.dryrun.cuda.autocast.CudaAutocastPolicy`; for an NVIDIA target
    :class:`~lightning_sac.dryrun.cuda.batch_norm.CudnnBatchNormEmulation`.
    """

    def __init__(self, spec: DeviceSpec) -> None:
        super().__init__()
        self.spec = spec

    def __enter__(self) -> CudaEmulation:
        super().__enter__()
        try:
            self.enter_context(CudaAutocastPolicy())
            self.enter_context(CudaAutocastRegions())
            self.enter_context(CudaAttentionEmulation(self.spec))
            if self.spec.compute_capability is not None:  # NVIDIA: cuDNN's BatchNorm (AMD's MIOpen: not emulated)
                self.enter_context(CudnnBatchNormEmulation())
        except BaseException:
            self.close()  # give the CPU's kernels back: a failed enter gets no exit
            raise
        return self


_CTC_BACKWARD = (aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor)


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def cpu_workspace_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any = None) -> int:
    """Bytes a CPU kernel allocates and frees inside one call, invisible to fake tensors.

    Convolutions (forward and backward), batch and layer norm, resampling and pooling gradients hold scratch that
    depends on the kernel oneDNN picks for the shapes and layout (up to 5.3x a contiguous input, almost nothing
    for a channels-last one): measured on the kernel once per signature (:mod:`lightning_sac.dryrun.cpu.scratch`);
    on small conv nets it is the step's peak. oneDNN's LSTM layer forward and backward hold scratch buffers
    measured on the kernel (:mod:`lightning_sac.dryrun.cpu.kernels`). A pointwise op whose operands' dtypes
    differ (an fp32 residual plus a bf16 branch under autocast) converts them to the common dtype first
    (:mod:`lightning_sac.dryrun.cpu.promotion`). CTC's backward holds a tensor the size of the forward's
    ``log_alpha``. A composite's own scratch (:func:`~lightning_sac.ops.composite_scratch`) as it allocates it. A
    reduced MSE, smooth L1 or Huber loss an elementwise buffer of its input's size (``reduced_loss_scratch``).
    """
    scratch = kernel_scratch(func, args, kwargs, out)
    if scratch is not None:
        return scratch
    if func in _CTC_BACKWARD:
        # The CTC backward computes log_beta, shaped like the forward's log_alpha (its seventh argument), and frees
        # it on return (measured on torch 2.13's CPU kernel).
        return _nbytes(args[6])
    rnn = rnn_layer_memory(func, args, kwargs)
    if rnn is not None:
        return rnn.forward_scratch if func is aten.mkldnn_rnn_layer.default else rnn.backward_scratch
    composite = composite_scratch(func, args)
    if composite:
        return sum(composite)
    loss = reduced_loss_scratch(func, args, kwargs)
    if loss:
        return loss
    return promotion_bytes(func, args, kwargs, out)


def cpu_output_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, int]:
    """Bytes of the outputs whose fake kernel has another size than the CPU kernel, by output position.

    oneDNN's LSTM layer returns its training workspace, which backward reads, as its fourth output; the fake
    kernel returns it empty; a reduced MSE (and a few other losses) keeps its elementwise loss's storage (see
    :mod:`lightning_sac.dryrun.cpu.kernels`).
    """
    rnn = rnn_layer_memory(func, args, kwargs)
    if rnn is not None and func is aten.mkldnn_rnn_layer.default:
        return {3: rnn.workspace_bytes}
    loss = reduced_loss_bytes(func, args, kwargs)
    return {} if loss is None else {0: loss}
