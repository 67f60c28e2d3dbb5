"""The memory of a compiled graph, read from the code inductor generates for it, without running that code.

Inductor frees and fuses what eager autograd keeps, so a compiled step holds less than the eager step the dry run
profiles (on a Hugging Face Llama, 297 MiB compiled against 360 MiB eager). What it holds is written in the Python
wrapper inductor generates around its kernels (``call(args)``): every buffer is allocated by
``empty_strided_cpu(...)`` or returned by a fallback kernel, reused by ``reinterpret_tensor``, and freed by
``del``; the graph's inputs are handed over in a list it clears, so a saved tensor is freed at its last use. This
module replays those statements, counting storages, on the wrapper's text and the buffers' sizes. Walking the aten
graph instead cannot see inductor's choices: its fused kernels write several outputs at once, and its scheduler
orders the kernels; on a two-layer Hugging Face Llama (d=128, batch 4 x 128) with a plan of recomputed MLPs, a walk
of the partitioned aten graph with inductor's fusion rules approximated read 9% below the measured peak, where the
replayed wrapper is within 0.5%.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["GraphMemory", "saved_names", "wrapper_memory"]

_ASSIGN = re.compile(r"(\w+) = (.*)")
_ITEM = re.compile(r"(\w+) = (\w+)\[\d+\]")
_NAME = re.compile(r"\w+")


@dataclass(frozen=True)
class GraphMemory:
    """Bytes one compiled graph holds above what was resident before it ran (parameters, buffers, the batch).

    Attributes:
        start_bytes: Its inputs that were not resident: saved tensors and tangents, for a backward graph.
        peak_bytes: The most alive at once while it runs, ``start_bytes`` included.
        end_bytes: Alive when it returns: its outputs (a forward's saved tensors and results, a backward's
            gradients).
    """

    start_bytes: int
    peak_bytes: int
    end_bytes: int


def _nbytes(val: torch.Tensor) -> int:
    """Bytes of a fake value's storage (a saved generator state's size is symbolic: its hint is the size)."""
    n = val.untyped_storage().nbytes()
    return n if isinstance(n, int) else int(n.node.hint)  # an unbacked size has no hint: int(None) raises


def _storage(n: fx.Node) -> StorageWeakRef | None:
    val = n.meta.get("val")
    return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None


def saved_names(forward: fx.GraphModule) -> tuple[set[str], set[str]]:
    """The forward graph's placeholders (resident when it runs), and its outputs whose storage is one of theirs.

    A saved tensor that is a parameter or a view of one (a transposed weight) costs the backward nothing: it is
    resident. The backward graph's placeholders carry the forward outputs' names.
    """
    nodes = list(forward.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    storages = {_storage(n) for n in placeholders} - {None}
    outs = [a for a in nodes[-1].all_input_nodes if _storage(a) in storages]
    return {n.name for n in placeholders}, {a.name for a in outs}


def _call_body(code: str) -> list[str]:
    """The statements of the wrapper's ``call``, up to its ``return``, comments dropped."""
    statements: list[str] = []
    inside = False
    for line in code.splitlines():
        text = line.split("#")[0].strip()
        if text.startswith(("def call(self, args)", "def call(args)")):
            inside = True
        elif inside and text.startswith("return"):
            return statements
        elif inside and text:
            statements.extend(s.strip() for s in text.split(";") if s.strip())
    raise ValueError("inductor's wrapper code has no call(args) function ending in a return")


class _Storages:
    """Names bound to storages, and the bytes of the storages some name still holds."""

    def __init__(self) -> None:
        self.of: dict[str, object] = {}
        self.names: dict[object, set[str]] = {}
        self.size: dict[object, int] = {}
        self.resident: set[object] = set()
        self.alive = 0

    def bind(self, name: str, key: object, nbytes: int) -> None:
        if key not in self.names:
            self.names[key], self.size[key] = set(), nbytes
            self.alive += 0 if key in self.resident else nbytes
        self.names[key].add(name)
        self.of[name] = key

    def alias(self, name: str, base: str) -> None:
        if base in self.of:  # a symbolic size or a scalar is no storage
            self.bind(name, self.of[base], 0)

    def drop(self, name: str) -> None:
        key = self.of.pop(name, None)
        if key is None:
            return
        self.names[key].discard(name)
        if not self.names[key]:
            del self.names[key]
            self.alive -= 0 if key in self.resident else self.size.pop(key)


def wrapper_memory(code: str, sizes: dict[str, int], graph: fx.GraphModule, resident: set[str]) -> GraphMemory:
    """Replay the allocations and frees of inductor's wrapper ``code`` for ``graph`` (see the module docstring).

    Args:
        code: The generated Python wrapper.
        sizes: Bytes of the storage of each buffer inductor named (``buf3``), from its layouts.
        graph: The partitioned graph the code was generated from: its placeholders' fake values give the inputs'
            storages (two inputs that are views of one tensor share it).
        resident: Placeholders whose storage was alive before the graph ran and stays alive after.

    Raises:
        ValueError: The wrapper has no ``call`` function, or allocates a buffer whose size is not in ``sizes``.
    """
    s = _Storages()
    for n in graph.graph.nodes:
        key = _storage(n) if n.op == "placeholder" else None
        if key is not None:
            if n.name in resident:
                s.resident.add(key)
            s.bind(n.name, key, _nbytes(n.meta["val"]))
    start = peak = s.alive
    body = _call_body(code)
    # A fallback kernel returning several tensors allocates them all when it runs; the wrapper names them after.
    items: dict[str, list[str]] = {}
    for stmt in body:
        m = _ITEM.fullmatch(stmt)
        if m:
            items.setdefault(m.group(2), []).append(m.group(1))
    fresh = 0

    def allocate(name: str, bound_as: str | None = None) -> None:
        nonlocal fresh
        if name not in sizes:
            raise ValueError(f"inductor's wrapper allocates {name}, whose size its layouts do not give")
        fresh += 1
        s.bind(bound_as or name, ("buffer", fresh), sizes[name])

    for stmt in body:
        if stmt.startswith("del "):
            for name in stmt[4:].split(","):
                s.drop(name.strip())
            continue
        m = _ASSIGN.fullmatch(stmt)
        if m is None:
            continue  # a kernel call: it writes buffers already allocated
        name, rhs = m.groups()
        item = _ITEM.fullmatch(stmt)
        if rhs.startswith("empty_strided"):
            allocate(name)
        elif rhs.startswith("reinterpret_tensor("):
            s.alias(name, rhs[len("reinterpret_tensor(") :].split(",")[0].strip())
        elif _NAME.fullmatch(rhs):
            s.alias(name, rhs)
        elif item is not None:
            base = item.group(2)
            s.alias(name, f"{base}[{name}]" if f"{base}[{name}]" in s.of else base)
            s.drop(f"{base}[{name}]")
        elif "(" in rhs and name in sizes:
            allocate(name)  # a fallback kernel returning one tensor
        elif "(" in rhs:
            for out in items.get(name, []):  # a fallback kernel returning a tuple: its tensors, bound by index
                if out not in sizes and not out.startswith("buf"):
                    continue  # a symbolic size or a scalar the kernel returns (an rng seed), no buffer
                allocate(out, bound_as=f"{name}[{out}]")
        peak = max(peak, s.alive)
    return GraphMemory(start_bytes=start, peak_bytes=peak, end_bytes=s.alive)
