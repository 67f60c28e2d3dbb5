"""The GPU suite's shared parts: the test models on a device, the real training step exactly as the dry run profiles
it, its memory from torch.cuda's allocator statistics, profiles by both paths, and exact comparisons.

Nothing here touches CUDA at import, so the suite collects (and skips) on a machine without a GPU.

How a measured step is put in the profile's terms. ``ModelProfile.peak_bytes`` is the highest total of live tensor
bytes during one training step, counting what exists when the step begins (parameters, buffers, optimizer state, the
batch and the tensors the loss closes over: each storage once, rounded up to the allocator's 512 bytes) and all that
the step allocates. ``torch.cuda.memory_allocated()`` at the start of the real step holds that too, plus what the
profile does not describe: cuBLAS's workspaces (allocated through the caching allocator on the first matmul of each
thread and kept), blocks the allocator handed out whole instead of splitting (up to 1 MiB more than asked), and
whatever earlier tests left alive. That difference is :attr:`StepRun.uncounted_bytes`; the step's peak in the
profile's terms is ``max_memory_allocated() - uncounted_bytes``: the counted start plus the highest net allocation
of the step.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from lightning_sac import ModelProfile, get_device_spec, profile_model
from lightning_sac.devices import DeviceSpec
from lightning_sac.dryrun.step import ComputeLoss, LossFn, model_inputs, model_loss
from lightning_sac.profiling import profile_step

__all__ = [
    "GIB",
    "MODELS",
    "SEED",
    "Case",
    "adamw",
    "build",
    "compute_loss",
    "device_bytes",
    "free_memory",
    "named_spec",
    "no_cuda",
    "optimizer_tensors",
    "profile_for",
]

GIB = 2**30
_ROUND = 512  # the CUDA caching allocator's rounding of every block
MODELS = ("gpt", "gpt2", "llama", "resnet")
SEED = 1234


@dataclass
class Case:
    """A model on a device, its batch as its users pass it, its loss, and the tensors that loss closes over.

    Attributes:
        closed_over: Tensors allocated before the step that the loss reads (targets): the dry run counts them as
            "other" from their first use, so the measurement counts them as existing at the step's start.
    """

    name: str
    model: nn.Module
    batch: tuple[Any, ...] | dict[str, Any]
    loss_fn: LossFn | None
    closed_over: list[torch.Tensor] = field(default_factory=list)


def _to(x: Any, device: str) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_to(v, device) for v in x)
    return x


def _gpt(device: str) -> Case:
    from lightning_sac.demos import GPT, GPTConfig

    # Attention and residual dropout: CUDA's fused dropout and SDPA's own dropout (philox seed and offset) run.
    config = GPTConfig(vocab_size=4096, block_size=512, n_layer=4, n_head=8, n_embd=512, dropout=0.1)
    torch.manual_seed(0)
    model = GPT(config).train()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, config.vocab_size, (8, 512), generator=g).to(device)
    targets = torch.randint(0, config.vocab_size, (8, 512), generator=g).to(device)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return Case("gpt", model.to(device), (idx,), loss, [targets])


def _hf(name: str, device: str) -> Case:
    import zoo

    family = zoo.gpt2() if name == "gpt2" else zoo.llama()
    # zoo's models with a batch 32x zoo's, so that activations (hundreds of MiB) and not the allocator's fixed
    # costs set the peak; the padded row makes the attention mask a real one (SDPA with a mask).
    batch = zoo.lm_batch(128, batch=128, seq=128)
    return Case(name, family.model.to(device), _to(batch, device), None)


def _resnet(device: str) -> Case:
    import zoo

    torch.manual_seed(0)
    model = zoo.ResNet().train()
    g = torch.Generator().manual_seed(1)
    images = torch.randn(512, 3, 32, 32, generator=g).to(device)
    labels = torch.randint(0, 10, (512,), generator=g).to(device)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, labels)

    return Case("resnet", model.to(device), (images,), loss, [labels])


def _wide_mlp(device: str) -> Case:
    # 64 MiB weights and a batch of 8: the activations are a few KiB, so the step's peak is AdamW's step, where the
    # GPU's foreach implementation holds the square roots of all of exp_avg_sq at once (384 MiB here).
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(6)))
    g = torch.Generator().manual_seed(1)
    return Case("wide_mlp", model.to(device), (torch.randn(8, 4096, generator=g).to(device),), _sum_loss)


def _sum_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def build(name: str, device: str) -> Case:
    """The model ``name`` (one of :data:`MODELS`, or ``"wide_mlp"``) with its batch and loss on ``device``."""
    if name == "wide_mlp":
        return _wide_mlp(device)
    if name == "gpt":
        return _gpt(device)
    if name in ("gpt2", "llama"):
        return _hf(name, device)
    if name == "resnet":
        return _resnet(device)
    raise ValueError(f"Unknown model {name!r}; expected one of {MODELS}.")


def adamw(params: Any) -> torch.optim.Optimizer:
    """The optimizer of every step, profiled and real: AdamW with torch's defaults (foreach on CUDA)."""
    return torch.optim.AdamW(params, lr=1e-3)


