"""AutoSAC under Lightning's mixed precision: the dry run's peaks against every batch of real fits.

Lightning runs ``training_step`` under ``torch.autocast(cache_enabled=False)`` and backward and the optimizer
outside it, with fp32 weights, gradients and optimizer state. On CPU it runs ``16-mixed`` as ``bf16-mixed`` (fp16
autocast is CUDA-only; its accelerator connector says so and switches). A plan for a GPU made on this machine
runs the dry run under CUDA's autocast policy (``lightning_sac.dryrun.cuda.autocast``).
"""

from __future__ import annotations

import gc
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fit_harness import BatchPeaks
from test_callback import trainer
from test_callback_real_models import Batches, HFModule
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset
from zoo import gpt2, gpt2_gradient_checkpointing, llama

from lightning_sac import AutoSAC
from lightning_sac.dryrun.cpu.promotion import promotion_bytes
from lightning_sac.dryrun.cuda.autocast import CUDA_AUTOCAST_POLICY, CudaAutocastPolicy
from lightning_sac.dryrun.step import model_inputs, model_loss
from lightning_sac.profiling import profile_step

GIB = 2**30


class LMModule(HFModule):
    """A Hugging Face LM fine-tuning module whose data exists before ``fit`` begins."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        # BatchPeaks counts what is allocated after setup: a dataset built in train_dataloader would count as
        # step memory, which it is not.
        self.data = Batches()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=None)


class ResidualMLP(pl.LightningModule):
    """Wide residual blocks ``x + fc2(gelu(fc1(x)))``: under autocast an fp32 stream plus a bf16 branch."""

    def __init__(self, width: int = 256, tokens: int = 1024, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(depth)
        )
        self.head = nn.Linear(width, 16)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(4 * tokens, width, generator=g), torch.randint(0, 16, (4 * tokens,), generator=g)
        self.data = TensorDataset(x, y)  # before fit's setup, as in LMModule
        self.tokens = tokens
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        for block in self.blocks:
            x = x + block(x)
        return F.cross_entropy(self.head(x).float(), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.tokens)


def albert() -> nn.Module:
    """ALBERT: one transformer layer whose weights every layer of the stack reuses."""
    from transformers import AlbertConfig, AlbertForMaskedLM

    torch.manual_seed(0)
    config = AlbertConfig(
        vocab_size=128,
        embedding_size=32,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    return AlbertForMaskedLM(config).train()


MODULES = {
    "gpt2": lambda: LMModule(gpt2().model),
    "llama": lambda: LMModule(llama().model),
    "albert": lambda: LMModule(albert()),
    "residual_mlp": ResidualMLP,
}


def fit(name: str, tmp_path: Path, callbacks: list[Any], precision: str) -> tuple[Any, list[int], list[str]]:
    """A 3-step fit measured batch by batch; returns the module, the batch peaks and the warnings raised."""
    # The CPU allocator remembers the sizes of blocks allocated under any profiler, so an earlier fit's tensors
    # freed during this one would show up as negative events in this fit's profile.
    gc.collect()
    pl.seed_everything(0)
    module = MODULES[name]()
    peaks = BatchPeaks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([peaks, *callbacks], tmp_path, precision=precision, max_steps=3).fit(module)
    return module, peaks.peaks, [str(w.message) for w in caught]


@pytest.mark.parametrize(
    ("name", "precision"),
    [
        # GPT-2's own bf16 cell is in the matrix tier: llama's covers the fit's mixed precision here.
        pytest.param("gpt2", "bf16-mixed", marks=pytest.mark.slow),
        pytest.param("llama", "bf16-mixed", marks=pytest.mark.slow),  # about 7 s: the matrix tier
        # The same fit as bf16-mixed once Lightning switched (which the assertion below checks): the matrix tier.
        pytest.param("llama", "16-mixed", marks=pytest.mark.slow),
        # bf16 matmuls are slow on CPUs without bf16 units: about 40 s. Without the CPU's operand conversions in
        # the dry run, this plan measured 2.9% over its budget.
        pytest.param("residual_mlp", "bf16-mixed", marks=pytest.mark.slow),
    ],
)
def test_a_mixed_precision_fit_is_predicted_and_holds_its_budget(tmp_path, name, precision):
    plain, plain_peaks, said = fit(name, tmp_path, [], precision)
    if precision == "16-mixed":
        assert any("AMP with fp16 is not supported on CPU. Using `precision='bf16-mixed'`" in m for m in said)
    peak = max(plain_peaks)
    sac = AutoSAC(budget_gb=0.8 * peak / GIB, measure=False, log_figures=False)
    planned, planned_peaks, said = fit(name, tmp_path, [sac], precision)
    assert sac.profile is not None and sac.plan is not None and sac.plan.decisions
    # The dry run of the plain step, and of the planned one, against torch.profiler's allocator events.
    assert sac.profile.plain_peak_bytes == pytest.approx(peak, rel=0.02)
    assert sac.plan.predicted_peak_bytes == pytest.approx(max(planned_peaks), rel=0.02)
    assert all(p <= sac.plan.budget_bytes * 1.02 for p in planned_peaks), (planned_peaks, sac.plan.budget_bytes)
    # Every wrapped module ran the profiled ops, autocast's casts and their recompute included.
    assert not [m for m in said if "ran other ops than the profiled ones" in m]
    assert planned.losses == plain.losses and len(plain.losses) == 3
    for (fqn, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=fqn)


def test_weights_used_twice_are_cast_twice_as_lightning_runs_autocast(tmp_path):
    # Lightning's autocast has no weight-cast cache: each of ALBERT's three passes through its shared layer casts
    # the layer's weights again, and backward keeps every cast. With the cache on, the dry run made one cast per
    # weight and predicted this step 2.2% low.
    sac = AutoSAC(budget_gb=8.0, measure=False, log_figures=False)  # profiles, plans nothing
    _, peaks, _ = fit("albert", tmp_path, [sac], "bf16-mixed")
    assert sac.profile is not None
    # What is left is Lightning's own bookkeeping around the step (the logged loss, the closure's result): bytes.
    assert sac.profile.plain_peak_bytes == pytest.approx(max(peaks), rel=0.005)
    plugin = trainer([], tmp_path, precision="bf16-mixed").precision_plugin
    assert plugin.autocast_context_manager()._cache_enabled is False  # what the dry run follows


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.body(x))


def test_the_dry_run_casts_a_weight_at_each_use():
    x = torch.randn(8, 64, requires_grad=True)
    profile = profile_step(_Twice(), model_inputs((x,)), model_loss(), device="cpu", autocast_dtype=torch.bfloat16)
    stats = profile.modules[""].op_stats
    casts = [m for f, m in zip(stats.func_names, stats.memory, strict=True) if f == "aten._to_copy.default"]
    # Each use: the bias (64 x 2 bytes), the weight (64 x 64 x 2); the first also the fp32 input (8 x 64 x 2).
    assert casts == [128, 64 * 64 * 2, 8 * 64 * 2, 128, 64 * 64 * 2]


class _Measure(TorchDispatchMode):
    """Sums :func:`promotion_bytes` over the ops it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN201
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.total += promotion_bytes(func, args, kwargs, out)
        return out


