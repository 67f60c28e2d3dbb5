"""What ``budget_gb`` bounds: all the device memory the training process holds, not only its tensors.

A budget is the memory of one device the process may use, what ``nvidia-smi`` shows for it: a plan made for
``budget_gb=80`` on an 80 GiB GPU must not run out of memory there. That is more than the peak of the step's
tensors, which the profile predicts and ``torch.cuda.max_memory_allocated()`` measures (less the cuBLAS workspaces
below). Besides them the device holds:

* the CUDA context (:attr:`~lightning_sac.devices.spec.DeviceSpec.context_bytes`): driver state and the loaded kernels,
  outside PyTorch's allocator;
* NCCL's buffers (:attr:`~lightning_sac.devices.spec.DeviceSpec.nccl_bytes`, one communicator) when the step runs on
  several processes, outside the allocator too;
* cuBLAS workspaces (:attr:`~lightning_sac.devices.spec.DeviceSpec.blas_workspace_bytes`) per handle and stream, taken
  from the allocator at the first matmul and kept: the forward runs on the main thread's handle and backward on
  autograd's device thread's, so two of them (both in ``max_memory_allocated``);
* the allocator's fragmentation: the caching allocator reserves whole segments and keeps them, so what it holds
  (``max_memory_reserved``) exceeds what tensors use. Its model (:mod:`lightning_sac.dryrun.cuda.allocator`)
  replays the dry run's allocations and frees as the plan changes them (:mod:`lightning_sac.plan.fragmentation`):
  the planned step's reserved peak less its tensors' peak, which the solver finds together with the plan, since
  each depends on the other (:func:`~lightning_sac.solver.solve_plan`).

The planner keeps the tensors' peak within ``budget - reserve``. The CPU target has no reserve: there the budget
bounds the tensors' peak, as torch.profiler's allocator events measure it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the profiling package imports the planner, which imports this module
    from lightning_sac.dryrun import ModelProfile

__all__ = ["DeviceReserve", "device_reserve"]

_MIB = 2**20


@dataclass(frozen=True)
class DeviceReserve:
    """Device memory a step holds besides its tensors, bytes (see the module docstring).

    Attributes:
        context_bytes: The CUDA context, outside the allocator.
        nccl_bytes: NCCL's buffers, outside the allocator (0 on one process).
        blas_workspace_bytes: The cuBLAS workspaces, in the allocator's allocated bytes.
        fragmentation_bytes: What the allocator reserves beyond its allocated bytes at the peak.
    """

    context_bytes: int = 0
    nccl_bytes: int = 0
    blas_workspace_bytes: int = 0
    fragmentation_bytes: int = 0

    @property
    def total(self) -> int:
        """All of it: the budget minus this bounds the tensors' peak."""
        return self.context_bytes + self.nccl_bytes + self.blas_workspace_bytes + self.fragmentation_bytes

    @property
    def outside_allocated(self) -> int:
        """What ``torch.cuda.max_memory_allocated()`` does not show: the budget minus this bounds it."""
        return self.context_bytes + self.nccl_bytes + self.fragmentation_bytes

    def describe(self) -> str:
        """One phrase naming the parts, in MiB, for messages (empty when there is no reserve)."""
        parts = [
            (self.context_bytes, "CUDA context"),
            (self.nccl_bytes, "NCCL buffers"),
            (self.blas_workspace_bytes, "cuBLAS workspaces"),
            (self.fragmentation_bytes, "allocator fragmentation"),
        ]
        named = [f"{nbytes / _MIB:.0f} MiB {what}" for nbytes, what in parts if nbytes]
        return ", ".join(named)

    def to_dict(self) -> dict[str, int]:
        """The four figures by field name."""
        return {
            "context_bytes": self.context_bytes,
            "nccl_bytes": self.nccl_bytes,
            "blas_workspace_bytes": self.blas_workspace_bytes,
            "fragmentation_bytes": self.fragmentation_bytes,
        }


def device_reserve(profile: ModelProfile, world_size: int = 1, fragmentation_bytes: int | None = None) -> DeviceReserve:
    """The reserve of a step profiled for ``profile.device`` on ``world_size`` processes.

    Args:
        profile: The step's profile; its device's figures and its allocator model's peaks are read.
        world_size: Processes the step runs on; NCCL's buffers count from two.
        fragmentation_bytes: The fragmentation of the step as planned
            (:class:`~lightning_sac.plan.fragmentation.StepFragmentation`); default the profiled step's, its
            allocator model's reserved peak less its tensors' peak.
    """
    spec = profile.device
    if not spec.is_cuda:
        return DeviceReserve()
    fragmentation = fragmentation_bytes
    if fragmentation is None:
        fragmentation = max(0, profile.reserved_peak_bytes - profile.peak_bytes) if profile.reserved_peak_bytes else 0
    return DeviceReserve(
        context_bytes=spec.context_bytes,
        nccl_bytes=spec.nccl_bytes if world_size > 1 else 0,
        blas_workspace_bytes=2 * spec.blas_workspace_bytes,
        fragmentation_bytes=fragmentation,
    )
