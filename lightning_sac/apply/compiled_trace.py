"""Trace a step of a compiled model as inductor compiles it, on fake tensors, and read its memory.

The graphs go through inductor as in training (``torch._inductor.compile_fx.compile_fx``: its decompositions,
joint-graph passes, min-cut partitioner, post-grad passes, lowering, scheduler and fusion) up to the Python wrapper
code it generates around its kernels; that code is kept and read (:mod:`lightning_sac.apply.compiled_memory`), and
never loaded: no C++ is compiled, and each partitioned graph runs node by node on fake tensors instead. A plan
applied to the model is honoured as in training: its checkpoint wrappers are traced into the graph and their
policies tag the nodes the partitioner saves or recomputes (:mod:`lightning_sac.apply.traced`).

Dynamo guards its compiled code on the backend (``BACKEND_MATCH``), so the user's later ``torch.compile`` with
inductor compiles its own graphs; nothing traced here is reused by training. The kernels inductor generates for the
CPU are fused as for the CPU: for a CUDA target the figures are the CPU inductor's.
"""

from __future__ import annotations

import copy as copying
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn
from unittest import mock

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_sac.apply.compiled_memory import GraphMemory, saved_names, wrapper_memory

if TYPE_CHECKING:
    from lightning_sac.plan import Plan

__all__ = ["CompiledStepMemory", "LoweredGraph", "compiled_step_memory", "lowering_backend"]


@dataclass(frozen=True)
class LoweredGraph:
    """One partitioned graph and what inductor generated for it.

    Attributes:
        is_backward: Whether it is a backward graph.
        graph: The partitioned aten graph, as the partitioner gave it (before inductor's post-grad passes).
        code: Inductor's Python wrapper code for it.
        sizes: Bytes of the storage of each buffer inductor named.
    """

    is_backward: bool
    graph: fx.GraphModule
    code: str
    sizes: dict[str, int]


class _Lowered(Exception):  # noqa: N818 - not an error: how the capture leaves inductor before it compiles C++
    def __init__(self, code: str, sizes: dict[str, int]) -> None:
        super().__init__("inductor's wrapper code, captured before compiling")
        self.code, self.sizes = code, sizes


def _storage_bytes(buffer: Any, sizevars: Any) -> int | None:
    from torch._inductor import ir

    layout = getattr(buffer, "layout", None)
    if not isinstance(layout, ir.Layout) or isinstance(layout, (ir.MultiOutputLayout, ir.NoneLayout)):
        return None  # a tuple of a fallback kernel's outputs (each is its own buffer), or no tensor
    # Sizes are static (see compiled_step_memory), but a generator state saved for a recomputed random op has a
    # symbolic size: its hint is the state's size.
    return int(sizevars.guarding_hint_or_throw(layout.storage_size())) * layout.dtype.itemsize


def _generate_only(self: Any) -> NoReturn:
    """Stands for ``GraphLowering.compile_to_module``: generate the wrapper code, and leave before loading it."""
    wrapper, _ = self.codegen()
    sizes = {
        name: b for name, buf in self.name_to_buffer.items() if (b := _storage_bytes(buf, self.sizevars)) is not None
    }
    raise _Lowered(wrapper.value, sizes)


