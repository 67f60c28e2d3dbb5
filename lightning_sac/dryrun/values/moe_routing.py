"""Mixture-of-experts routing in the dry run: the fixed total of rows, split evenly over the experts.

A top-k router chooses each token's experts from the router's weights, whose values the dry run does not have;
an experts layer that loops over the experts it was given (transformers' eager experts: ``nonzero`` of the
routing mask, ``torch.where(expert_mask[e])``, ``index_add_``) cannot run on a fake routing. But a dropless top-k
router always sends ``top_k x tokens`` rows through the experts in total, whatever the weights, and what an expert
keeps for backward is linear in its rows. So the dry run routes on a documented split of that fixed total, with
the real step's ops, and the profile is exact in sum:

* **The split.** Inside a mixture-of-experts block (the module that holds an experts module), a ``topk`` of
  weight-derived scores returns real indices instead of unknown ones: slot ``j`` of row ``r`` picks
  ``(r * k + j) mod n`` of the ``n`` candidates. Each row gets ``k`` distinct experts (when ``k <= n``), and
  each expert ``top_k x tokens / num_experts`` rows, give or take one. The values ``topk`` returns (the routing
  weights) stay fake, with their gradients; only the indices are chosen. Everything the block derives from them
  (the routing mask, the experts it hits, the offsets of a grouped matmul) is real, and runs as in training.
* **Experts modules** are found as transformers 5 declares them (``@use_experts_implementation``): a module with
  an integer ``num_experts`` whose ``forward`` takes ``top_k_index``. Each call is recorded
  (:attr:`~lightning_sac.dryrun.data.ModelProfile.routing`): its experts, ``top_k``, tokens, rows per expert
  in the dry run, and whether its shapes followed the routing (an op with a data-dependent output shape ran in
  it: the eager experts' ``nonzero``). The grouped-mm experts' shapes do not (every tensor has all ``top_k x
  tokens`` rows, whatever the groups' sizes), so their profile is exact for any routing.
* **The bound.** With eager experts, a plan that keeps some of an expert's ops but not others' holds more when
  training routes more rows to the experts whose ops it keeps. An expert gets at most ``tokens`` rows (a token
  picks ``k`` distinct experts), ``num_experts / top_k`` times its even share, so what a plan keeps of such a
  layer is at most that factor times what it keeps on the even split: :func:`routing_bound_bytes` states the
  difference for a plan, and the plan table shows it.

Why not the router's own (unknown) choice with a made-up size per expert: a made-up size per call is as arbitrary
as the even split, but not exact in sum.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.hooks import RemovableHandle

__all__ = ["EvenRouting", "even_split", "is_experts", "routing_bound_bytes"]

aten = torch.ops.aten
_TOPK = aten.topk.default
# Ops whose output shape follows the values of their input: in an experts module, the routing's.
_VALUE_SHAPED = {
    aten.nonzero.default,
    aten.unique_consecutive.default,
    aten._unique2.default,
    aten.masked_select.default,
}


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module: an integer ``num_experts`` and a ``forward`` taking ``top_k_index``."""
    if not isinstance(getattr(module, "num_experts", None), int):
        return False
    try:
        return "top_k_index" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature (a builtin): not transformers' experts
        return False