N = 256 * 256
F32, BF16 = torch.randn(256, 256), torch.randn(256, 256).bfloat16()
I64, B = torch.ones(256, 256, dtype=torch.long), torch.ones(256, 256, dtype=torch.bool)
PROMOTIONS = {
    "fp32 + bf16": (lambda: F32 + BF16, 4 * N),
    "fp32 + bf16 row": (lambda: F32 + BF16[0], 4 * 256),
    "fp32 * bool mask": (lambda: F32 * B, 4 * N),
    "bf16 += fp32": (lambda: BF16.clone().add_(F32), 2 * 4 * N),  # the operand and a temporary output
    "fp32 == bf16": (lambda: F32 == BF16, 4 * N),
    "where(mask, fp32, bf16)": (lambda: torch.where(B, F32, BF16), 4 * N),
    "sqrt(int64)": (lambda: torch.sqrt(I64), 4 * N),
    "1.0 - int64 mask": (lambda: 1.0 - I64, 4 * N),
    "fp32 + fp32": (lambda: F32 + F32, 0),
    "masked_fill(fp32, bool mask)": (lambda: F32.masked_fill(B, 0.0), 0),
}


@pytest.mark.parametrize("case", sorted(PROMOTIONS))
def test_cpu_operand_conversions_are_what_the_cpu_allocator_sees(case):
    fn, expected = PROMOTIONS[case]
    fn()
    rule = _Measure()
    with rule:
        fn()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    # The copies are alive together at the op's peak and freed by its end. Python scalars wrapped into 0-dim
    # tensors (a few bytes) are left out of both.
    alive = peak = 0
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]" and abs(e.nbytes()) >= 1024:
            alive += e.nbytes()
            peak = max(peak, alive)
    assert alive == out.untyped_storage().nbytes()  # what is left is the result
    assert rule.total == expected
    assert peak - alive == expected


def test_the_cuda_policy_is_the_installed_torch_s():
    registered = torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
    # aten's own: other libraries (torchvision) register theirs too, which the policy leaves to them.
    assert set(CUDA_AUTOCAST_POLICY) == {r.removeprefix("aten::") for r in registered if r.startswith("aten::")}


