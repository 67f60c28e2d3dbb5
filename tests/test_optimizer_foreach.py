"""The dry run steps torch's optimizers with the implementation they take on the target device.

On a GPU, an optimizer left at ``foreach=None`` runs its multi-tensor implementation; on the CPU its single-tensor
loop. AdamW's two differ in the step's temporaries: the foreach step takes the square root of every
``exp_avg_sq`` at once (one temporary as large as all the parameters), the loop takes one parameter's square root
and divides it (two temporaries of one parameter's size, freed before the next). Byte counts are analytic: fp32
parameters, each storage rounded to the CUDA allocator's 512 bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_sac import profile_model
from lightning_sac.dryrun.cuda.optimizers import foreach_as_on_cuda


def _round512(n: int) -> int:
    return -(-n // 512) * 512


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 128), nn.ReLU(), nn.Linear(128, 64))


def _optimizer_temporary(device: str, **adamw: object) -> int:
    """The most temporary bytes alive during the recorded step's optimizer step."""
    profile = profile_model(
        _model(),
        (torch.randn(8, 256),),
        loss_fn=lambda out, *_: out.sum(),
        optimizer_factory=lambda ps: torch.optim.AdamW(ps, **adamw),
        device=device,
    )
    start = profile.timeline_phases().index("optimizer")
    return max(e.peak_after["temporary"] for e in profile.timeline[start:] if e.peak_after)


def test_cuda_target_steps_adamw_foreach_as_a_gpu_does() -> None:
    sizes = [_round512(p.numel() * 4) for p in _model().parameters()]
    # torch._foreach_sqrt(exp_avg_sqs): one temporary per parameter, all alive until the step ends.
    assert _optimizer_temporary("H100-SXM") == sum(sizes)
    # An explicit foreach=False keeps the loop: exp_avg_sq.sqrt() and its quotient, of the largest parameter.
    assert _optimizer_temporary("H100-SXM", foreach=False) == 2 * max(sizes)


def test_cpu_target_keeps_the_loop() -> None:
    largest = max(p.numel() * 4 for p in _model().parameters())
    assert _optimizer_temporary("cpu") == 2 * largest


def test_the_patch_is_undone() -> None:
    import torch.optim.optimizer as torch_optimizer

    types = list(torch_optimizer._foreach_supported_types)
    devices = torch_optimizer._get_foreach_kernels_supported_devices
    with foreach_as_on_cuda(emulated=True):
        assert "cpu" in torch_optimizer._get_foreach_kernels_supported_devices()
    assert torch_optimizer._foreach_supported_types == types
    assert torch_optimizer._get_foreach_kernels_supported_devices is devices
    assert "cpu" not in devices()


def test_a_sharded_step_divides_the_foreach_temporaries_by_the_world_size() -> None:
    # Under FSDP the optimizer steps the shards: the foreach step's temporaries, one per parameter in the unsharded
    # profile, are 1/world size of it on each rank, as its parameters, gradients and state are (the ceiling).
    from lightning_sac.solver import device_model
    from lightning_sac.solver.memory_model import device_bytes

    snapshot = {"parameter": 4000, "gradient": 4000, "optimizer_state": 8000, "temporary": 4001}
    assert device_bytes(snapshot, 4, "sharded", optimizer_step=True) == 1000 + 1000 + 2000 + 1001
    assert device_bytes(snapshot, 4, "sharded") == 1000 + 1000 + 2000 + 4001  # forward and backward: as profiled
    assert device_bytes(snapshot, 4, "replicated", optimizer_step=True) == 4000 + 4000 + 8000 + 4001
    profile = profile_model(
        _model(),
        (torch.randn(8, 256),),
        loss_fn=lambda out, *_: out.sum(),
        optimizer_factory=lambda ps: torch.optim.AdamW(ps),
        device="H100-SXM",
    )
    on_device = device_model(profile, 4, "sharded")
    start = profile.timeline_phases().index("optimizer")
    peak = profile.timeline[start].peak_after
    assert peak["temporary"] == sum(_round512(p.numel() * 4) for p in _model().parameters())
    assert on_device(start, peak) == device_bytes(peak, 4, "sharded", optimizer_step=True)
    assert on_device(start - 1, peak) == device_bytes(peak, 4, "sharded")  # the end of backward
