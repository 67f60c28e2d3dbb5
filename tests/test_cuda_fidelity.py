"""CUDA fidelity on a machine without a GPU: a GPT block's activations against published formulas and hand counts.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.1): one
transformer layer stores ``s*b*h*(34 + 5*a*s/h)`` bytes of activations in 16-bit precision with dropout, and
``34*s*b*h`` when the attention core (the T x T scores, softmax, dropout) is not stored, as with flash attention.
``activation_bytes`` of the second block is what its forward adds: everything it saves plus its output, minus
nothing for its input (the first block's output, live before). The formula counts the block's input (saved by the
first layer norm) and not its output, which is the same size: so the two compare directly. What the formula leaves
out is small: the layer norms' fp32 mean and rstd (8 bytes per token each), flash's fp32 log-sum-exp and RNG state.
That is the 2% tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_sac import profile_model

H, A, S, B = 1024, 16, 1024, 8
SBH = S * B * H
KORTHIKANTI = SBH * (34 + 5 * A * S / H)
FLASH_FORMULA = 34 * SBH


class Attention(nn.Module):
    """GPT-2 style attention: explicit softmax(QK^T)V, or SDPA (default choice, or the math kernel forced)."""

    def __init__(self, how: str, fused_qkv: bool = True) -> None:
        super().__init__()
        self.how = how
        self.qkv = nn.Linear(H, 3 * H) if fused_qkv else None
        separate = (None, None, None) if fused_qkv else (nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H))
        self.q, self.k, self.v = separate
        self.proj = nn.Linear(H, H)
        self.attn_drop, self.resid_drop = nn.Dropout(0.1), nn.Dropout(0.1)
        self.register_buffer("causal", torch.ones(S, S, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        if self.qkv is not None:
            q, k, v = self.qkv(x).split(H, dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)  # type: ignore[misc]
        q, k, v = (z.view(b, t, A, c // A).transpose(1, 2) for z in (q, k, v))
        if self.how == "explicit":
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // A))
            att = self.attn_drop(F.softmax(att.masked_fill(~self.causal[:t, :t], float("-inf")), dim=-1))
            y = att @ v
        elif self.how == "math":
            with sdpa_kernel([SDPBackend.MATH]):
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class Block(nn.Module):
    def __init__(self, how: str, fused_qkv: bool = True) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.attn = Attention(how, fused_qkv)
        self.mlp = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, how: str, fused_qkv: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(how, fused_qkv) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def block_activation(device: str, how: str, fused_qkv: bool = True) -> int:
    with torch.device("meta"):
        model = GPT(how, fused_qkv).to(torch.bfloat16)
    x = torch.empty(B, S, H, dtype=torch.bfloat16, device="meta")
    return profile_model(model, (x,), device=device).modules["blocks.1"].activation_bytes


@pytest.mark.parametrize("device", ["A100-80GB", "H100-SXM"])
def test_explicit_attention_matches_korthikanti(device: str) -> None:
    assert block_activation(device, "explicit") == pytest.approx(KORTHIKANTI, rel=0.02)


@pytest.mark.parametrize("device", ["A100-80GB", "H100-SXM"])
def test_sdpa_runs_flash_and_matches_the_formula_without_the_attention_core(device: str) -> None:
    # bf16, no mask, head dim 64, square causal attention: CUDA picks flash attention on SM 8.0 and cuDNN's on SM 9.0,
    # which keeps the same q, k, v, output and fp32 statistics per row.
    assert block_activation(device, "sdpa") == pytest.approx(FLASH_FORMULA, rel=0.02)


@pytest.mark.parametrize("device", ["A100-80GB", "H100-SXM"])
def test_sdpa_forced_to_math_with_half_precision_reduction_matches_korthikanti(device: str) -> None:
    # The formula's kernel keeps Q, K and V and the 16-bit scores. torch's math kernel does that when half-precision
    # reduction is allowed; it scales q and k into new tensors (the originals die), so with separate q, k, v
    # projections it keeps exactly 6*sbh of them, as the formula.
    previous = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        got = block_activation(device, "math", fused_qkv=False)
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(previous)
    assert got == pytest.approx(KORTHIKANTI, rel=0.02)


@pytest.mark.parametrize("device", ["A100-80GB", "H100-SXM"])
def test_sdpa_forced_to_math_keeps_the_fp32_core_torch_computes_by_default(device: str) -> None:
    # By default (allowFP16BF16ReductionMathSDP off) the math kernel upcasts q, k, v to fp32: it keeps scaled q and
    # k and v in fp32 (12*sbh instead of the formula's 6), the fp32 softmax output and the fp32 dropout output
    # (4 + 4 bytes per score) and the one-byte dropout mask: 34 - 6 + 12 = 40*sbh and 9*a*s^2*b.
    assert block_activation(device, "math") == pytest.approx(SBH * (40 + 9 * A * S / H), rel=0.02)


def test_a_gpu_without_flash_attention_runs_the_math_kernel() -> None:
    # V100 is SM 7.0: no flash (SM 8.0+), and the memory-efficient kernel takes no bf16 below SM 8.0.
    assert block_activation("V100", "sdpa") == pytest.approx(SBH * (40 + 9 * A * S / H), rel=0.02)


class CheckpointedGPT(GPT):
    def __init__(self, how: str) -> None:
        super().__init__("sdpa")
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        def policy(ctx: object, op: object, *args: object, **kwargs: object) -> object:
            attention = (
                torch.ops.aten._scaled_dot_product_flash_attention.default,
                torch.ops.aten._scaled_dot_product_cudnn_attention.default,  # what SM 9.0 runs
            )
            keep = op == torch.ops.aten.mm.default or op in attention
            return (
                torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
                if keep
                else torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
            )

        for block in self.blocks:
            if self.how == "selective":
                context = lambda: create_selective_checkpoint_contexts(policy)  # noqa: E731
                x = checkpoint(block, x, use_reentrant=False, context_fn=context)
            else:
                x = checkpoint(block, x, use_reentrant=self.how == "reentrant")
        return x


@pytest.mark.parametrize("how", ["full", "reentrant", "selective"])
def test_pre_checkpointed_models_profile_for_a_gpu(how: str) -> None:
    with torch.device("meta"):
        model = CheckpointedGPT(how).to(torch.bfloat16)
    x = torch.empty(B, S, H, dtype=torch.bfloat16, device="meta", requires_grad=True)
    profile = profile_model(model, (x,), device="H100-SXM")
    got = profile.modules["blocks.1"].activation_bytes
    assert profile.checkpointed_modules == ["blocks.0", "blocks.1"]
    if how == "selective":
        # The block keeps what the policy saves: within the no-checkpoint figure, above the input alone.
        assert 2 * SBH < got < FLASH_FORMULA
    else:
        # A fully checkpointed block keeps nothing but its output, the next block's input: 2*sbh.
        assert got == pytest.approx(2 * SBH, rel=0.05)
