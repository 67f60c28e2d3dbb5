"""What users do today instead of a plan, applied to a model for ``vs_peers.py``: the peers it is measured against.

* full AC: every transformer block under ``torch.utils.checkpoint`` (non-reentrant), nothing of it saved;
* torchtitan's op-level SAC, per block: a selective policy that saves the outputs of matmuls and attention
  kernels and recomputes everything else, except that every second matmul of a block's forward is recomputed
  too (torchtitan's ``selective_ac_option="op"`` as it ships for Llama: ``aten.mm`` and the SDPA kernels in its
  save list, a per-forward matmul counter). Our demo's linear layers carry a bias, which runs ``aten.addmm``
  instead of ``aten.mm``: both count as matmuls here, or the policy would save nothing but attention;
* Hugging Face's ``gradient_checkpointing_enable()`` with its defaults, where the model has it.

Each is written here from what those projects document and do, not imported: torchtitan is not a dependency,
and its current version names tensors instead of counting matmuls. torchtitan's rule for one op is the package's
:func:`lightning_sac.solver.torchtitan_saves`, the same one our cost model prices that peer's plan with. Wrapping
sets an instance ``forward`` that calls the class's forward, so parameters and their names do not change.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_sac.solver import TITAN_MATMULS, torchtitan_saves

__all__ = ["full_ac", "hf_gradient_checkpointing", "titan_op_sac", "transformer_blocks"]


def transformer_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks a user would checkpoint: the children of the longest ``ModuleList`` of one module class."""
    best: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len({type(m) for m in module}) == 1 and len(module) > len(best):
            best = [(f"{name}.{i}", m) for i, m in enumerate(module)]
    if not best:
        raise ValueError(f"{type(model).__name__} has no ModuleList of identical blocks to checkpoint.")
    return best


def _wrap(module: nn.Module, context_fn: Callable[[], Any] | None) -> None:
    inner = type(module).forward.__get__(module)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        extra: dict[str, Any] = {} if context_fn is None else {"context_fn": context_fn}
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward


def full_ac(model: nn.Module) -> nn.Module:
    """Checkpoint every transformer block whole."""
    for _, block in transformer_blocks(model):
        _wrap(block, None)
    return model


def titan_op_sac(model: nn.Module) -> nn.Module:
    """torchtitan's op-level selective policy on every transformer block (see the module docstring)."""

    def contexts() -> tuple[Any, Any]:
        matmuls: Counter[str] = Counter()  # fresh per call of the block, as torchtitan's per-call counter

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            name = str(func)
            # Counted apart in forward and recompute, as torchtitan does: before torch 2.12 the recompute asks the
            # policy again, and one count through both would answer it otherwise than the forward.
            mode = "recompute" if getattr(ctx, "is_recompute", False) else "forward"
            matmuls[mode] += name in TITAN_MATMULS
            saves = torchtitan_saves(name, matmuls[mode])
            return CheckpointPolicy.MUST_SAVE if saves else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    for _, block in transformer_blocks(model):
        _wrap(block, contexts)
    return model


def hf_gradient_checkpointing(model: nn.Module) -> nn.Module | None:
    """Hugging Face's own checkpointing with its defaults; ``None`` for a model without it."""
    # transformers 5 names it activation_checkpointing_enable (the old name warns that it is deprecated).
    enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
        model, "gradient_checkpointing_enable", None
    )
    if enable is None or not getattr(model, "supports_gradient_checkpointing", False):
        return None
    enable()
    return model
