"""One training step, written once and run both on fake tensors (the dry run) and on real ones (measurement).

Profiling and ground truth must run the very same step, or comparing them measures the difference between
two loops instead of the accuracy of the profile.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_sac.sharding import unsharded_structure

if TYPE_CHECKING:
    from lightning_sac.dryrun.data import ModelProfile

__all__ = [
    "fingerprint_of",
    "profile_fingerprint",
    "ComputeLoss",
    "LossFn",
    "ManualStep",
    "ModelInputs",
    "OptimizerFactory",
    "default_loss",
    "input_signature",
    "loop_signature",
    "manual_training_step",
    "model_inputs",
    "model_loss",
    "tensors_of",
    "training_step",
]

LossFn = Callable[[Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
#: Runs the forward of a step and returns its scalar loss: ``compute_loss(model, inputs)``, where ``inputs`` is
#: whatever the step takes (for a plain model, its :data:`ModelInputs`).
ComputeLoss = Callable[[nn.Module, Any], torch.Tensor]
#: A step that runs its own backward passes and optimizer steps (Lightning's manual optimization):
#: ``run(model, inputs, optimizers, on_phase)``. It calls ``on_phase("backward")`` before each backward pass,
#: ``on_phase("optimizer")`` before each optimizer step, and ``on_phase("forward")`` after each of them.
ManualStep = Callable[[nn.Module, Any, Sequence[torch.optim.Optimizer], Callable[[str], None]], None]
#: A model's call, ``model(*args, **kwargs)``, as the pair ``(args, kwargs)``.
ModelInputs = tuple[tuple[Any, ...], dict[str, Any]]


def model_loss(loss_fn: LossFn | None = None) -> ComputeLoss:
    """The forward of a plain training step: ``loss_fn(model(*args, **kwargs))`` (default: see :func:`default_loss`).

    It takes the step's inputs as :func:`model_inputs` returns them. The model's output stays inside this
    function, so it is dropped before backward, as a Lightning ``training_step`` that returns only the loss
    drops it: whatever autograd did not save is free in backward.
    """

    def compute(model: nn.Module, inputs: ModelInputs) -> torch.Tensor:
        args, kwargs = inputs
        return (loss_fn or default_loss)(model(*args, **kwargs))

    return compute


def _leaves(x: Any) -> list[Any]:
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in _leaves(v)]
    if isinstance(x, (tuple, list)):
        return [leaf for v in x for leaf in _leaves(v)]
    return [x]


def default_loss(output: Any) -> torch.Tensor:
    """The model's own loss when it returns one, else the sum of the first floating-point tensor of its output.

    A Hugging Face model called with ``labels`` returns its loss as ``output.loss`` (``output["loss"]``); any
    other output (a tensor, or nested tuples, lists and dicts) is reduced by summing its first float tensor.
    """
    own = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(own, torch.Tensor) and own.numel() == 1 and own.is_floating_point():
        return own
    for leaf in _leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.sum()
    raise TypeError(
        f"The model returned {type(output).__name__} with no floating-point tensor, so the default loss "
        "(output.sum()) cannot be formed. Pass loss_fn=callable(output) -> scalar tensor."
    )


def model_inputs(example_inputs: Any, example_kwargs: Mapping[str, Any] | None = None) -> ModelInputs:
    """The model's call as ``(args, kwargs)``, from the forms the public functions accept.

    Args:
        example_inputs: A tuple of positional inputs (``model(*example_inputs)``), or a dict of keyword inputs
            (``model(**example_inputs)``, as Hugging Face models are called with a tokenized batch).
        example_kwargs: Keyword inputs besides positional ``example_inputs``.

    Raises:
        TypeError: Another type, or keyword inputs given twice.
    """
    if isinstance(example_inputs, Mapping):
        if example_kwargs is not None:
            raise TypeError(
                "example_inputs is already a dict of keyword inputs; pass the other keyword inputs in it too, "
                "or pass positional inputs as a tuple with example_kwargs=."
            )
        return (), dict(example_inputs)
    if not isinstance(example_inputs, tuple):
        raise TypeError(
            "example_inputs must be a tuple of positional inputs (model(*example_inputs)) or a dict of keyword "
            f"inputs (model(**example_inputs)), got {type(example_inputs).__name__}. For a single tensor x pass "
            "(x,)."
        )
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise TypeError(f"example_kwargs must be a dict of keyword inputs, got {type(example_kwargs).__name__}.")
    return example_inputs, dict(example_kwargs or {})


def _check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        got = (
            f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise ValueError(
            f"loss_fn must return a scalar floating-point tensor, got {got}. Reduce it, e.g. with .mean()."
        )
    if not loss.requires_grad:
        raise ValueError(
            "The loss does not require grad, so backward would not run: is the model in torch.no_grad() or "
            "are all of its parameters frozen?"
        )
    return loss


def training_step(
    model: nn.Module,
    inputs: Any,
    compute_loss: ComputeLoss,
    optimizer: torch.optim.Optimizer | None,
    on_phase: Callable[[str], None] = lambda phase: None,
    *,
    zero_grad_before_backward: bool = False,
    accumulate_grad_batches: int = 1,
) -> None:
    """Run forward and loss, backward and (if given) the optimizer step with ``zero_grad(set_to_none=True)``.

    Args:
        model: The module to train.
        inputs: Its inputs, as ``compute_loss`` takes them.
        compute_loss: Runs the forward and returns the scalar loss (see :func:`model_loss`).
        optimizer: Stepped after backward when given.
        on_phase: Called with ``"forward"``, ``"backward"``, ``"optimizer"`` and ``"done"`` as the step moves on.
        zero_grad_before_backward: Lightning's order: the previous step's gradients live through the forward
            and are set to ``None`` just before backward, not after the optimizer step.
        accumulate_grad_batches: Lightning's gradient accumulation over this many micro-batches (with
            ``zero_grad_before_backward``): the step run is the last micro-batch of a cycle, whose loss is divided
            by it, whose backward adds to the gradients of the earlier micro-batches (alive through its forward
            and backward) and after which the optimizer steps.
    """
    if accumulate_grad_batches < 1:
        raise ValueError(f"accumulate_grad_batches must be at least 1, got {accumulate_grad_batches}.")
    on_phase("forward")
    loss = _check_loss(compute_loss(model, inputs))
    if accumulate_grad_batches > 1:
        # Lightning's order within a cycle of k micro-batches: the first sets the gradients to None after its
        # forward and backward writes fresh ones; every later one keeps them through its forward, and its backward
        # adds to them in place (AccumulateGrad's `grad += new`, the new gradient a temporary that the first
        # micro-batch has too, as its .grad); the optimizer steps after the k-th. With the same batch shapes the
        # micro-batches hold the same activations, so at every moment the last one holds at least what any other
        # holds: all gradients instead of those produced so far, and the optimizer step besides. It is the one
        # dry-run: a plan that holds for it holds for the whole cycle. Lightning divides the loss, not in place.
        loss = loss / accumulate_grad_batches
    elif zero_grad_before_backward and optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    on_phase("backward")
    loss.backward()
    del loss
    on_phase("optimizer")
    if optimizer is not None:
        optimizer.step()
        if not zero_grad_before_backward:
            optimizer.zero_grad(set_to_none=True)
    on_phase("done")


def manual_training_step(
    model: nn.Module,
    inputs: Any,
    run: ManualStep,
    optimizers: Sequence[torch.optim.Optimizer],
    on_phase: Callable[[str], None] = lambda phase: None,
) -> None:
    """Run a step that optimizes itself: ``run`` moves the phases on as it backpropagates and steps.

    Args:
        model: The module to train.
        inputs: Its inputs, as ``run`` takes them.
        run: The step (see :data:`ManualStep`).
        optimizers: The optimizers it steps.
        on_phase: Called with ``"forward"`` first, ``"done"`` last, and by ``run`` in between.
    """
    on_phase("forward")
    run(model, inputs, optimizers, on_phase)
    on_phase("done")


def loop_signature(accumulate_grad_batches: int = 1, manual: bool = False) -> list[str]:
    """How the training loop runs the step, where it differs from a plain step, as a profile's signature lists it.

    A plan made for one loop does not hold for another (accumulation keeps gradients alive through backward; a
    manual step runs its own passes), so the loop is part of what a plan is made for, beside the input shapes.
    """
    if manual:
        return ["manual_optimization"]
    return [f"accumulate_grad_batches={accumulate_grad_batches}"] if accumulate_grad_batches > 1 else []


def tensors_of(x: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure of tuples, lists and dicts."""
    return [leaf for leaf in _leaves(x) if isinstance(leaf, torch.Tensor)]


