"""CPU kernels whose memory fake tensors cannot see, measured on the kernel itself.

oneDNN's LSTM layer (``aten.mkldnn_rnn_layer``, what ``nn.LSTM`` runs on CPU in training) returns its training
workspace as a fourth output, which backward reads; the fake kernel returns it empty. Its backward
(``mkldnn_rnn_layer_backward``) allocates and frees scratch buffers of several times its input's size. Both
depend on oneDNN's internal layouts, not on a formula of the shapes that holds across versions, so they are taken
from the kernels: once per layer shape (and, for the backward, its gradients' layouts), the real forward and
backward run on synthetic inputs of the profiled shapes under torch.profiler, whose allocator events give the
workspace's size and each call's peak beyond its outputs. Only for the CPU target; the random stream and the model
are not touched.

Some losses' reduced output keeps the storage of their elementwise loss (:func:`reduced_loss_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.profiler import ProfilerActivity
from torch.utils._pytree import tree_flatten, tree_map

from lightning_sac.dryrun.measured import QuietProfile

__all__ = [
    "REDUCED_LOSSES",
    "REDUCED_LOSS_SCRATCH",
    "RnnLayerMemory",
    "reduced_loss_bytes",
    "reduced_loss_scratch",
    "rnn_layer_memory",
]

aten = torch.ops.aten
_FORWARD, _BACKWARD = aten.mkldnn_rnn_layer.default, aten.mkldnn_rnn_layer_backward.default


@dataclass(frozen=True)
class RnnLayerMemory:
    """What one oneDNN LSTM layer call allocates besides the outputs fake tensors show.

    Attributes:
        workspace_bytes: Size of the forward's fourth output, the training workspace.
        forward_scratch: Peak bytes the forward holds beyond its outputs, freed within the call.
        backward_scratch: Peak bytes the backward holds beyond its outputs, freed within the call.
    """

    workspace_bytes: int
    forward_scratch: int
    backward_scratch: int


_PROBED: dict[Any, RnnLayerMemory] = {}
# Arguments that identify a layer call, by name, in both the forward's and the backward's schema.
_SHARED = ("reverse", "mode", "hidden_size", "num_layers", "has_biases", "bidirectional", "batch_first", "train")


def _named(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _key(named: dict[str, Any], weights: tuple[str, ...]) -> Any:
    shapes = tuple(tuple(named[n].shape) for n in ("input", *weights, "hx_"))
    return shapes, named["input"].dtype, tuple(named[n] for n in _SHARED), tuple(named["batch_sizes"])


def _peak_beyond(run: Any) -> tuple[Any, int]:
    """Run ``run()`` under torch.profiler: its result, and the peak of its allocations beyond what it returns."""
    # The measurement imports the profiler's package.
    from lightning_sac.dryrun.measured import peak_from_events, window_memory_events

    with QuietProfile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = run()
    # Frees of blocks older than the window (QuietProfile's primer among them) would lower the peak.
    events = window_memory_events(prof)
    kept = sum(t.untyped_storage().nbytes() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
    return out, max(0, peak_from_events(events, 0).peak_bytes - kept)


_GRADS = ("grad_output", "grad_hy", "grad_cy")


def _grad_layouts(named: dict[str, Any]) -> tuple[Any, ...]:
    """Each output gradient of a backward call as its layout, ``None`` where autograd passes none.

    The kernel copies a gradient that is not contiguous (a ``batch_first`` layer's output gradient arrives
    transposed) and makes zeros for one that is missing (a loss of the output alone gives none for ``hy``/``cy``):
    the scratch follows both, so they key the measurement.
    """
    return tuple(
        None if (g := named[n]) is None else (tuple(g.shape), tuple(g.stride()), int(g.storage_offset()), g.dtype)
        for n in _GRADS
    )


def _probe(named: dict[str, Any], grads: tuple[Any, ...] | None = None) -> RnnLayerMemory:
    """Run the layer's forward and backward for real, each under the allocator's events.

    ``grads`` are the backward's gradient layouts (:func:`_grad_layouts`); by default contiguous gradients of
    every output.
    """
    from lightning_sac.dryrun.runtime import real_tensor  # runtime imports the recorder's users

    def real(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return real_tensor(tuple(x.shape), tuple(x.stride()), int(x.storage_offset()), x.dtype)

    with unset_fake_temporarily(), torch.random.fork_rng(devices=[]), torch.no_grad():
        forward = tree_map(real, named)
        # The kernel makes its workspace only with gradients on, as in the training step.
        with torch.enable_grad():
            out, forward_scratch = _peak_beyond(lambda: _FORWARD(**forward))
        workspace = out[3]
        backward = {n: forward[n] for n in (*_SHARED, "input", "hx_", "batch_sizes")}
        backward.update({f"weight{i + 1}": forward[f"weight{i}"] for i in range(4)})
        backward.update(cx_tmp=forward["cx_"], output=out[0], hy_=out[1], cy_=out[2], workspace=workspace)
        layouts = grads or tuple((tuple(o.shape), tuple(o.stride()), 0, o.dtype) for o in out[:3])
        backward.update({n: None if g is None else real_tensor(*g) for n, g in zip(_GRADS, layouts, strict=True)})
        _, backward_scratch = _peak_beyond(lambda: _BACKWARD(**backward))
    return RnnLayerMemory(workspace.untyped_storage().nbytes(), forward_scratch, backward_scratch)


def rnn_layer_memory(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> RnnLayerMemory | None:
    """What a oneDNN LSTM layer's forward (with gradients on) or backward call allocates unseen, or ``None``.

    A backward call is measured with its own gradients' layouts (:func:`_grad_layouts`): a layer whose output
    gradient arrived transposed and without gradients of its final states held a copy of the output gradient and
    two zero states more than a probe with contiguous gradients of every output (a lone ``nn.LSTM``'s step was
    predicted 3% under).
    """
    if func is _FORWARD and torch.is_grad_enabled():
        named = _named(func, args, kwargs)
        key = _key(named, ("weight0", "weight1", "weight2", "weight3"))
        if key not in _PROBED:
            _PROBED[key] = _probe(named)
        return _PROBED[key]
    if func is _BACKWARD:
        named = _named(func, args, kwargs)
        grads = _grad_layouts(named)
        key = (_key(named, ("weight1", "weight2", "weight3", "weight4")), grads)
        if key not in _PROBED:
            forward = {n: named[n] for n in (*_SHARED, "input", "hx_", "batch_sizes")}
            forward.update({f"weight{i}": named[f"weight{i + 1}"] for i in range(4)}, cx_=named["cx_tmp"])
            _PROBED[key] = _probe(forward, grads)
        return _PROBED[key]
    return None


#: Losses whose CPU kernel, with a ``mean`` or ``sum`` reduction, writes the elementwise loss into its output and
#: reduces it there: the 0-d result keeps a storage as large as the input until the loss tensor dies (through the
#: whole backward), where the fake kernel makes 4 bytes. Measured on torch 2.13: ``mse_loss``, ``smooth_l1_loss``,
#: ``binary_cross_entropy`` and ``soft_margin_loss`` (not ``l1_loss``, ``huber_loss``, ``cross_entropy``...).
#: A diffusion model's step (``F.mse_loss(unet(x_t), noise)``) was predicted an input's size under the measured.
#: The position of ``reduction`` in each op's arguments.
REDUCED_LOSSES = {
    aten.mse_loss.default: 2,
    aten.smooth_l1_loss.default: 2,
    aten.binary_cross_entropy.default: 3,
    aten.soft_margin_loss.default: 2,
}


def reduced_loss_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The bytes of a :data:`REDUCED_LOSSES` op's reduced output on the CPU, ``None`` for any other call."""
    at = REDUCED_LOSSES.get(func)
    if at is None:
        return None
    reduction = args[at] if len(args) > at else kwargs.get("reduction", 1)
    if reduction == 0 or (func is aten.smooth_l1_loss.default and _beta(args, kwargs) == 0.0):
        return None  # elementwise, as the fake kernel has it; smooth L1 with beta 0 runs l1_loss's path
    return int(args[0].numel() * args[0].element_size())


#: Reduced losses whose CPU kernel also holds a second elementwise buffer of the input's size during the call,
#: freed on return (measured on torch 2.13, by the allocator's events): MSE's and smooth L1's beside the storage
#: their output keeps, Huber's (whose output keeps none). Their backward kernels allocate only their outputs, and
#: so do ``binary_cross_entropy``'s and ``soft_margin_loss``'s forwards beside the kept storage. A VideoMAE step,
#: whose peak is its normalized-pixel MSE, was predicted an input's size (1.4%) under the measured. The position of
#: ``reduction`` in each op's arguments.
REDUCED_LOSS_SCRATCH = {aten.mse_loss.default: 2, aten.smooth_l1_loss.default: 2, aten.huber_loss.default: 2}


def reduced_loss_scratch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes a :data:`REDUCED_LOSS_SCRATCH` op's reduced call holds and frees within the call on the CPU, else 0."""
    at = REDUCED_LOSS_SCRATCH.get(func)
    if at is None:
        return 0
    reduction = args[at] if len(args) > at else kwargs.get("reduction", 1)
    return 0 if reduction == 0 else int(args[0].numel() * args[0].element_size())


def _beta(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    return float(args[3]) if len(args) > 3 else float(kwargs.get("beta", 1.0))
