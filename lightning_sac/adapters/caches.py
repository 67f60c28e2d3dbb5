"""KV caches and checkpoints: in training, a model runs without its (empty) KV caches while a plan is applied.

A Hugging Face decoder layer called with ``use_cache=True`` writes its keys and values into a cache object
(``past_key_values.update(...)``). Recomputing the layer under a checkpoint runs that Python code again: the cache
is updated a second time, the recompute takes another path than the forward (T5's cross-attention reads what the
first call stored instead of computing it), and backward fails or, worse, gets other tensors. Hugging Face's own
``GradientCheckpointingLayer`` therefore sets ``use_cache=False`` and drops the cache in training, and says so
once. lightning-sac does the same: in training with gradients on, every module call gets ``use_cache=False`` (where
its forward takes it, so that a model does not create a cache) and an *empty* cache argument becomes ``None``. The
dry run profiles the model so, and a plan made from such a profile switches caches off in the same way for the
whole model while it is applied (:class:`CacheSwitch`), so that what runs is what was profiled, and tells the user
once. The loss does not change: an empty cache holds nothing a layer reads. Only what the model returns does (no
cache in training), which nobody reads in training.

A cache that already holds tokens for the module's layers (training on top of a cached prefix) is another matter:
dropping it would change the loss. Such a call is left as it is, and not checkpointed (the dry run marks the
module, the planner leaves it and every module around or inside it alone, and a planned module that meets one at
run time runs plainly and warns). "For the module's layers": Hugging Face caches hold every layer, and a module
reads the entries of the ``layer_idx`` of its attention modules, which earlier layers' updates do not touch.

A cache is recognised by its protocol, an ``update`` and a ``get_seq_length`` method (transformers' ``Cache``
classes, ``DynamicCache``, ``EncoderDecoderCache``...), not by its class, so no import of transformers is needed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["CacheCall", "CacheSwitch", "is_kv_cache", "layer_indices", "without_kv_caches"]


def is_kv_cache(x: Any) -> bool:
    """Whether ``x`` is a KV-cache object (an ``update`` and a ``get_seq_length`` method)."""
    if isinstance(x, (torch.Tensor, nn.Module, dict, list, tuple)) or x is None:
        return False
    return callable(getattr(x, "update", None)) and callable(getattr(x, "get_seq_length", None))


#: Per module class: where its forward takes ``use_cache`` (the positional index, -1 keyword-only, None not at all).
_USE_CACHE_AT: dict[type, int | None] = {}


def _use_cache_at(cls: type) -> int | None:
    if cls not in _USE_CACHE_AT:
        try:
            params = list(inspect.signature(cls.forward).parameters.values())[1:]  # type: ignore[attr-defined]
        except (TypeError, ValueError):  # a forward without an inspectable signature (a builtin): nothing to pass
            params = []
        at = next((i for i, p in enumerate(params) if p.name == "use_cache"), None)
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        _USE_CACHE_AT[cls] = at if at is None or params[at].kind in positional else -1
    return _USE_CACHE_AT[cls]


@dataclass
class CacheCall:
    """What :func:`without_kv_caches` did to one call.

    Attributes:
        args: The positional arguments to call with.
        kwargs: The keyword arguments to call with.
        switched_off: Names of what was switched off (``"use_cache"``, ``"past_key_values"``, ``"arg 2"``...).
        holds_tokens: Names of cache arguments that already hold tokens (left as they are).
        writes_cache: Outside training with gradients on (evaluation mode), names of the cache arguments the call
            writes (left as they are: what the model returns is the user's); a checkpoint must not rerun it.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    switched_off: list[str] = field(default_factory=list)
    holds_tokens: list[str] = field(default_factory=list)
    writes_cache: list[str] = field(default_factory=list)

    @property
    def unplanned(self) -> list[str]:
        """The cache arguments that make the call run as it is, without a checkpoint."""
        return self.holds_tokens or self.writes_cache


def layer_indices(module: nn.Module) -> tuple[int, ...]:
    """The ``layer_idx`` of the module and its descendants (Hugging Face attention modules carry one)."""
    found: set[int] = set()
    for m in module.modules():
        index = getattr(m, "layer_idx", None)
        if isinstance(index, int):
            found.add(index)
    return tuple(sorted(found))


def _holds_tokens(cache: Any, layers: tuple[int, ...]) -> bool:
    if not layers:
        return bool(cache.get_seq_length() > 0)
    return any(cache.get_seq_length(i) > 0 for i in layers)


def without_kv_caches(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], layers: tuple[int, ...] | None = None
) -> CacheCall:
    """The call of ``module`` as it runs in training under a plan: without an empty KV cache, ``use_cache=False``.

    Outside training (``module.training`` false or gradients off), and when a cache already holds tokens for the
    module's layers (:attr:`CacheCall.holds_tokens`), the call is returned unchanged; in evaluation mode with
    gradients on, :attr:`CacheCall.writes_cache` names its cache arguments.

    Args:
        module: The module called.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        layers: :func:`layer_indices` of the module, if known (computed otherwise).
    """
    call = CacheCall(args, dict(kwargs))
    if not torch.is_grad_enabled():
        return call
    named = [*((f"argument {i}", v) for i, v in enumerate(args)), *kwargs.items()]
    caches = {name: v for name, v in named if is_kv_cache(v)}
    if not module.training:
        # Evaluation with gradients on: the caches stay (what the model returns is the user's), and a call that
        # writes one must not run twice, as a checkpoint's recompute would run it.
        call.writes_cache = sorted(caches)
        return call
    if caches:
        layers = layer_indices(module) if layers is None else layers
        call.holds_tokens = [name for name, v in caches.items() if _holds_tokens(v, layers)]
        if call.holds_tokens:
            return call  # the caller runs such a call as it is, unplanned
    # use_cache is switched off when it was on, or left to a config that turns it on (Hugging Face's default).
    # A call that leaves it to a config that turns it off stays as it is: passing False instead of None can change
    # what the module passes on (T5 passes None to its decoder, whose own config copy turns caches on), and the
    # dry run must run the calls the plain step runs.
    # RecurrentGemma calls its layers with use_cache positionally: it is switched off where it was passed.
    at = _use_cache_at(type(module))
    positional = at is not None and 0 <= at < len(args) and "use_cache" not in kwargs
    values = list(args)
    if "use_cache" in kwargs or at is not None:
        value = values[at] if positional else kwargs.get("use_cache")  # type: ignore[index]
        if value is None:
            value = getattr(getattr(module, "config", None), "use_cache", True)
        if value is not False:
            call.switched_off.append("use_cache")
            if positional:
                values[at] = False  # type: ignore[index]
            else:
                call.kwargs["use_cache"] = False
    call.switched_off += sorted(caches)
    call.args = tuple(None if f"argument {i}" in caches else v for i, v in enumerate(values))
    call.kwargs.update(dict.fromkeys(caches.keys() & kwargs.keys()))
    return call