def compute_loss(case: Case, precision: str) -> ComputeLoss:
    """The forward and loss of the real step; bf16 as the dry run's ``autocast_dtype`` runs it (Lightning's
    ``bf16-mixed``: forward and loss under autocast without its weight-cast cache, backward outside)."""
    forward = model_loss(case.loss_fn)
    if precision == "fp32":
        return forward
    if precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)(forward)
    raise ValueError(f"Unknown precision {precision!r}; expected 'fp32' or 'bf16'.")


def device_bytes(tensors: list[torch.Tensor], device_type: str = "cuda") -> int:
    """Bytes the caching allocator holds for the distinct storages of ``tensors`` on ``device_type``."""
    sizes = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors if t.device.type == device_type}
    return sum(-(-n // _ROUND) * _ROUND for n in sizes.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


# ---------------------------------------------------------------------------------------------------- profiles


def named_spec() -> DeviceSpec:
    """The device table's entry for the visible GPU (``"H100-SXM"`` for an H100 SXM): what a CPU box plans for."""
    from lightning_sac.devices import driver_name_entry
    from lightning_sac.devices.table import FALLBACK_CUDA_ENTRY

    return get_device_spec(driver_name_entry(torch.cuda.get_device_name()) or FALLBACK_CUDA_ENTRY)


@contextlib.contextmanager
def no_cuda() -> Iterator[None]:
    """This process as a machine without a GPU sees itself: the dry run then emulates a CUDA target on the CPU."""
    with mock.patch.object(torch.cuda, "is_available", return_value=False):
        yield


_PROFILES: dict[tuple[str, str, str, tuple[bool, bool]], ModelProfile] = {}


def profile_for(name: str, precision: str, path: str) -> ModelProfile:
    """The profile of model ``name``'s step (cached per process).

    ``path="cuda"``: ``device="auto"``, the visible GPU, on fake CUDA tensors. ``path="emulated"``: the table's spec
    of this GPU by name, profiled as a machine without a GPU does it (fake CPU tensors and CUDA emulation), from a
    copy of the model and batch on the CPU. Profiled under the deterministic-algorithms mode in force, which picks
    some kernels (cuDNN attention is refused under it), as the real steps it is compared with must run under it too.
    """
    mode = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    key = (name, precision, path, mode)
    if key in _PROFILES:
        return _PROFILES[key]
    if path == "cuda":
        case, device, where = build(name, "cuda"), "auto", contextlib.nullcontext()
    elif path == "emulated":
        case, device, where = build(name, "cpu"), named_spec(), no_cuda()
    else:
        raise ValueError(f"Unknown path {path!r}; expected 'cuda' or 'emulated'.")
    with where:
        if precision == "fp32":
            profile = profile_model(
                case.model, case.batch, loss_fn=case.loss_fn, optimizer_factory=adamw, device=device
            )
        else:
            profile = profile_step(
                case.model,
                model_inputs(case.batch),
                model_loss(case.loss_fn),
                make_optimizer=lambda m: adamw(m.parameters()),
                device=device,
                autocast_dtype=torch.bfloat16,
            )
    del case
    free_memory()
    _PROFILES[key] = profile
    return profile


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
