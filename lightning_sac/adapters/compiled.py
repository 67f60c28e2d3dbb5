"""Compiled models: the dry run profiles the module as written, and a plan goes where ``torch.compile`` traces.

Users compile in three ways, and each leaves the module as written reachable:

- ``self.model = torch.compile(model)`` (in ``__init__`` or ``configure_model``): an ``OptimizedModule`` whose
  ``_orig_mod`` is the model; its submodules' names start with ``model._orig_mod.``.
- ``model.compile()``: the module's ``_compiled_call_impl`` (``nn.Module.__getstate__`` drops it, so copies run
  uncompiled).
- ``trainer.fit(torch.compile(lightning_module))``: Lightning's ``from_compiled`` unwraps it and replaces the
  LightningModule's ``forward``, ``training_step`` and the other step methods by compiled functions of the
  *original* module, kept in ``_compiler_ctx`` (``lightning.pytorch.utilities.compile``).

The dry run copies the module and runs the copy on fake tensors. :func:`uncompiled` makes that copy run the code
as written: Lightning's compiled step methods would call the user's real module, not the copy, and a compiled
forward would have dynamo trace fake tensors into its caches. The plan is then applied to the module that compile
traces (:func:`traced_module`), so each wrapper runs inside the compiled graph, where dynamo turns its checkpoint
into a higher-order op whose policy AOT autograd asks (:mod:`lightning_sac.apply.traced`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch
from torch import nn

__all__ = ["compile_backends", "compiled_parts", "profiles_uncompiled", "traced_module", "uncompiled"]

#: The methods Lightning's ``from_compiled`` replaces by compiled ones (``lightning.pytorch.utilities.compile``).
_LIGHTNING_COMPILED = ("forward", "training_step", "validation_step", "test_step", "predict_step")

P = ParamSpec("P")
R = TypeVar("R")


def _optimized_module_type() -> type | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a build without dynamo: nothing can be compiled
        return None
    return OptimizedModule


def traced_module(module: nn.Module) -> nn.Module:
    """The module ``torch.compile`` traces for ``module``: an ``OptimizedModule``'s ``_orig_mod``, else itself."""
    optimized = _optimized_module_type()
    while optimized is not None and isinstance(module, optimized):
        module = module._modules["_orig_mod"]  # type: ignore[assignment]  # always a module
    return module


def compiled_parts(model: nn.Module) -> list[str]:
    """Where ``model`` is compiled, in words (empty when it is not): for messages and tests."""
    optimized = _optimized_module_type()
    parts = []
    if getattr(model, "_compiler_ctx", None) is not None:
        parts.append("the LightningModule (torch.compile(module) passed to fit)")
    for fqn, module in model.named_modules():
        if optimized is not None and isinstance(module, optimized):
            parts.append(f"{fqn or '<root>'} (torch.compile)")
        elif module.__dict__.get("_compiled_call_impl") is not None:
            parts.append(f"{fqn or '<root>'} (module.compile())")
    return parts


def _backend_name(ctx: Any) -> str:
    """The backend of a dynamo ``OptimizeContext``: ``"inductor"``, a registered backend's name, or its repr."""
    backend = ctx.callback
    # dynamo wraps the backend in its frame converters, each keeping the one inside.
    while (
        inner := getattr(backend, "_torchdynamo_orig_backend", None) or getattr(backend, "_inner_convert", None)
    ) is not None:
        backend = inner
    if isinstance(backend, torch._TorchCompileInductorWrapper):
        return "inductor"
    return str(getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None) or backend)


def compile_backends(model: nn.Module) -> list[str]:
    """The ``torch.compile`` backend of each part of ``model`` that is compiled (see :func:`compiled_parts`)."""
    optimized = _optimized_module_type()
    contexts = []
    ctx = getattr(model, "_compiler_ctx", None)
    if isinstance(ctx, dict) and ctx.get("dynamo_ctx") is not None:
        contexts.append(ctx["dynamo_ctx"])
    for module in model.modules():
        if optimized is not None and isinstance(module, optimized):
            contexts.append(module.dynamo_ctx)
        elif (impl := module.__dict__.get("_compiled_call_impl")) is not None:
            # module.compile() keeps torch.compile's function, whose closure holds its context.
            cells = [c.cell_contents for c in impl.__closure__ or ()]
            contexts.extend(c for c in cells if hasattr(c, "callback"))
    return [_backend_name(c) for c in contexts]


@contextmanager
def uncompiled(model: nn.Module) -> Iterator[None]:
    """While inside, ``model`` and copies made of it run as written, not compiled.

    Lightning's compiled step methods are taken off the module (and put back on exit), so that a copy runs its
    class's ``training_step`` on itself; ``torch.compiler.set_stance("force_eager")`` makes every compiled module
    and function run its original code. Nothing is compiled inside, and no compiled code is discarded.
    """
    ctx = getattr(model, "_compiler_ctx", None)
    methods: dict[str, Any] = {}
    if ctx is not None:
        methods = {name: model.__dict__.pop(name) for name in _LIGHTNING_COMPILED if name in model.__dict__}
        model.__dict__["_compiler_ctx"] = None
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        model.__dict__.update(methods)
        if ctx is not None:
            model.__dict__["_compiler_ctx"] = ctx


def profiles_uncompiled(
    fn: Callable[Concatenate[nn.Module, P], R],
) -> Callable[Concatenate[nn.Module, P], R]:
    """Decorate a function whose first argument is the model it profiles: it runs :func:`uncompiled`."""

    @functools.wraps(fn)
    def wrapper(model: nn.Module, *args: P.args, **kwargs: P.kwargs) -> R:
        with uncompiled(model):
            return fn(model, *args, **kwargs)

    return wrapper
