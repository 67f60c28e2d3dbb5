"""Planning for a GPU on a CPU machine: attention and dropout as CUDA runs them, allocator rounding."""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_sac import profile_model
from lightning_sac.demos import CausalSelfAttention, GPTConfig

B, H, T, C = 2, 4, 256, 128
CFG = GPTConfig(n_layer=1, n_head=H, n_embd=C, block_size=T, dropout=0.1)


class Wrapped(nn.Module):
    """The attention block under a root, so that it is a non-leaf module with op stats."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(CFG)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


def _profile(device: str):
    torch.manual_seed(0)
    x = torch.randn(B, T, C, requires_grad=True)
    return profile_model(Wrapped(), (x,), device=device)


def r512(n: int) -> int:
    return math.ceil(n / 512) * 512


def test_cuda_target_attention_with_dropout_holds_no_txt_tensor():
    p = _profile("H100-SXM")
    attn = p.modules["attn"]
    txt = B * H * T * T * 4
    assert max(attn.op_stats.memory) < txt
    assert "aten._scaled_dot_product_efficient_attention.default" in attn.op_stats.func_names
    # What the block leaves alive for backward, by hand: the qkv projection (viewed as q, k, v), the
    # attention output, its log-sum-exp (rows padded to 32) and two philox RNG scalars, and the dropout's
    # output and one-byte mask. The projection before dropout is not saved, so it is freed.
    expected = (
        r512(B * T * 3 * C * 4)
        + r512(B * T * C * 4)
        + r512(B * H * math.ceil(T / 32) * 32 * 4)
        + 2 * 512
        + r512(B * T * C * 4)
        + r512(B * T * C)
    )
    assert attn.activation_bytes == expected
    assert expected < txt


def test_cpu_target_attention_with_dropout_keeps_the_txt_matrix():
    p = _profile("cpu")
    attn = p.modules["attn"]
    txt = B * H * T * T * 4
    # CPU attention with dropout takes the math path: softmax output and dropout result are T x T each.
    assert sorted(attn.op_stats.memory, reverse=True)[:2] == [txt, txt]
    assert attn.activation_bytes > 2 * txt
    assert _profile("H100-SXM").modules["attn"].activation_bytes < attn.activation_bytes / 3


def test_cuda_target_dropout_mask_is_one_byte_per_element():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5))
    root = nn.Sequential(model)
    p = profile_model(root, (torch.randn(32, 64),), device="A100-40GB")
    stats = p.modules["0"].op_stats
    i = stats.func_names.index("aten.native_dropout.default")
    assert stats.memory[i] == r512(32 * 64 * 4) + r512(32 * 64)
    assert i in stats.rand_ops
