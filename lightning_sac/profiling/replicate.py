"""The dry run of a deep model of identical layers from dry runs of a few of them.

A decoder's layers are one module class with the same shapes: their records in a dry run are the same but for
where they lie and what the layers before and after hold. So a model of ``n`` such layers is dry-run with the first
4, 5 and 6 of them in its layer list (for the time of each run only; the model is given back as it was), the
profile of ``4 + (n - 4)`` layers is built from the first two (:func:`~lightning_sac.profiling.profile_items.
extend_profile`), and trusted only when the same construction from them gives the 6-layer run's profile exactly
(every byte, index and name; milliseconds to 1e-9): otherwise the whole model is dry-run. The 80-layer 70B-class
decoder dry-runs in a fraction of the time (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lightning_sac.dryrun import DryRun, ModelProfile, TensorSpec
from lightning_sac.profiling.extend import NotExtensible
from lightning_sac.profiling.profile_items import extend_profile, unsupported

__all__ = ["MIN_LAYERS", "RUN_LAYERS", "repeated_layers", "replicated_dry_run"]

log = logging.getLogger(__name__)

#: The layer counts of the dry runs: the extension is made from the first two and checked against the third.
RUN_LAYERS = (4, 5, 6)
#: A model's layer list is replicated from that many layers on: below it, the three short runs cost about as much as the
#: whole one (a layer is as many ops at any width; the 70B-class shape breaks even near 26 layers).
MIN_LAYERS = 32


def _plain(module: nn.Module) -> dict[tuple[str, str], object]:
    """Every plain attribute of ``module`` and its submodules, by (submodule name, attribute)."""
    return {
        (name, k): v
        for name, m in module.named_modules()
        for k, v in vars(m).items()
        if not k.startswith("_") and not isinstance(v, (torch.Tensor, nn.Module))
    }


def _signature(module: nn.Module, plain: dict[tuple[str, str], object], position: int) -> tuple[Any, ...]:
    """What makes two layers run the same ops: classes, hooks, tensors' shapes, and the plain attributes.

    A name with the layer's position in it (PEFT keeps ``target_name="model.layers.3.self_attn.q_proj"``) reads
    the same in every layer.
    """
    own = re.compile(rf"(?<=[A-Za-z_]\.){position}(?=\.)")  # in a name, not a version ("5.24.0")
    parts: list[Any] = [tuple(sorted((k, own.sub("#", repr(v))) for k, v in plain.items()))]
    for name, m in module.named_modules():
        hooks = len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        parts.append((name, type(m).__qualname__, hooks))
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        parts.append((name, tuple(t.shape), t.dtype, t.requires_grad, type(t).__qualname__))
    return tuple(parts)


def _identical(layers: nn.ModuleList) -> bool:
    """Whether the layers run the same ops: the same signature, once the layers' own positions are left out.

    An ``int`` attribute equal to the layer's position in every layer (Hugging Face's ``layer_idx``) is the only
    difference allowed; any other (an attention type, a sliding window) must be the same in every layer.
    """
    plains = [_plain(layer) for layer in layers]
    position = {k for k in plains[0] if all(type(p.get(k)) is int and p.get(k) == i for i, p in enumerate(plains))}
    first = _signature(layers[0], {k: v for k, v in plains[0].items() if k not in position}, 0)
    return all(
        _signature(layer, {k: v for k, v in p.items() if k not in position}, i) == first
        for i, (layer, p) in enumerate(zip(layers, plains, strict=True))
    )


def repeated_layers(model: nn.Module, min_layers: int | None = None) -> tuple[str, nn.ModuleList] | None:
    """The ``nn.ModuleList`` of the model with the most identical layers, or ``None``.

    Args:
        model: The model.
        min_layers: The fewest layers that count; :data:`MIN_LAYERS` by default.
    """
    min_layers = MIN_LAYERS if min_layers is None else min_layers
    best: tuple[str, nn.ModuleList] | None = None
    for fqn, m in model.named_modules():
        if type(m) is not nn.ModuleList or len(m) < max(min_layers, RUN_LAYERS[-1] + 1):
            continue
        if list(m._modules) != [str(i) for i in range(len(m))]:
            continue
        if _identical(m) and (best is None or len(m) > len(best[1])):
            best = (fqn, m)
    return best


@contextmanager
def _first_layers(layers: nn.ModuleList, k: int) -> Iterator[None]:
    """The model with only the first ``k`` of ``layers``, for the time of the block."""
    whole = layers._modules
    layers._modules = {str(i): whole[str(i)] for i in range(k)}
    try:
        yield
    finally:
        layers._modules = whole


def replicated_dry_run(model: nn.Module, run: Callable[[], DryRun]) -> DryRun | None:
    """``run()`` of ``model``, made from runs with its first layers; ``None`` when that cannot be done exactly.

    ``None`` when the model has no long list of identical layers or the short runs do not extend: the caller then
    dry-runs the whole model.

    Args:
        model: The model (its layer list is shortened during each run and restored after).
        run: The dry run of the model as it is now.
    """
    found = repeated_layers(model)
    if found is None:
        return None
    fqn, layers = found
    n, k = len(layers), RUN_LAYERS[0]
    runs = []
    for count in RUN_LAYERS:
        try:
            with _first_layers(layers, count):
                runs.append(run())
        except Exception as e:  # noqa: BLE001 - a model that needs all its layers (it indexes them by count)
            # Not swallowed: the whole dry run follows, and raises again whatever is not about the layer count.
            log.info("dry-running all %d layers of %s: with %d of them the dry run raised %r", n, fqn, count, e)
            return None
        reason = unsupported(runs[-1].profile)
        if reason:  # known after the first short run: the whole dry run follows at once
            log.info("dry-running all %d layers of %s: %s", n, fqn or "the model", reason)
            return None
    for r, count in zip(runs, RUN_LAYERS, strict=True):
        calls = [_arguments(r.input_specs.get(f"{fqn}.{i}")) for i in range(count)]
        if any(c != calls[0] for c in calls):
            # The model passes its layers something of their own (a flag every few layers): a pattern that the
            # short runs cannot be trusted to show whole.
            log.info("dry-running all %d layers of %s: its layers are called with different arguments", n, fqn)
            return None
    try:
        if (runs[0].with_caches is None) != (runs[1].with_caches is None):
            raise NotExtensible("one short run switched KV caches off, the other not")
        # The steps with caches on (made once: the recorded runs are read into profiles only when needed).
        wa, wb = runs[0].with_caches, runs[1].with_caches
        cached = None if wa is None or wb is None else (wa(), wb())
        differences = _differences(_extended(runs[0], runs[1], cached, fqn, RUN_LAYERS[2] - k), runs[2].profile)
        if differences:
            raise NotExtensible(f"made from {k} and {k + 1} layers, the {k + 2}-layer profile differs: {differences}")
        profile = _extended(runs[0], runs[1], cached, fqn, n - k)
    except NotExtensible as e:
        log.info("dry-running all %d layers of %s: %s", n, fqn or "the model", e)
        return None
    log.info("the profile of %d layers of %s is extended from dry runs of %s of them", n, fqn, RUN_LAYERS)
    return DryRun(profile, {})


def _arguments(spec: Any) -> Any:
    """A layer's call as far as it must be the same in every layer: plain values, and tensors' shapes and dtypes.

    Whether an input requires grad may differ (the first layer's, after a frozen embedding): the records show it.
    """
    return tree_map(lambda x: (x.shape, x.dtype) if isinstance(x, TensorSpec) else x, spec)


def _extended(
    a: DryRun, b: DryRun, cached: tuple[ModelProfile, ModelProfile] | None, blocks: str, extra: int
) -> ModelProfile:
    """The profile of ``extra`` more layers than ``a``'s, and the peak with the model's KV caches on."""
    profile = extend_profile(a.profile, b.profile, blocks, extra)
    if cached is not None:
        # The step with caches on is another step: its peak is read from its own extended timeline.
        profile.kv_cache_peak = extend_profile(*cached, blocks, extra).peak_breakdown
    return profile


def _differences(x: ModelProfile, y: ModelProfile) -> list[str]:
    """Fields of two profiles that differ (bytes and indices exactly, milliseconds to 1e-9 relative)."""
    return [f.name for f in fields(ModelProfile) if not _close(getattr(x, f.name), getattr(y, f.name))]


def _close(x: object, y: object) -> bool:
    if isinstance(x, float) or isinstance(y, float):
        return (
            isinstance(x, (int, float))
            and isinstance(y, (int, float))
            and math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)
        )
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_close(v, y[k]) for k, v in x.items())
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_close(u, v) for u, v in zip(x, y, strict=True))
    if hasattr(x, "__dataclass_fields__") and type(x) is type(y):
        return all(_close(getattr(x, f), getattr(y, f)) for f in x.__dataclass_fields__)
    return x == y
