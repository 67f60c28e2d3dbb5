"""Small reference models for examples, tests and benchmarks.

Like ``lightning.pytorch.demos``, these ship with the package so that the README's example, the test suite
and the benchmarks profile the very same modules. Each model is plain PyTorch and builds on any device,
including ``torch.device("meta")`` for models too large to materialize.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "MLP", "CausalSelfAttention", "ConvNet", "TransformerBlock", "gpt_example"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a decoder-only transformer.

    Attributes:
        vocab_size: Number of token ids.
        block_size: Longest sequence the position embedding covers.
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block.
        n_embd: Model width; must be divisible by ``n_head``.
        dropout: Dropout probability for attention weights and residual branches.
        bias: Whether linear and layer-norm layers carry a bias.
    """

    vocab_size: int = 512
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.1
    bias: bool = True


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(
                f"n_embd must be divisible by n_head, got n_embd={config.n_embd} and n_head={config.n_head}."
            )
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over the sequence dimension of ``x`` (batch, time, channels)."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Two linear layers with a GELU between them, and dropout."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int | None = None, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_hidden)
        self.act = nn.GELU()
        self.out = nn.Linear(d_hidden, d_in if d_out is None else d_out)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the two layers."""
        return self.drop(self.out(self.act(self.fc(x))))


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: attention and MLP, each with a residual connection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config.n_embd, 4 * config.n_embd, dropout=config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply attention then MLP."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A small GPT: token and position embeddings, transformer blocks, final norm and LM head.

    ``forward(idx)`` returns logits of shape (batch, time, vocab). The LM head's weight is tied to the token
    embedding, as in GPT-2, so profiles must count it once.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's initialization: small weights keep the first logits, and so the first losses, sensible.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Map token ids (batch, time) to logits (batch, time, vocab)."""
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"Sequence length {t} exceeds block_size {self.config.block_size}.")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _conv_block(c_in: int, c_out: int, stride: int) -> nn.Sequential:
    # In-place ReLU after BatchNorm, as torchvision builds them: BatchNorm is never recomputed (it updates its
    # running statistics), and with the ReLU writing into its output, saving it costs nothing extra.
    conv = nn.Conv2d(c_in, c_out, 3, padding=1, stride=stride)
    return nn.Sequential(conv, nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class ConvNet(nn.Module):
    """A small image classifier: two conv-BN-ReLU blocks (in-place ReLU), pooling and a linear head."""

    def __init__(self, in_channels: int = 3, width: int = 16, n_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(_conv_block(in_channels, width, 1), _conv_block(width, 2 * width, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(2 * width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images (batch, channels, height, width) to class logits."""
        return self.head(torch.flatten(self.pool(self.features(x)), 1))


def gpt_example(
    n_layer: int = 12, n_embd: int = 768, n_head: int = 12, seq_len: int = 1024, batch_size: int = 8
) -> tuple[GPT, tuple[torch.Tensor], Any, Any]:
    """A GPT-2-small-sized model on the meta device, a token batch, its loss and AdamW: a factory for the CLI.

    ``lightning-sac plan lightning_sac.demos:gpt_example --budget-gb 20 --device A100-40GB``
    """
    config = GPTConfig(vocab_size=50304, block_size=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    with torch.device("meta"):
        model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    targets = torch.randint(0, config.vocab_size, (batch_size, seq_len))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def optimizer_factory(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=3e-4)

    return model, (idx,), loss_fn, optimizer_factory