def even_split(shape: tuple[int, ...], dim: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Indices of ``shape`` along ``dim``: slot ``j`` of row ``r`` (other dimensions flattened) is ``(r*k+j) % n``."""
    dim = dim % len(shape) if shape else 0
    moved = (*shape[:dim], *shape[dim + 1 :], shape[dim]) if shape else ()
    index = torch.arange(int(torch.Size(moved).numel()), dtype=torch.int64).remainder_(max(n, 1)).view(moved)
    return (index.movedim(-1, dim) if shape else index).to(dtype)


class EvenRouting(TorchDispatchMode):
    """Routes the dry run's mixture-of-experts blocks on the even split (module docstring). Enter it around the step.

    Sits below the recorder and above the real values' mode, so that the recorder counts the real indices as
    ``topk``'s output: they are allocated, saved and freed as training's are.

    Args:
        model: The fake copy the dry run steps.

    Attributes:
        calls: One dict per call of an experts module, in order: ``module`` (fqn), ``experts``, ``top_k``, ``tokens``,
            ``rows_per_expert`` (list, the dry run's split; empty when the routing it got was not the split's)
            and ``rows_follow_routing`` (bool). JSON-safe.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []
        self._experts = {fqn: m for fqn, m in model.named_modules() if is_experts(m)}
        experts = {id(m) for m in self._experts.values()}
        # A mixture-of-experts block holds an experts module: its router's topk is the routing.
        self._blocks = {id(p) for p in model.modules() if any(id(c) in experts for c in p.children())}
        self._model = model
        self._open_blocks = 0
        self._open_experts: list[dict[str, Any]] = []
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> EvenRouting:
        if not self._experts:  # no mixture of experts: off the mode stack, so that no op pays for a dispatch here
            return self
        for m in self._model.modules():
            if id(m) in self._blocks:
                self._handles.append(m.register_forward_pre_hook(self._enter_block))
                self._handles.append(m.register_forward_hook(self._leave_block, always_call=True))
        for fqn, m in self._experts.items():
            self._handles.append(m.register_forward_pre_hook(self._enter_experts(fqn), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._leave_experts, always_call=True))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        if not self._experts:
            return
        super().__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _enter_block(self, module: nn.Module, args: Any) -> None:
        self._open_blocks += 1

    def _leave_block(self, module: nn.Module, args: Any, output: Any) -> None:
        self._open_blocks = max(0, self._open_blocks - 1)

    def _enter_experts(self, fqn: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
            index = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            experts = module.num_experts
            assert isinstance(experts, int)  # is_experts checked it
            call: dict[str, Any] = {
                "module": fqn,
                "experts": experts,
                "top_k": 0,
                "tokens": 0,
                "rows_per_expert": [],
                "rows_follow_routing": False,
            }
            if isinstance(index, torch.Tensor) and index.dim() > 0:
                call["top_k"], call["tokens"] = int(index.size(-1)), int(index.numel() // max(index.size(-1), 1))
                if not isinstance(index, FakeTensor) and index.device.type != "meta":
                    with _disable_current_modes():  # read outside the step: no op of it is recorded
                        counts = torch.bincount(index.flatten().long().cpu(), minlength=call["experts"])
                        call["rows_per_expert"] = counts[: call["experts"]].tolist()
            self.calls.append(call)
            self._open_experts.append(call)

        return hook

    def _leave_experts(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._open_experts:
            self._open_experts.pop()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Give a router's ``topk`` of weight-derived scores the even split's indices; run everything else as is."""
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _VALUE_SHAPED and self._open_experts:
            self._open_experts[-1]["rows_follow_routing"] = True
        if func is not _TOPK or not self._open_blocks or not isinstance(out[1], FakeTensor):
            return out
        values, fake_index = out
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        n = args[0].size(dim) if args[0].dim() else 1
        with _disable_current_modes():
            split = even_split(tuple(fake_index.shape), dim, n, fake_index.dtype)
            index = torch.empty_strided(tuple(fake_index.shape), tuple(fake_index.stride()), dtype=split.dtype)
            index.copy_(split)
        return values, index


def routing_bound_bytes(
    routing: list[dict[str, Any]], activation_bytes: Mapping[str, int], policies: Mapping[str, tuple[list[int], int]]
) -> int:
    """The most a plan's peak can exceed its prediction when training routes rows unevenly (module docstring).

    Args:
        routing: The profile's experts calls (:attr:`EvenRouting.calls`).
        activation_bytes: Per experts module fqn, what its forward keeps for backward on the even split.
        policies: Per planned module fqn, its op policy (1 = save, 0 = recompute) and the bytes it frees.

    Returns:
        ``(num_experts / top_k - 1)`` times what the plan keeps of each experts call whose shapes follow the routing
        and that lies in a planned module keeping some of its ops and recomputing others (what the experts module
        keeps on the even split, less what the plan frees when the plan is for the experts module itself); 0 when
        there is none. A plan that keeps all of a module's ops or none treats every expert alike, and the even split
        is then exact in sum.
    """
    total = 0.0
    for call in routing:
        if not call["rows_follow_routing"] or not call["top_k"]:
            continue
        fqn = call["module"]
        for planned, (policy, freed) in policies.items():
            inside = fqn == planned or fqn.startswith(planned + ".") or not planned
            if not inside or not 0 < sum(policy) < len(policy):
                continue
            kept = activation_bytes.get(fqn, 0) - (freed if planned == fqn else 0)
            # An expert gets at most every token once: tokens rows, num_experts / top_k times its even share.
            factor = min(call["experts"], call["tokens"] * call["top_k"]) / call["top_k"]
            total += max(factor - 1.0, 0.0) * max(kept, 0)
    return int(total)