def lowering_backend(store: list[LoweredGraph]) -> Callable[..., Any]:
    """A ``torch.compile`` backend that compiles as inductor does up to its wrapper code, appended to ``store``.

    Each partitioned graph then runs node by node (on fake tensors in :func:`compiled_step_memory`).
    """
    from functorch.compile import make_boxed_func
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.graph import GraphLowering

    def keep(gm: fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        runnable = copying.deepcopy(gm)  # inductor's post-grad passes rewrite the graph it is given
        try:
            with mock.patch.object(GraphLowering, "compile_to_module", _generate_only):
                compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as err:  # inductor wraps what its compile raises: find the capture in the chain
            cause: BaseException | None = err
            while cause is not None and not isinstance(cause, _Lowered):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
            store.append(LoweredGraph(bool(kwargs.get("is_backward", False)), runnable, cause.code, cause.sizes))
        else:
            raise RuntimeError(
                "inductor compiled a graph without generating its wrapper code through compile_to_module"
            )
        return make_boxed_func(runnable.forward)

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
        return compile_fx(gm, example_inputs, inner_compile=keep)

    return backend


@dataclass(frozen=True)
class CompiledStepMemory:
    """What the compiled regions of one training step hold above the bytes resident at its start.

    Each forward graph's saved tensors live until its backward; graphs run forward in order and backward in
    reverse, so graph ``i``'s backward runs with the saved tensors of the graphs before it and the gradients of the
    graphs after it. Ops that run eagerly between graphs (a graph break, a loss computed outside the compiled
    module) are not in these figures.

    Attributes:
        forwards: The forward graphs' memory, in the order they ran.
        backwards: The backward graph of each forward, in the same order.
        trace_s: Seconds the trace took (dynamo, AOT autograd, inductor up to its wrapper code; no C++ compiled).
    """

    forwards: list[GraphMemory] = field(default_factory=list)
    backwards: list[GraphMemory] = field(default_factory=list)
    trace_s: float = 0.0

    @property
    def saved_bytes(self) -> int:
        """Bytes the forward graphs leave for backward (and their results): alive when backward starts."""
        return sum(f.end_bytes for f in self.forwards)

    @property
    def forward_peak_bytes(self) -> int:
        """The most the compiled regions hold at once during the forward."""
        saved = [f.end_bytes for f in self.forwards]
        return max((sum(saved[:i]) + f.peak_bytes for i, f in enumerate(self.forwards)), default=0)

    @property
    def backward_peak_bytes(self) -> int:
        """The most the compiled regions hold at once during the backward, gradients included."""
        peak, grads, saved = 0, 0, [f.end_bytes for f in self.forwards]
        for i in reversed(range(len(self.backwards))):
            peak = max(peak, sum(saved[:i]) + grads + self.backwards[i].peak_bytes)
            grads += self.backwards[i].end_bytes
        return peak


def _pair(store: list[LoweredGraph]) -> list[tuple[LoweredGraph, LoweredGraph]]:
    """Each forward graph with its backward: the backward's saved inputs are named as the forward's outputs."""
    forwards = [g for g in store if not g.is_backward]
    backwards = [g for g in store if g.is_backward]
    pairs: list[tuple[LoweredGraph, LoweredGraph]] = []

    def saved(bw: LoweredGraph) -> set[str]:
        # Tangents come from autograd, and a recomputed random op's generator state from AOT autograd's rng
        # functionalization, not from the forward's outputs.
        return {
            n.name
            for n in bw.graph.graph.nodes
            if n.op == "placeholder" and not n.name.startswith(("tangents", "rng_state_output"))
        }

    for fw in forwards:
        outs = {a.name for a in list(fw.graph.graph.nodes)[-1].all_input_nodes}
        match = [bw for bw in backwards if saved(bw) <= outs]
        if len(match) != 1:
            missing = [sorted(saved(bw) - outs)[:5] for bw in backwards]
            raise RuntimeError(
                f"the compiled step's forward graph {len(pairs)} has {len(match)} backward graphs matching its saved "
                f"tensors, not one (inputs of each backward graph that the forward does not output: {missing}): "
                "its memory cannot be read."
            )
        pairs.append((fw, match[0]))
    if len(pairs) != len(backwards) or not pairs:
        raise RuntimeError(f"the compiled step traced {len(forwards)} forward and {len(backwards)} backward graphs")
    return pairs


def _compile_parts(
    copy: nn.Module, backend: Callable[..., Any], step_compiled: bool, whole: bool
) -> tuple[nn.Module, int]:
    """Compile with ``backend`` the parts of ``copy`` that training compiles: the copy to run, and how many.

    An ``OptimizedModule`` is replaced by its module compiled anew (its own compiled code is inductor's), a
    ``module.compile()`` is redone, and with ``step_compiled`` (``trainer.fit(torch.compile(module))``) the copy's
    ``forward`` and ``training_step`` are compiled, as Lightning's ``from_compiled`` does.
    """
    from lightning_sac.adapters import traced_module

    n = 0
    if whole or traced_module(copy) is not copy:  # the model is itself torch.compile's wrapper
        return torch.compile(traced_module(copy), backend=backend), 1  # type: ignore[return-value]
    for parent in list(copy.modules()):
        for name, child in list(parent.named_children()):
            inner = traced_module(child)
            if inner is not child:
                parent.register_module(name, torch.compile(inner, backend=backend))  # type: ignore[arg-type]
                n += 1
    for m in copy.modules():
        if m.__dict__.get("_compiled_call_impl") is not None:
            m.compile(backend=backend)
            n += 1
    if step_compiled:
        for method in ("forward", "training_step"):
            copy.__dict__[method] = torch.compile(getattr(type(copy), method).__get__(copy), backend=backend)
        n += 1
    return copy, n


def compiled_step_memory(
    model: nn.Module,
    run_step: Callable[[nn.Module, FakeTensorMode], torch.Tensor],
    plan: Plan | None = None,
    *,
    step_compiled: bool = False,
    whole: bool = False,
    share: tuple[object, ...] = (),
) -> CompiledStepMemory:
    """Trace one step of ``model``'s compiled parts, on fake tensors, and return what their graphs hold.

    Args:
        model: The model as training runs it, with its compiled parts (``torch.compile(m)``, ``m.compile()``)
            and no plan applied: it is copied with fake parameters and buffers; the original is not touched.
        run_step: Called with the fake copy and the fake mode; runs the step's forward on fake inputs
            (``mode.from_tensor``) and returns the loss, whose backward this runs.
        plan: A plan to apply to the copy before compiling it.
        step_compiled: The model is a LightningModule whose step methods training compiles
            (:func:`~lightning_sac.adapters.uncompiled` takes Lightning's compiled methods off while copying).
        whole: Compile the model itself, as ``torch.compile(model)`` would (for a model not compiled yet).
        share: Objects the copy references rather than copies (a Lightning trainer).

    Raises:
        ValueError: Nothing in ``model`` is compiled.
        RuntimeError: The trace gave graphs whose forwards and backwards do not pair up.
    """
    # apply_plan is this package's door (apply/__init__), which exports this module: imported when called.
    from lightning_sac.adapters import uncompiled
    from lightning_sac.apply import apply_plan
    from lightning_sac.apply.planned import COMPILE_TRACE_WARNING
    from lightning_sac.dryrun import fake_copy

    began = time.perf_counter()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with uncompiled(model):
        copy = fake_copy(model, mode, "cpu", share=share)
    if plan is not None:
        apply_plan(copy, plan)
    store: list[LoweredGraph] = []
    copy, n_compiled = _compile_parts(copy, lowering_backend(store), step_compiled, whole)
    if n_compiled == 0:
        raise ValueError("compiled_step_memory: nothing in the model is compiled")
    # The caches would hand back compiled code without calling the backend, and so without the graphs. Each trace
    # adds a compiled entry to the model's code objects: after a few, dynamo would make sizes dynamic (symbolic
    # bytes), and past its recompile limit training would run its frames uncompiled. So sizes stay static, and the
    # entries are dropped after the trace (torch._dynamo.reset: compiled code of the model from before is
    # recompiled at its next call).
    # The copy's wrappers say when compile traces other ops than the plan's; the plan applied to the model says the
    # same at its own first trace, so the copy's (once per plan tried, in a search) would only repeat it.
    try:
        with (
            warnings.catch_warnings(),
            torch._inductor.config.patch(fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
            torch._dynamo.config.patch(automatic_dynamic_shapes=False, assume_static_by_default=True),
            mode,
        ):
            warnings.filterwarnings("ignore", message=re.escape(COMPILE_TRACE_WARNING))
            loss = run_step(copy, mode)
            loss.backward()
    finally:
        torch._dynamo.reset()
    forwards, backwards = [], []
    for fw, bw in _pair(store):
        resident, saved_resident = saved_names(fw.graph)
        forwards.append(wrapper_memory(fw.code, fw.sizes, fw.graph, resident))
        backwards.append(wrapper_memory(bw.code, bw.sizes, bw.graph, saved_resident))
    return CompiledStepMemory(forwards=forwards, backwards=backwards, trace_s=time.perf_counter() - began)
