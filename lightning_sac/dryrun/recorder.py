"""The one fused pass: a dispatch mode and module hooks that record memory, runtime and SAC op stats at once.

PyTorch's ``torch.distributed._tools`` gathers the same facts with three trackers over several passes. Here
each aten op is seen once: its runtime is estimated, its new storages are counted by category, and, in
forward, it is appended to one global op list; every module keeps only where its slice of that list starts
and ends, so nested modules share the records. The module hooks are in :mod:`lightning_sac.dryrun.modules.hooks`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.hooks import RemovableHandle

from lightning_sac.devices import DeviceSpec
from lightning_sac.dryrun.autograd.input_buffer import InputBuffers
from lightning_sac.dryrun.cuda.alloc_config import alloc_conf
from lightning_sac.dryrun.cuda.trace import TraceRecorder
from lightning_sac.dryrun.data import TimelineEvent, peak_location
from lightning_sac.dryrun.memory import LiveMemory, PeakWatch
from lightning_sac.dryrun.modules.hooks import ModuleHooks
from lightning_sac.dryrun.modules.own_checkpoints import GeneratorStates
from lightning_sac.dryrun.op_graph import OpGraph, OpRecord
from lightning_sac.dryrun.runtime import RuntimeEstimator
from lightning_sac.dryrun.values.kernel_layouts import check_strided
from lightning_sac.dryrun.values.meta_fallback import MetaKernelError
from lightning_sac.dryrun.values.real_values import DATA_DEPENDENT
from lightning_sac.dryrun.values.value_shapes import data_dependent_error
from lightning_sac.errors import ProfilingError, user_source_line
from lightning_sac.ops import (
    flat_tensors,
    is_cached_cast,
    is_inplace,
    is_random,
    is_sac_ignored,
    is_view_like,
    mutated_tensors,
    noise_mask,
    op_name,
)
from lightning_sac.sharding import in_parallel_hook

__all__ = ["StepRecorder"]

_DEVICE_QUERY = torch.ops.prim.device.default
_NEW_STORAGE_CATEGORY = {"forward": "activation", "backward": "temporary", "optimizer": "temporary"}


class StepRecorder(ModuleHooks, TorchDispatchMode):
    """Records one training step of a (fake) model. Enter it around the step; read :meth:`modules` after.

    Args:
        model: The fake copy being profiled; hooks are added to it and removed by :meth:`close`.
        spec: Target device, for allocator rounding.
        estimator: Per-op runtime estimator.
        workspace: Bytes an op's kernel allocates and frees within the call on the target, if known, from the op,
            its arguments and what it returned.
        output_bytes: Per output position, the bytes an op's output really has on the target where the fake
            kernel gives another size (``{}`` for most ops).
        is_real: Whether a tensor holds the real step's values (the batch's, :mod:`~lightning_sac.profiling.
            real_values`), to tell the user whose values an op it cannot run lacks; default: not a fake tensor.
    """

    def __init__(
        self,
        model: nn.Module,
        spec: DeviceSpec,
        estimator: RuntimeEstimator,
        *,
        workspace: Callable[[Any, tuple[Any, ...], dict[str, Any], Any], int] | None = None,
        output_bytes: Callable[[Any, tuple[Any, ...], dict[str, Any]], dict[int, int]] | None = None,
        is_real: Callable[[torch.Tensor], bool] | None = None,
    ) -> None:
        super().__init__()
        self.is_real = is_real
        self.workspace = workspace
        self.output_bytes = output_bytes
        self.spec = spec
        self.estimator = estimator
        self.phase = "setup"
        # A CUDA target's allocations are kept in order, for its caching allocator model to replay: what it
        # reserves beyond the tensors (fragmentation), for this step and for the step a plan makes of it.
        trace = TraceRecorder(alloc_conf()) if spec.is_cuda else None
        self.memory = LiveMemory(spec.round_bytes, self._location, on_free=self._on_free, trace=trace)
        self.cum_ms = 0.0
        self._phase_start_ms = 0.0
        self.phase_ms: dict[str, float] = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self.graph = OpGraph()
        self.orders: dict[str, list[str]] = {k: [] for k in ("fwd_pre", "fwd_post", "bwd_pre", "bwd_post")}
        self.timeline: list[TimelineEvent] = []
        self._interval: PeakWatch | None = None
        self._producer: dict[int, int] = {}
        self._serial: dict[int, int] = {}
        self._next_serial = 0
        self._saved: set[tuple[int, int]] = set()
        self._handles: list[RemovableHandle] = []
        self._buffers = InputBuffers(self._handles)
        self._pack_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)
        # The model's own checkpoints copy the CPU generator's state outside the dispatcher: counted as the step's.
        self._generator_states = GeneratorStates(self, self._track_state, enabled=not spec.is_cuda)
        self._hook_modules(model)

    # ----------------------------------------------------------------- life cycle
    def set_phase(self, phase: str) -> None:
        """Move to ``forward``, ``backward``, ``optimizer`` or ``done``; backward ends every open module."""
        if self.phase in self.phase_ms:
            self.phase_ms[self.phase] += self.cum_ms - self._phase_start_ms
        self._phase_start_ms = self.cum_ms
        if self.phase == "backward":
            for fqn in reversed(list(self._bwd_open)):
                self._end_backward(fqn)
            self._buffers.done()
        if phase == "backward":
            self._backward_pass += 1
        if self.memory.trace is not None:  # the optimizer steps FSDP's shards: what it makes is divided too
            self.memory.trace.sharding_new = phase == "optimizer"
        self.phase = phase
        self._event("phase", phase)

    def _event(self, kind: str, name: str) -> None:
        # The timeline: a snapshot at every module boundary and phase change, and the peak until the next
        # one, so that the solver can tell which activations are alive at every moment of the step.
        if kind in self.orders:
            self.orders[kind].append(name)
        if self._interval is not None:
            self.timeline[-1].peak_after = self._interval.peak_snapshot
            self.memory.close_watch(self._interval)
        self._interval = None if kind == "phase" and name == "done" else self.memory.open_watch()
        self.timeline.append(TimelineEvent(kind=kind, name=name, at=self.memory.snapshot(), peak_after={}))
        if self.memory.trace is not None:
            self.memory.trace.mark()

    def track_existing(self, tensors: Sequence[torch.Tensor], category: str) -> None:
        """Count tensors that exist before the step (parameters, optimizer state, inputs) under ``category``."""
        for t in tensors:
            self._track(t.untyped_storage(), category)

    def watch_gradients(self, params: list[nn.Parameter]) -> None:
        """Count each parameter's ``.grad`` as a gradient once autograd accumulates it."""
        for p in params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def __enter__(self) -> StepRecorder:
        self._pack_ctx.__enter__()
        self._generator_states.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._generator_states.__exit__(*exc)
        self._pack_ctx.__exit__(*exc)

    def close(self) -> None:
        """Remove every hook from the model and stop counting memory."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.memory.close()
        # The real values' mode (behind is_real) keeps the dry run's real batch tensors reachable: a closed
        # recorder, kept with its RecordedStep, must not hold them into training (they count in the real step).
        self.is_real = None

    def allocated_outside_ops(self, peak_bytes: int, kept_bytes: int) -> None:
        """Count memory that code the dispatcher does not see allocates at this point of the step.

        A torchmetrics metric's call on the fake copy is a stand-in (:mod:`~lightning_sac.dryrun.values.
        placeholders`) measured on a real copy of the metric: its allocations rose ``peak_bytes`` above what was
        live before it, and it left ``kept_bytes`` of them alive (grown states), which stay to the end of the step.
        """
        self.memory.hold(kept_bytes)
        self.memory.transient(peak_bytes - kept_bytes)

    # ----------------------------------------------------------------- memory helpers
    def _track(self, storage: torch.UntypedStorage, category: str, nbytes: int | None = None) -> int:
        if self.memory.is_live(storage):
            return 0
        self._serial[id(storage)] = self._next_serial
        self._next_serial += 1
        return self.memory.track(storage, category, nbytes)

    def _track_state(self, state: torch.Tensor) -> None:
        self._track(state.untyped_storage(), "other")

    def _key(self, storage: torch.UntypedStorage) -> tuple[int, int]:
        return id(storage), self._serial.get(id(storage), -1)

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.memory.recategorize(p.grad.untyped_storage(), "gradient")

    def _on_free(self, key: int, nbytes: int) -> None:
        if self.phase == "forward" and key in self._producer:
            self.graph.freed(self._producer[key], nbytes)
        self._module_frees(key, nbytes)

    def _pack(self, x: torch.Tensor) -> torch.Tensor:
        if self.phase == "forward":
            key = self._key(x.untyped_storage())
            self._saved.add(key)
            self.graph.pack(x, key)
        # Not ``x``: an op's saved output would hold its own grad_fn, a cycle through autograd's graph that only a
        # backward breaks, so a branch no backward reaches (a state the caller drops, logits under argmax) would
        # stay alive to the end of the step, which it does not without the hook. Unseen by the modes below.
        with _disable_current_modes():
            return x.detach()

    def _location(self) -> str:
        return peak_location(self.phase, self._stack, self._bwd_open)

    # ----------------------------------------------------------------- the ops
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Run the op on fake tensors and record what it costs."""
        kwargs = kwargs or {}
        if self.phase == "forward" and torch._C._current_graph_task_id() != -1:
            raise self._unannounced_backward(func)
        summed_into = None
        if self.phase == "backward":
            self._buffers.watch()
            summed_into = self._buffers.summed_in_place(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except MetaKernelError as err:  # a fake kernel that failed, with no fallback (meta_fallback.py)
            raise err.in_module(self._running_module()) from err.__cause__
        except DATA_DEPENDENT as err:
            module = self._running_module()
            where = user_source_line()
            is_real = self.is_real or (lambda t: not isinstance(t, FakeTensor))
            raise data_dependent_error(func, args, kwargs, err, is_real, module=module, where=where) from err
        inputs = flat_tensors(args) + flat_tensors(list(kwargs.values()))
        for t in inputs:
            # A storage no op created was alive before the step (e.g. a tensor attribute): count it as such.
            self._track(t.untyped_storage(), "other")
        if summed_into is not None:
            # Autograd summing two gradient contributions, which eager does in place (dryrun/autograd/): the sum
            # is the first one's memory, and nothing new is allocated.
            self.memory.hand_over(summed_into.untyped_storage(), out.untyped_storage())
        if func is _DEVICE_QUERY:
            # Most ops ask their arguments' device (36,000 of an 80-layer Llama step's 63,000 calls here): a query
            # makes no storage, runs no kernel, needs no workspace, and SAC ignores it. Nothing more to record.
            return out
        outputs = flat_tensors(out)
        check_strided(func, outputs, self._running_module)  # a sparse result has no storage to count
        inplace = is_inplace(func)
        # An op whose outputs all alias its inputs is a view whatever its schema says (_unsafe_view, alias):
        # it launches no kernel, and saving its output would pin its input's storage.
        view_like = is_view_like(func)
        if not view_like and not inplace and outputs:
            input_storages = {id(t.untyped_storage()) for t in inputs}
            view_like = all(id(t.untyped_storage()) in input_storages for t in outputs)
        ms = 0.0 if view_like else self.estimator(func, args, kwargs, out)
        self.cum_ms += ms
        category = _NEW_STORAGE_CATEGORY.get(self.phase, "other")
        new_bytes = 0
        keys = []
        sizes = self.output_bytes(func, args, kwargs) if self.output_bytes is not None else {}
        # The trace names the forward op that makes a storage (a plan recomputes it), asked only when one is made:
        # asking settles held-back views (op_graph.OpGraph), which must wait for the op that makes storage.
        # Ops SAC ignores, and parallelism's own (sharding.brackets), are numbered as none of a module's.
        unnumbered = is_sac_ignored(func) or in_parallel_hook()
        trace = self.memory.trace if self.phase == "forward" and not unnumbered else None
        for i, t in enumerate(outputs):
            st = t.untyped_storage()
            added = not self.memory.is_live(st)
            if added and trace is not None:
                trace.op = len(self.graph.ops)
            new_bytes += self._track(st, category, sizes.get(i))
            if added:
                self._producer[id(st)] = len(self.graph.ops)
            keys.append(self._key(st))
        workspace = 0
        if self.workspace is not None:
            workspace = self.workspace(func, args, kwargs, out)
            if workspace > 0 and trace is not None:
                trace.op = len(self.graph.ops)
            self.memory.transient(workspace)
        if trace is not None:
            trace.op = -1
        if self.phase == "forward" and unnumbered:
            self.graph.pass_through(inputs, outputs)
        elif self.phase == "forward":
            # What the op writes and makes matters to the forward's op records only (asked once per op there).
            written = mutated_tensors(func, args, kwargs)
            self._writes(written, op_name(func))
            output_storages = {id(t.untyped_storage()) for t in outputs}
            parent = None
            if inplace:
                parent = self._producer.get(id(written[0].untyped_storage()), -1) if written else -1
            rand = is_random(func, args, kwargs)
            # Perhaps autograd's replay of a view after a write (op_graph.OpGraph): decided at the next op.
            held_back = view_like and torch.is_grad_enabled() and self.graph.may_replay(inputs)
            record = OpRecord(
                name=op_name(func),
                ms=ms,
                new_bytes=new_bytes,
                view_like=view_like,
                rand=rand,
                inplace_parent=parent,
                # A cast autocast's cache keeps is held whatever the plan does: it must stay saved, as a write does.
                stateful=any(id(t.untyped_storage()) not in output_storages for t in written)
                or is_cached_cast(func, args, out),
                outputs=tuple(keys),
                inputs=self.graph.makers(inputs, settle=not held_back),
                storage_roots=tuple(self._producer.get(id(t.untyped_storage()), -1) for t in outputs),
                mask=noise_mask(func, args, self.estimator, self.spec.round_bytes) if rand else None,
                workspace=workspace,
            )
            self.graph.append(record, outputs, inputs if held_back else None)
        return out

    def _running_module(self) -> str:
        """The innermost module whose forward or backward is running (``""``: the root, or none)."""
        return self._stack[-1] if self._stack else (self._bwd_open[-1] if self._bwd_open else "")

    def _unannounced_backward(self, func: Any) -> ProfilingError:
        """The error for a backward pass that runs while the step is in its forward phase.

        The dry run knows a backward pass from the loop (automatic optimization) or from ``manual_backward``; one the
        step runs itself would be recorded as forward ops, with its gradients as activations.
        """
        where = user_source_line()
        if torch.is_grad_enabled():  # create_graph=True: the backward's results are part of the forward's graph
            what = (
                "a backward pass with create_graph=True inside its forward (e.g. a gradient penalty through "
                "torch.autograd.grad), whose graph the forward goes on with. Such a step cannot be planned: with "
                "AutoSAC, strict=False trains without a plan."
            )
        else:
            what = (
                "a backward pass of its own (loss.backward() or torch.autograd.grad). The dry run follows backward "
                "passes the loop runs (automatic optimization) or that the step runs with self.manual_backward(loss) "
                "(manual optimization): call that instead."
            )
        return ProfilingError(
            f"The training step runs {what} Autograd ran {func} for the call at {where}. The model was not changed.",
            op=str(func),
            module=self._stack[-1] if self._stack else "",
            source=where,
        )
