"""torch's optimizers pick their implementation in the dry run as they do on the CUDA target: ``foreach``.

An optimizer left at ``foreach=None`` (every torch optimizer's default) asks
``torch.optim.optimizer._default_to_fused_or_foreach`` at each step, which takes the multi-tensor (``foreach``)
implementation when every tensor is a plain tensor (or a DTensor) on a device with foreach kernels: CUDA, not the
CPU. The dry run's tensors are fake (a ``FakeTensor`` is not among the plain types) and, without a GPU, on the CPU,
so the same optimizer would run its single-tensor loop there. The two differ in memory, not only in speed: AdamW's
foreach step takes the square root of every ``exp_avg_sq`` of a group at once (``torch._foreach_sqrt``), a
temporary as large as all of the group's parameters, where the loop holds one parameter's worth at a time. On a
model whose optimizer step is its peak (a large model fine-tuned on small batches) the loop under-predicts the
peak by nearly the size of the parameters. :func:`foreach_as_on_cuda` makes the optimizers' own decision see
what it sees on the target, so each optimizer runs the code the device will run, with its own exceptions (Adam
keeps the loop for a tensor learning rate that is not ``capturable``) and a user's explicit ``foreach`` or
``fused`` untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.optim.optimizer as torch_optimizer
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["foreach_as_on_cuda"]


@contextlib.contextmanager
def foreach_as_on_cuda(emulated: bool) -> Iterator[None]:
    """While open, torch's optimizers take ``foreach`` for fake tensors as they would for CUDA tensors.

    Args:
        emulated: The CUDA target is emulated on fake CPU tensors: the CPU counts as a device with foreach
            kernels too (the CPU has them, torch only does not default to them there).
    """
    # Both names are looked up in torch.optim.optimizer's namespace when an optimizer steps
    # (_default_to_fused_or_foreach), so replacing them there reaches every optimizer module that imported it.
    types = torch_optimizer._foreach_supported_types
    added = FakeTensor not in types
    devices = torch_optimizer._get_foreach_kernels_supported_devices
    if added:
        types.append(FakeTensor)
    if emulated:
        torch_optimizer._get_foreach_kernels_supported_devices = lambda: [*devices(), "cpu"]
    try:
        yield
    finally:
        torch_optimizer._get_foreach_kernels_supported_devices = devices
        if added:
            types.remove(FakeTensor)
