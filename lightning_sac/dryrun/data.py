"""The profile data model: plain dataclasses in bytes and milliseconds, with an exact JSON round trip.

Every later stage (trade-off curves, the solver, the callback's reports) reads these and nothing else, so
they hold numbers only, never tensors or modules.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from lightning_sac.devices import DeviceSpec
from lightning_sac.dryrun.cuda.trace import AllocationTrace
from lightning_sac.dryrun.op_stats import ModuleOpStats
from lightning_sac.sharding import ShardedLayout

__all__ = [
    "CATEGORIES",
    "PHASES",
    "MemorySnapshot",
    "ModelProfile",
    "ModuleOpStats",
    "ModuleProfile",
    "TimelineEvent",
    "empty_snapshot",
    "peak_location",
]

#: Memory categories, in the order reports stack them. Example inputs count as "other".
CATEGORIES: tuple[str, ...] = (
    "parameter",
    "buffer",
    "gradient",
    "optimizer_state",
    "activation",
    "temporary",
    "other",
)

#: The moments of a module's life at which its profile holds a memory snapshot.
PHASES: tuple[str, ...] = (
    "pre_forward",
    "post_forward",
    "peak_forward",
    "pre_backward",
    "post_backward",
    "peak_backward",
)

#: Live bytes on the device by category (every key of ``CATEGORIES``).
MemorySnapshot = dict[str, int]


def empty_snapshot() -> MemorySnapshot:
    """Return a snapshot with every category at zero bytes."""
    return dict.fromkeys(CATEGORIES, 0)


def peak_location(phase: str, forward_stack: list[str], backward_open: list[str]) -> str:
    """Where the step is, as :attr:`ModelProfile.peak_location` names it: ``"phase:innermost running module"``.

    Args:
        phase: ``"forward"``, ``"backward"`` or ``"optimizer"``.
        forward_stack: The modules whose forward is running, outermost first.
        backward_open: The modules whose backward has begun and not ended, in the order they began.
    """
    inner = (
        forward_stack[-1]
        if phase == "forward" and forward_stack
        else (backward_open[-1] if phase == "backward" and backward_open else "")
    )
    # Nothing open in forward or backward means the loss (or code outside every module) is running.
    return f"{phase}:{inner}" if inner or phase == "optimizer" else f"{phase}:<outside modules>"


@dataclass(kw_only=True)
class ModuleProfile:
    """What one module costs during a training step on the target device.

    Attributes:
        fqn: Fully qualified name in the model (``""`` for the root).
        module_type: Class name of the module.
        is_leaf: Whether the module has no children.
        parameter_bytes: Bytes of the module's parameters, its children's included, tied ones once.
        buffer_bytes: Bytes of its buffers, children included.
        gradient_bytes: Bytes of the gradients of those parameters that require grad.
        optimizer_state_bytes: Bytes of the optimizer state of those parameters.
        input_bytes: Bytes of the distinct storages of the tensors passed to ``forward``.
        output_bytes: Bytes of the distinct storages of the tensors ``forward`` returned.
        memory: Live bytes on the device by category at each of :data:`PHASES`. ``peak_*`` are the snapshot at
            the highest total during the module's forward or backward.
        forward_ms: Estimated forward time, children included, ms.
        backward_ms: Estimated backward time, children included, ms.
        calls: How many times ``forward`` ran in the step (memory and op stats are of the first call).
        op_stats: The ops of the first forward call: for non-leaf modules, and for leaf modules with parameters
            that run several ops that allocate memory (``nn.LSTM``).
        measured_overhead: Per checkpoint backend, ``[fixed_ms, recompute_factor]``: what wrapping the module
            cost when a copy of it ran for real on this CPU (see :mod:`lightning_sac.profiling.calibrate`).
            Only with ``estimate="benchmark"``, and only for the modules that could be measured; the others use
            :attr:`ModelProfile.backend_overhead_us`.
        freed_outputs: ``[timeline index, bytes]`` of each output storage of the first call that the plain step
            frees after the forward and before the module's backward is over, as for ``freed_inputs``. A
            checkpoint that must keep its output op (BatchNorm making the output a ReLU overwrites in place) keeps
            these until its backward.
        freed_inputs: ``[timeline index, bytes]`` of each input storage of the first call that the plain step
            frees after the module's forward and before its backward is over (the index of the ``"free"`` event
            the recorder adds at that moment). A checkpoint keeps its region's inputs until its backward is over,
            so checkpointing the module keeps these alive from then on (for an input nothing else saved: a
            ReLU-first region, an fp32 tensor a region under autocast reads only in half precision).
    """

    fqn: str
    module_type: str
    is_leaf: bool
    parameter_bytes: int = 0
    buffer_bytes: int = 0
    gradient_bytes: int = 0
    optimizer_state_bytes: int = 0
    input_bytes: int = 0
    output_bytes: int = 0
    memory: dict[str, MemorySnapshot] = field(default_factory=lambda: {p: empty_snapshot() for p in PHASES})
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    calls: int = 0
    op_stats: ModuleOpStats | None = None
    measured_overhead: dict[str, list[float]] = field(default_factory=dict)
    freed_inputs: list[list[int]] = field(default_factory=list)
    freed_outputs: list[list[int]] = field(default_factory=list)

    @property
    def activation_bytes(self) -> int:
        """Activation bytes the module's forward left alive (post-forward minus pre-forward)."""
        return self.memory["post_forward"]["activation"] - self.memory["pre_forward"]["activation"]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModuleProfile:
        """Rebuild from :func:`dataclasses.asdict` output."""
        d = dict(d)
        if d.get("op_stats") is not None:
            d["op_stats"] = ModuleOpStats.from_dict(d["op_stats"])
        return cls(**d)


