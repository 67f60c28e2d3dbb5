"""Libraries that detect fake tensors on purpose must not send the dry run down another code path.

Some libraries ask "is this tensor fake?" to tell an export or compile trace from eager execution, and take a
trace-friendly path when it is: transformers' ``is_tracing(tensor)`` is true for a ``FakeTensor``, and its
attention-mask code then builds a full 4-D mask where the real step passes ``None`` and ``is_causal`` to
scaled-dot-product attention. The real step has no fake tensors, so while the dry run runs, those checks
answer as they will in training. Each entry here patches one library's check, only if the library is already
imported (nothing is imported for it), and restores it on exit.

Tested with transformers 5.23 (``transformers.utils.import_utils.is_fake_tensor``, which ``is_tracing`` calls).
Since the batch's values stay real in the dry run (:mod:`lightning_sac.dryrun.values.real_values`), the masks and
positions these checks usually look at are real anyway; this layer covers the rest (a mask too large to keep
real, a library asking about activations). A data-dependent decision on a value that is fake in the dry run
then raises a ``ProfilingError`` naming the op, instead of silently taking the tracing path.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from lightning_sac.errors import ProfilingError

__all__ = ["FAKE_TENSOR_CHECKS", "SUBCLASS_PATHS", "plain_tensor_paths", "real_step_answers", "same_type_conversions"]

#: ``(module, attribute)`` of each fake-tensor check answered ``False`` during the dry run.
FAKE_TENSOR_CHECKS: tuple[tuple[str, str], ...] = (("transformers.utils.import_utils", "is_fake_tensor"),)


def _not_fake(x: Any) -> bool:
    """The real step's answer to "is this a fake tensor?": never."""
    return False


def _ctc_loss_as_on_plain_tensors(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.ctc_loss`` as ATen runs it on plain tensors: with the lengths as int lists.

    ATen's ``ctc_loss`` reads tensor lengths into int lists (``aten._ctc_loss.default``) unless an argument is a
    tensor subclass, as the fake ``log_probs`` is; then it runs ``aten._ctc_loss.Tensor``, whose autograd node
    saves the two length tensors. Lengths from the batch are real in the dry run, so they are read as the real
    step reads them.
    """

    @functools.wraps(original)
    def ctc_loss(
        log_probs: Any, targets: Any, input_lengths: Any, target_lengths: Any, *args: Any, **kwargs: Any
    ) -> Any:
        lengths = (input_lengths, target_lengths)
        if all(isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) for x in lengths):
            input_lengths, target_lengths = input_lengths.tolist(), target_lengths.tolist()
        return original(log_probs, targets, input_lengths, target_lengths, *args, **kwargs)

    return ctc_loss


#: ``(module, attribute, replacement)`` of each torch function whose path depends on its arguments being tensor
#: subclasses: ``replacement(original)`` runs in its place during the dry run.
SUBCLASS_PATHS: tuple[tuple[str, str, Callable[[Callable[..., Any]], Callable[..., Any]]], ...] = (
    ("torch", "ctc_loss", _ctc_loss_as_on_plain_tensors),
)


@contextlib.contextmanager
def real_step_answers() -> Iterator[list[str]]:
    """Within the block, the libraries' fake-tensor checks of :data:`FAKE_TENSOR_CHECKS` answer ``False``.

    Yields the ``module.attribute`` names it patched (those whose module is imported).
    """
    patched: list[tuple[Any, str, Any]] = []
    try:
        for module_name, attribute in FAKE_TENSOR_CHECKS:
            module = sys.modules.get(module_name)
            if module is not None and hasattr(module, attribute):
                patched.append((module, attribute, getattr(module, attribute)))
                setattr(module, attribute, _not_fake)
        yield [f"{m.__name__}.{a}" for m, a, _ in patched]
    finally:
        for module, attribute, original in reversed(patched):
            setattr(module, attribute, original)


@contextlib.contextmanager
def plain_tensor_paths() -> Iterator[None]:
    """Within the block, the torch functions of :data:`SUBCLASS_PATHS` take the path they take on plain tensors."""
    patched: list[tuple[Any, str, Any]] = []
    try:
        for module_name, attribute, plain_path in SUBCLASS_PATHS:
            module = sys.modules[module_name]
            original = getattr(module, attribute)
            patched.append((module, attribute, original))
            setattr(module, attribute, plain_path(original))
        yield
    finally:
        for module, attribute, original in reversed(patched):
            setattr(module, attribute, original)


@contextlib.contextmanager
def same_type_conversions(model: nn.Module) -> Iterator[None]:
    """Within the block, a module conversion that changes none of its fake tensors leaves the module as it is.

    Hugging Face's routers (SwitchTransformers, NLLB-MoE) run ``self.classifier = self.classifier.to(self.dtype)``
    at every forward, a no-op once the dtype is right. On plain tensors ``Module._apply`` then sets each
    parameter's data to itself; on fake ones torch swaps every parameter for the converted one
    (``torch.utils.swap_tensors``), which fails on a tensor anything holds a weak reference to, as the fake mode
    does: ``RuntimeError: _apply(): Couldn't swap Linear.weight``. A conversion that would change a fake tensor
    is refused with a ProfilingError naming the module (its name in ``model``, the dry run's fake copy).
    """
    original = nn.Module._apply

    def _apply(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        modules = self.modules() if recurse else iter([self])
        tensors = [t for m in modules for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
        if not any(isinstance(t, FakeTensor) for t in tensors):
            return original(self, fn, recurse)
        with torch.no_grad():
            if all(fn(t) is t for t in tensors):
                return self  # what the plain tensors' path amounts to: each tensor set to itself
        try:
            return original(self, fn, recurse)
        except RuntimeError as err:
            where = next((fqn for fqn, m in model.named_modules() if m is self), None)  # only for the message
            raise ProfilingError(
                f"Module {where or '<root>'!r} ({type(self).__name__}) converts its parameters or buffers during the "
                "step (Module.to, .float(), "
                "...: torch swaps each for its converted copy, which the dry run's fake tensors do not allow). "
                "Convert the model before profiling (a router cast to its router dtype: cast it once after "
                "loading), so that the conversion in the step changes nothing. The model was not changed. "
                f"torch said: {err}"
            ) from err

    nn.Module._apply = _apply  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module._apply = original  # type: ignore[method-assign]
