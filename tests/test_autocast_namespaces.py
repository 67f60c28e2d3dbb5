"""CUDA's autocast policy on fake CPU tensors, with other libraries' ops registered for autocast.

torchvision registers ``AutocastCPU`` (and ``AutocastCUDA``) kernels for ``nms`` and ``roi_align``. On a machine
with torchvision installed, every emulated profile failed to start: the policy registered its fall-throughs for
every ``AutocastCPU`` op on ``aten``'s library, which refuses another namespace's op, and the failed entry left the
kernels it had registered in place, so that every later profile failed too ("already a kernel registered").
Two ops in a namespace of this test stand for such a library, without installing it.
"""

from __future__ import annotations

import pytest
import torch

from lightning_sac.dryrun.cuda.autocast import CudaAutocastPolicy, KernelOverride

NS = "lsac_autocast_test"


def _to(dtype: torch.dtype):  # noqa: ANN202
    def kernel(x: torch.Tensor) -> torch.Tensor:
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
            return getattr(torch.ops, NS).cpu_only(x.to(dtype)) if dtype == torch.bfloat16 else x.to(dtype) * 1

    return kernel


@pytest.fixture(scope="module")
def library():  # noqa: ANN201
    lib = torch.library.Library(NS, "DEF")
    lib.define("cpu_only(Tensor x) -> Tensor")  # cast to bf16 by the CPU's autocast only
    lib.define("both(Tensor x) -> Tensor")  # cast to fp32 by the library's CPU and CUDA autocast alike
    lib.impl("cpu_only", lambda x: x * 1, "CPU")
    lib.impl("both", lambda x: x * 1, "CPU")
    lib.impl("cpu_only", _to(torch.bfloat16), "AutocastCPU")
    lib.impl("both", _to(torch.float32), "AutocastCPU")
    lib.impl("both", lambda x: x.float() * 1, "AutocastCUDA")
    yield getattr(torch.ops, NS)
    lib._destroy()


def _dtypes(ops) -> tuple[torch.dtype, torch.dtype]:  # noqa: ANN001
    x = torch.ones(4)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        return ops.cpu_only(x).dtype, ops.both(x.bfloat16()).dtype


def test_other_libraries_ops_follow_cuda_inside_the_policy_and_their_own_after(library):
    assert _dtypes(library) == (torch.bfloat16, torch.float32)
    with CudaAutocastPolicy():
        # cpu_only has no CUDA autocast kernel: CUDA runs it uncast. both keeps the library's own cast.
        assert _dtypes(library) == (torch.float32, torch.float32)
    assert _dtypes(library) == (torch.bfloat16, torch.float32)
    with CudaAutocastPolicy():  # entered again: the first exit took every registration back
        assert _dtypes(library) == (torch.float32, torch.float32)


class _FailsHalfway(KernelOverride):
    def register(self, lib: torch.library.Library) -> None:
        lib.impl("trace", torch.library.fallthrough_kernel, "AutocastCPU")
        raise RuntimeError("the second registration failed")


def test_a_registration_that_fails_takes_back_the_ones_before_it():
    with pytest.raises(RuntimeError, match="the second registration failed"), _FailsHalfway():
        pass
    x = torch.ones(3, 3).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        assert torch.trace(x).dtype == torch.float32  # the CPU's own autocast kernel again
    with CudaAutocastPolicy():  # it registers trace's fall-through itself: nothing was left behind
        pass