def input_signature(inputs: Any) -> list[str]:
    """The dtype and shape of each tensor in a step's inputs, e.g. ``["torch.int64[4, 128]"]``."""
    return [f"{t.dtype}{list(t.shape)}" for t in tensors_of(inputs)]


def _fingerprint(structure: list[tuple[str, str]], input_signature: list[str]) -> str:
    text = json.dumps([sorted(structure), input_signature])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def profile_fingerprint(profile: ModelProfile) -> str:
    """Hash of the model structure (fqns and module types) and input dtypes and shapes of a profile."""
    return _fingerprint([(fqn, m.module_type) for fqn, m in profile.modules.items()], profile.input_signature)


def fingerprint_of(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | Mapping[str, Any],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    loop: Sequence[str] = (),
) -> str:
    """What :func:`profile_fingerprint` gives for ``model`` profiled on these inputs, without profiling.

    The inputs take the forms :func:`~lightning_sac.profile_model` takes: a tuple of positional inputs, a dict of
    keyword inputs, or both. ``loop`` is the training loop's part of the profile's signature
    (:func:`loop_signature`; empty for a plain step).
    """
    structure = unsharded_structure(model)  # a sharded model is profiled as it was before sharding
    return _fingerprint(structure, input_signature(model_inputs(example_inputs, example_kwargs)) + list(loop))