class CacheSwitch:
    """Applies :func:`without_kv_caches` to every module call of a model while entered.

    The dry run enters it on its copy; a plan made from a profile that switched caches off enters it on the
    user's model while applied.

    Args:
        model: The model.
        on_switch: Called with the fqn and the :class:`CacheCall` of each call it changed.

    Attributes:
        switched_off: Modules whose calls had ``use_cache`` or a cache switched off, in call order.
        holds_tokens: Modules called with a cache that already held tokens for their layers.
    """

    def __init__(self, model: nn.Module, on_switch: Callable[[str, CacheCall], None] | None = None) -> None:
        self.model = model
        self.on_switch = on_switch
        self.switched_off: list[str] = []
        self.holds_tokens: list[str] = []
        self._handles: list[RemovableHandle] = []

    def _hook(self, fqn: str, layers: tuple[int, ...]) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            call = without_kv_caches(module, args, kwargs, layers)
            if call.holds_tokens and fqn not in self.holds_tokens:
                self.holds_tokens.append(fqn)
            if call.switched_off:
                if fqn not in self.switched_off:
                    self.switched_off.append(fqn)
                if self.on_switch is not None:
                    self.on_switch(fqn, call)
            return call.args, call.kwargs

        return hook

    def __enter__(self) -> CacheSwitch:
        # prepend: the switched call is what every other hook (the recorder's) and the forward see.
        for fqn, module in self.model.named_modules():
            hook = self._hook(fqn, layer_indices(module))
            self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