@dataclass(kw_only=True)
class TimelineEvent:
    """A moment of the step at which the profile holds a memory snapshot.

    Attributes:
        kind: ``"phase"`` (the step entered a phase), ``"fwd_pre"``, ``"fwd_post"``, ``"bwd_pre"`` or
            ``"bwd_post"`` (a module's forward or backward began or ended), or ``"free"`` (an input or output of the
            module ``name`` was freed, which a checkpoint of it would keep: see :attr:`ModuleProfile.freed_inputs`).
        name: The module's fqn, or the phase's name (``forward``, ``backward``, ``optimizer``, ``done``).
        at: Live bytes by category at this moment.
        peak_after: The snapshot at the highest total from this moment until the next event (empty for the
            last event).
    """

    kind: str
    name: str
    at: MemorySnapshot
    peak_after: MemorySnapshot


@dataclass(kw_only=True)
class ModelProfile:
    """The profile of one training step of a model on a target device.

    Attributes:
        device: The target the numbers are for.
        estimate: How runtimes were estimated: ``"roofline"`` or ``"benchmark"``.
        modules: Per-module profiles keyed by fqn, the root first, in forward pre-order.
        forward_pre_order: Fqns in the order their forward started.
        forward_post_order: Fqns in the order their forward finished.
        backward_pre_order: Fqns in the order their backward started.
        backward_post_order: Fqns in the order their backward finished.
        peak_bytes: Highest total of live tensor bytes on the device during the step, parameters, optimizer
            state and inputs included.
        reserved_peak_bytes: For a CUDA target, the most the caching allocator model reserved while replaying the
            step's allocations and frees (:mod:`lightning_sac.dryrun.cuda.allocator`); 0 for the CPU.
        peak_breakdown: That total by category.
        peak_location: Where the peak happened: phase (``forward``, ``backward``, ``optimizer``) and the
            innermost running module, e.g. ``"backward:blocks.1.attn"`` (``<outside modules>``: the loss).
        forward_ms: Estimated time of the forward and loss, ms.
        backward_ms: Estimated time of the backward, ms.
        optimizer_ms: Estimated time of the optimizer step, ms.
        input_signature: dtype and shape of each tensor input, e.g. ``"torch.int64[4, 128]"``.
        timeline: Every module boundary and phase change of the recorded step, in order, with memory.
        backend_overhead_us: Per checkpoint backend, ``[forward_us, rerun_us]``: the host time its dispatch
            mode adds per op of a wrapped module (see :mod:`lightning_sac.profiling.overhead`). Measured with
            ``estimate="benchmark"`` only; empty otherwise, and then plans count recompute alone. A module
            with :attr:`ModuleProfile.measured_overhead` is charged that instead.
        checkpointed_modules: Outermost modules whose forward ran inside the model's own
            ``torch.utils.checkpoint`` (see :mod:`lightning_sac.dryrun.modules.own_checkpoints`).
        checkpoint_callers: Modules in whose forward one of the model's own checkpoint regions began. The
            planner checkpoints no module that is, contains or lies inside one of these or of
            :attr:`checkpointed_modules`.
        checkpointing_flags: Modules whose Hugging Face ``gradient_checkpointing`` flag was on in the profiled
            step (``model.gradient_checkpointing_enable()``).
        replaced_checkpointing: Modules whose ``gradient_checkpointing`` flag the dry run turned off because the
            plan is to replace the model's own checkpointing (``replace_existing=True``); a plan made from this
            profile turns them off when applied.
        kv_cache_off: Modules called with a KV cache in training, which the dry run ran without it, as a
            planned module runs (see :mod:`lightning_sac.adapters.caches`).
        kv_cache_with_tokens: Modules called with a KV cache that already held tokens; never checkpointed.
        module_state: Modules whose forward stored a tensor computed from its inputs as an attribute, with the
            attribute (:func:`~lightning_sac.dryrun.modules.hooks.stored_state`); neither they nor a module
            around them is checkpointed.
        writes_input: Modules whose forward wrote to one of its inputs in place, with the op; never checkpointed
            (a recompute would start from the written values).
        kv_cache_peak: When the dry run switched KV caches off (:attr:`kv_cache_off`), the peak of the step as
            the model runs without a plan, caches on, by category (a second dry run); ``None`` otherwise. Without
            caches a step can hold more (a fused QKV projection's views keep its buffer, where the caches' copies
            free it) or less; a plan is only made, and caches only switched off, when this peak exceeds the
            budget.
        placeholders: Where the dry run used a stand-in for a value it does not have (see
            :mod:`lightning_sac.dryrun.values.placeholders`), one dict per place: ``kind`` (``"scalar"``: a scalar read
            such as ``.item()`` of a weight-derived value; ``"metric"``: a torchmetrics metric call that did not
            run), ``op``, ``module`` (fqn; ``""`` is the root), ``source`` (``file:line in function: code``) and
            ``value`` (the stand-in, as text). A stand-in that decides what the step computes (an ``if`` on it)
            makes the profile describe another step than training runs.
        sharded: The FSDP units of a sharded model (profiled unsharded: see
            :mod:`lightning_sac.sharding`), read from the model; ``None`` when it is not sharded.
        data_parallel: The step runs under ``DistributedDataParallel`` (whose gradient buckets exist even with
            one process).
        routing: Each call of a mixture-of-experts layer's experts module, routed in the dry run on an even split of
            its ``top_k x tokens`` rows (:mod:`lightning_sac.dryrun.values.moe_routing`): ``module``, ``experts``,
            ``top_k``, ``tokens``, ``rows_per_expert`` and ``rows_follow_routing``.
        allocations: For a CUDA target, every allocation and free of the step in order, for the caching allocator
            model to replay this step or a planned one (:mod:`lightning_sac.dryrun.cuda.trace`); ``None`` for the
            CPU and for a profile saved before it was kept.
    """

    device: DeviceSpec
    estimate: str
    modules: dict[str, ModuleProfile]
    forward_pre_order: list[str] = field(default_factory=list)
    forward_post_order: list[str] = field(default_factory=list)
    backward_pre_order: list[str] = field(default_factory=list)
    backward_post_order: list[str] = field(default_factory=list)
    peak_bytes: int = 0
    reserved_peak_bytes: int = 0
    peak_breakdown: MemorySnapshot = field(default_factory=empty_snapshot)
    peak_location: str = ""
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    input_signature: list[str] = field(default_factory=list)
    timeline: list[TimelineEvent] = field(default_factory=list)
    backend_overhead_us: dict[str, list[float]] = field(default_factory=dict)
    checkpointed_modules: list[str] = field(default_factory=list)
    checkpoint_callers: list[str] = field(default_factory=list)
    checkpointing_flags: list[str] = field(default_factory=list)
    replaced_checkpointing: list[str] = field(default_factory=list)
    kv_cache_off: list[str] = field(default_factory=list)
    kv_cache_with_tokens: list[str] = field(default_factory=list)
    module_state: dict[str, str] = field(default_factory=dict)
    writes_input: dict[str, str] = field(default_factory=dict)
    kv_cache_peak: MemorySnapshot | None = None
    placeholders: list[dict[str, Any]] = field(default_factory=list)
    sharded: ShardedLayout | None = None
    data_parallel: bool = False
    routing: list[dict[str, Any]] = field(default_factory=list)
    allocations: AllocationTrace | None = None

    @property
    def plain_peak_bytes(self) -> int:
        """The peak of the step as the model runs without a plan: :attr:`kv_cache_peak` when there is one."""
        return self.peak_bytes if self.kv_cache_peak is None else sum(self.kv_cache_peak.values())

    def timeline_phases(self) -> list[str]:
        """The phase of the step each :attr:`timeline` event lies in (``""`` before the first phase event)."""
        phases, phase = [], ""
        for e in self.timeline:
            phase = e.name if e.kind == "phase" else phase
            phases.append(phase)
        return phases

    @property
    def step_ms(self) -> float:
        """Estimated time of the whole training step, ms."""
        return self.forward_ms + self.backward_ms + self.optimizer_ms

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-safe dict."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["device"] = self.device.to_dict()
        d["modules"] = {k: dataclasses.asdict(m) for k, m in self.modules.items()}
        d["timeline"] = [dataclasses.asdict(e) for e in self.timeline]
        d["sharded"] = None if self.sharded is None else self.sharded.to_dict()
        d["allocations"] = None if self.allocations is None else dataclasses.asdict(self.allocations)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelProfile:
        """Rebuild from :meth:`to_dict` output."""
        d = dict(d)
        d["device"] = DeviceSpec.from_dict(d["device"])
        d["modules"] = {k: ModuleProfile.from_dict(m) for k, m in d["modules"].items()}
        d["timeline"] = [TimelineEvent(**e) for e in d["timeline"]]
        if d.get("sharded") is not None:
            d["sharded"] = ShardedLayout.from_dict(d["sharded"])
        if d.get("allocations") is not None:
            d["allocations"] = AllocationTrace.from_dict(d["allocations"])
        return cls(**d)

    def to_json(self, indent: int | None = None) -> str:
        """Serialize to JSON; :meth:`from_json` gives back an equal profile."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        """Parse :meth:`to_json` output."""
        return cls.from_dict(json.loads(text))
