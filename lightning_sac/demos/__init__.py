"""Demo models for examples, tests and benchmarks: a nanoGPT-style GPT, an MLP and a small conv net.

Takes nothing from the pipeline; gives models the README's quick start trains. The Lightning module around the GPT
is :mod:`lightning_sac.demos.lightning` (it imports Lightning).
"""

from __future__ import annotations

from lightning_sac.demos.models import GPT, MLP, CausalSelfAttention, ConvNet, GPTConfig, TransformerBlock, gpt_example

__all__ = [
    "CausalSelfAttention",
    "ConvNet",
    "GPT",
    "GPTConfig",
    "MLP",
    "TransformerBlock",
    "gpt_example",
]
