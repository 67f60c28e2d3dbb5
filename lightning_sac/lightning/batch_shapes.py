"""A batch's shape signature, what "covered by a plan" means, and batches grown to a ``max_shapes`` hint.

A plan is made for one batch: its memory prediction holds for that batch's tensor shapes. A batch is *covered*
by a plan made for signature ``S`` when its tensors are those of ``S`` (same places in the batch, same dtypes,
same number of dims) and every dim is at most ``S``'s. That relies on the step's peak memory being monotone
(non-decreasing) in every dim of every input, with the same ops: true of the layers training runs (a linear,
attention, a convolution, a norm allocates in proportion to its inputs' dims), and checked on a Hugging Face
decoder by ``tests/test_loop_shapes.py``. A batch whose ops differ (a smaller batch taking another code path)
runs the plan's mismatch fallback, which never stores more than plain autograd.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Signature", "check_max_shapes", "grow_batch", "map_tensors", "max_shapes_signature", "signature_of"]

Shape = tuple[int, ...]


def _tensors(x: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    # The order of lightning_sac.dryrun.step.tensors_of (dict values, then tuple and list items), so that a
    # signature lists the tensors in the order a plan's fingerprint does.
    if isinstance(x, torch.Tensor):
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _tensors(v, f"{path}[{k!r}]")
    elif isinstance(x, (tuple, list)):
        for i, v in enumerate(x):
            yield from _tensors(v, f"{path}[{i}]")


def _name(path: str) -> str:
    # batch['input_ids'] -> input_ids; batch[0] -> batch[0]: short names for messages.
    rest = path.removeprefix("batch")
    if rest.startswith("['") and rest.endswith("']") and rest.count("[") == 1:
        return rest[2:-2]
    return path


@dataclass(frozen=True)
class Signature:
    """The place, dtype and shape of every tensor of a batch.

    Attributes:
        paths: Where each tensor is in the batch, e.g. ``"batch['input_ids']"``.
        dtypes: Each tensor's dtype, e.g. ``"torch.int64"``.
        shapes: Each tensor's shape.
    """

    paths: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[Shape, ...]

    @property
    def structure(self) -> tuple[tuple[str, str, int], ...]:
        """Place, dtype and number of dims of each tensor: what two comparable signatures share."""
        return tuple((p, d, len(s)) for p, d, s in zip(self.paths, self.dtypes, self.shapes, strict=True))

    @property
    def dims(self) -> list[int]:
        """Every dim of every tensor, flat."""
        return [n for shape in self.shapes for n in shape]

    @property
    def numel(self) -> int:
        """Elements in all the batch's tensors."""
        return sum(int(torch.Size(s).numel()) for s in self.shapes)

    def structure_hash(self) -> int:
        """A 62-bit hash of :attr:`structure`, the same in every process (ranks compare it with one all-reduce)."""
        digest = hashlib.sha256(json.dumps(self.structure).encode()).digest()
        return int.from_bytes(digest[:8], "big") >> 2

    def with_dims(self, dims: list[int]) -> Signature:
        """This structure with other dims (flat, as :attr:`dims`)."""
        it = iter(dims)
        return Signature(self.paths, self.dtypes, tuple(tuple(next(it) for _ in s) for s in self.shapes))

    def covers(self, other: Signature) -> bool:
        """Whether a plan made for this signature holds for a batch of ``other``'s (see the module docstring)."""
        return self.structure == other.structure and all(a >= b for a, b in zip(self.dims, other.dims, strict=True))

    def maximum(self, other: Signature) -> Signature:
        """The dim-wise maximum of two signatures of the same structure."""
        return self.with_dims([max(a, b) for a, b in zip(self.dims, other.dims, strict=True)])

    def outside(self, other: Signature) -> str:
        """Why a plan made for this signature does not cover ``other``, in words; ``""`` when it does."""
        if self.structure != other.structure:
            return f"its tensors are {other.describe()}, the plan's were {self.describe()}"
        for path, mine, theirs in zip(self.paths, self.shapes, other.shapes, strict=True):
            if any(b > a for a, b in zip(mine, theirs, strict=True)):
                return f"{_name(path)} is {list(theirs)}, larger than the {list(mine)} planned for"
        return ""

    def describe(self, limit: int = 6) -> str:
        """``input_ids, attention_mask, labels int64[4, 128]``: tensors of one dtype and shape named together."""
        groups: list[tuple[list[str], str]] = []
        for p, d, s in zip(self.paths[:limit], self.dtypes, self.shapes, strict=False):
            kind = f"{d.removeprefix('torch.')}{list(s)}"
            if groups and groups[-1][1] == kind:
                groups[-1][0].append(_name(p))
            else:
                groups.append(([_name(p)], kind))
        more = len(self.paths) - limit
        text = "; ".join(f"{', '.join(names)} {kind}" for names, kind in groups) or "no tensors"
        return text + (f" and {more} more tensors" if more > 0 else "")

    def meta_batch(self) -> tuple[torch.Tensor, ...]:
        """Meta tensors of these dtypes and shapes, in order: a stand-in with this signature's fingerprint."""
        return tuple(
            torch.empty(s, dtype=getattr(torch, d.removeprefix("torch.")), device="meta")
            for d, s in zip(self.dtypes, self.shapes, strict=True)
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form; :meth:`from_dict` gives back an equal signature."""
        return {"paths": list(self.paths), "dtypes": list(self.dtypes), "shapes": [list(s) for s in self.shapes]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Signature:
        """Rebuild from :meth:`to_dict` output."""
        return cls(tuple(d["paths"]), tuple(d["dtypes"]), tuple(tuple(int(n) for n in s) for s in d["shapes"]))


def signature_of(batch: Any) -> Signature:
    """The :class:`Signature` of a batch (its tensors in nested dicts, tuples and lists)."""
    found = list(_tensors(batch))
    return Signature(
        tuple(p for p, _ in found), tuple(str(t.dtype) for _, t in found), tuple(tuple(t.shape) for _, t in found)
    )


def map_tensors(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``x`` rebuilt (dicts, tuples, named tuples, lists) with ``fn`` of each tensor, in :func:`signature_of` order."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return type(x)({k: map_tensors(v, fn) for k, v in x.items()})
    if isinstance(x, tuple):
        items = [map_tensors(v, fn) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    if isinstance(x, list):
        return [map_tensors(v, fn) for v in x]
    return x


def _grow(t: torch.Tensor, shape: Shape) -> torch.Tensor:
    for dim, n in enumerate(shape):
        extra = n - t.shape[dim]
        if extra <= 0:
            continue
        if t.shape[dim] == 0:
            t = torch.cat([t, t.new_zeros(*[extra if i == dim else s for i, s in enumerate(t.shape)])], dim)
            continue
        # The last entry repeated: a padded row stays padded, token ids stay valid ids, a mask stays a mask.
        edge = t.narrow(dim, t.shape[dim] - 1, 1)
        t = torch.cat([t, edge.expand(*[extra if i == dim else s for i, s in enumerate(t.shape)])], dim)
    return t


def grow_batch(batch: Any, target: Signature) -> Any:
    """``batch`` with each tensor grown to ``target``'s shape by repeating its last entry along each grown dim.

    Dims already at least ``target``'s stay as they are. Raises ``ValueError`` when the structures differ.
    """
    if signature_of(batch).structure != target.structure:
        raise ValueError(
            f"Cannot grow a batch of {signature_of(batch).describe()} to {target.describe()}: its tensors differ."
        )
    shapes = iter(target.shapes)
    return map_tensors(batch, lambda t: _grow(t, next(shapes)))


def _is_shape(x: Any) -> bool:
    return isinstance(x, (tuple, list)) and all(isinstance(n, int) and not isinstance(n, bool) for n in x)


_FORMS = (
    "max_shapes mirrors the batch: for a dict batch a dict of each tensor's largest shape, e.g. "
    "{'input_ids': (8, 512), 'attention_mask': (8, 512), 'labels': (8, 512)}; for a tuple batch a tuple of "
    "shapes, e.g. ((8, 512), (8,)); for a single tensor its shape. None (or a key left out) keeps a tensor's shape."
)


def check_max_shapes(value: Any, path: str = "max_shapes") -> None:
    """Check the form of a ``max_shapes`` hint without a batch.

    Raises:
        TypeError: An entry is neither a shape, ``None``, nor a dict, tuple or list of entries (named by its path).
        ValueError: A shape has a negative dim.
    """
    if value is None or isinstance(value, torch.Size):
        return
    if _is_shape(value):
        if any(n < 0 for n in value):
            raise ValueError(f"AutoSAC: {path} = {value!r} has a negative dim. {_FORMS}")
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            check_max_shapes(v, f"{path}[{k!r}]")
        return
    if isinstance(value, (tuple, list)) and not any(isinstance(v, (int, float)) for v in value):
        for i, v in enumerate(value):
            check_max_shapes(v, f"{path}[{i}]")
        return
    raise TypeError(
        f"AutoSAC: {path} must be a shape (a tuple of ints), got {value!r} ({type(value).__name__}). {_FORMS}"
    )


def _hinted(batch: Any, hint: Any, path: str, out: list[Shape]) -> None:
    if hint is None:
        out.extend(tuple(t.shape) for _, t in _tensors(batch, path))
    elif isinstance(batch, torch.Tensor):
        if not _is_shape(hint) or len(hint) != batch.dim():
            raise ValueError(
                f"AutoSAC: max_shapes gives {hint!r} for {path}, a tensor of shape {list(batch.shape)}: expected a "
                f"shape of {batch.dim()} ints. {_FORMS}"
            )
        out.append(tuple(max(int(a), b) for a, b in zip(hint, batch.shape, strict=True)))
    elif isinstance(batch, dict):
        if not isinstance(hint, Mapping) or set(hint) - set(batch):
            extra = sorted(map(repr, set(hint) - set(batch))) if isinstance(hint, Mapping) else []
            raise ValueError(
                f"AutoSAC: max_shapes gives {hint!r} for {path}, a dict with keys {sorted(map(repr, batch))}"
                + (f"; it has no {', '.join(extra)}" if extra else "")
                + f". {_FORMS}"
            )
        for k, v in batch.items():
            _hinted(v, hint.get(k), f"{path}[{k!r}]", out)
    elif isinstance(batch, (tuple, list)):
        if _is_shape(hint) or not isinstance(hint, (tuple, list)) or len(hint) != len(batch):
            raise ValueError(
                f"AutoSAC: max_shapes gives {hint!r} for {path}, a {type(batch).__name__} of {len(batch)} items: "
                f"expected one entry per item. {_FORMS}"
            )
        for i, (v, h) in enumerate(zip(batch, hint, strict=True)):
            _hinted(v, h, f"{path}[{i}]", out)
    else:
        raise ValueError(f"AutoSAC: max_shapes gives {hint!r} for {path}, which holds no tensor. {_FORMS}")


def max_shapes_signature(batch: Any, max_shapes: Any) -> Signature:
    """The signature of ``batch`` with each tensor at its ``max_shapes`` hint (never below the batch's own shape).

    Raises:
        ValueError: The hint does not mirror the batch; the message names the entry and the accepted forms.
    """
    shapes: list[Shape] = []
    _hinted(batch, max_shapes, "batch", shapes)
    own = signature_of(batch)
    return Signature(own.paths, own.dtypes, tuple(shapes))