def test_cpu_autocast_follows_cuda_s_policy_inside_the_emulation_and_its_own_after():
    x = torch.randn(8, 16).bfloat16()
    w = torch.randn(16, 16)

    def dtypes() -> list[torch.dtype]:
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            return [
                torch.softmax(x, -1).dtype,
                F.layer_norm(x, (16,)).dtype,
                torch.pow(x, 3).dtype,
                x.sum().dtype,
                torch.softmax(x, -1, dtype=torch.bfloat16).dtype,  # an explicit dtype stays
                (x.float() @ w).dtype,
                torch.trace(x).dtype,  # fp32 on CPU, not autocast on CUDA
            ]

    cuda = [torch.float32] * 4 + [torch.bfloat16, torch.bfloat16, torch.bfloat16]
    cpu = [torch.bfloat16] * 4 + [torch.bfloat16, torch.bfloat16, torch.float32]
    assert dtypes() == cpu
    with CudaAutocastPolicy():
        assert dtypes() == cuda
    assert dtypes() == cpu


def test_fp16_softmax_into_fp32_is_one_kernel_on_cuda():
    with FakeTensorMode(), CudaAutocastPolicy(), torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        x = torch.empty(4, 32, dtype=torch.float16)
        seen = _Names()
        with seen:
            y = torch.softmax(x, -1)
    assert y.dtype == torch.float32 and seen.names == ["aten._softmax.default"]


class _Names(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN201
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _gpt2_mlp(device: str) -> dict[str, int]:
    family = gpt2()
    profile = profile_step(
        family.model, model_inputs(family.batch), model_loss(), device=device, autocast_dtype=torch.bfloat16
    )
    stats = profile.modules["transformer.h.0.mlp"].op_stats
    return dict(zip(stats.func_names, stats.memory, strict=False))


def test_a_gpu_plan_runs_gpt2_s_gelu_in_fp32_as_cuda_autocast_does():
    # GPT-2's tanh GELU calls pow, which CUDA autocast runs in fp32 and the CPU's in bf16: on a GPU the MLP's
    # GELU chain is fp32, twice the CPU's bytes. 4 x 128 tokens x 256 hidden units.
    assert _gpt2_mlp("cpu")["aten.pow.Tensor_Scalar"] == 4 * 128 * 256 * 2
    assert _gpt2_mlp("H100-SXM")["aten.pow.Tensor_Scalar"] == 4 * 128 * 256 * 4


def test_the_emulated_casts_come_in_cuda_s_order():
    # Autocast's kernels cast their arguments last first (a parameter pack GCC evaluates right to left); a
    # checkpoint policy counts the casts, so the emulation must make them in that order too.
    def cast_sizes(device: str) -> list[int]:
        model = nn.Sequential(nn.Sequential(nn.Linear(64, 32)))
        x = torch.randn(8, 64)
        prof = profile_step(model, model_inputs((x,)), model_loss(), device=device, autocast_dtype=torch.bfloat16)
        stats = prof.modules["0"].op_stats
        return [m for f, m in zip(stats.func_names, stats.memory, strict=True) if f == "aten._to_copy.default"]

    cpu = cast_sizes("cpu")
    assert cpu == [32 * 2, 32 * 64 * 2, 8 * 64 * 2]  # bias, weight, input
    assert cast_sizes("H100-SXM") == [512, 32 * 64 * 2, 8 * 64 * 2]  # the same, rounded up to 512 bytes


@pytest.mark.parametrize(
    ("device", "kernel"),
    [("A100-80GB", "_scaled_dot_product_flash_attention"), ("H100-SXM", "_scaled_dot_product_cudnn_attention")],
)
def test_emulated_attention_casts_fp32_inputs_and_takes_the_fused_kernel(device, kernel):
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.norm(x)  # fp32 under CUDA autocast
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    x = torch.randn(2, 4, 128, 16)
    prof = profile_step(Attention(), model_inputs((x,)), model_loss(), device=device, autocast_dtype=torch.bfloat16)
    stats = prof.modules[""].op_stats
    assert f"aten.{kernel}.default" in stats.func_names  # cuDNN's first on SM 9.0, as torch orders them
    casts = [m for f, m in zip(stats.func_names, stats.memory, strict=True) if f == "aten._to_copy.default"]
    assert casts == [2 * 4 * 128 * 16 * 2] * 3  # q, k and v, each cast to bf16 as autocast casts them


def test_a_gpu_plan_of_a_model_that_checkpoints_itself_recomputes_with_cuda_s_kernels():
    # A checkpoint's recompute runs in backward, where torch function modes are off: the emulation replaces the
    # kernels at the dispatcher, so the recompute saves what the forward saved (a function mode made
    # torch.utils.checkpoint raise CheckpointError here: 30 tensors saved in recompute, 32 in forward).
    def peak(family: Any) -> Any:
        return profile_step(
            family.model, model_inputs(family.batch), model_loss(), device="H100-SXM", autocast_dtype=torch.bfloat16
        )

    own = peak(gpt2_gradient_checkpointing())
    assert own.checkpointed_modules
    assert own.peak_bytes < peak(gpt2()).peak_bytes
