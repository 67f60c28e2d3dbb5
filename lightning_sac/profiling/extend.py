"""A list recorded for a model of ``k`` and of ``k + 1`` identical layers, extended to ``k + extra`` layers.

The records of a step (timeline events, allocations, ops, modules) form lists in which each layer's records recur:
a model with one more layer has one more copy of them at each place the layers appear (its forward, its backward,
each of the optimizer's lists of parameters). :func:`extend_list` aligns the two lists by each record's
:attr:`Item.sig` (what a record is, without its numbers), takes what the longer one has besides as the layer's
copy, and builds the list of a model with ``extra`` more layers than the shorter one: that copy ``extra`` times.

The numbers of a record (bytes, indices, a layer's number in a name, milliseconds) are taken to be affine in the
number of layers and in the record's own layer: ``v = v0 + lambda * b + layers * c``. A record of both lists
gives ``v_a + extra * (v_b - v_a)``; the ``j``-th copy of an inserted record continues its predecessor one layer
earlier in the list (``b``) and the record's change with one more layer (``c``). Whether a model's records are
affine is not assumed: :mod:`lightning_sac.profiling.replicate` extends to a third model it ran and compares.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher

__all__ = ["Item", "NotExtensible", "affine", "extend_list"]

Number = int | float


class NotExtensible(ValueError):
    """Two records of a model with one more layer do not differ by a copy of one layer's records."""


@dataclass(frozen=True)
class Item:
    """One record of a list: what it is (``sig``), and its numbers.

    Attributes:
        sig: Everything of the record but its numbers: two records align only when their ``sig`` are equal, and
            then their ``nums`` have the same length.
        nums: The record's numbers, each affine in the number of layers.
    """

    sig: Hashable
    nums: tuple[Number, ...]


def affine(a: Sequence[Number], b: Sequence[Number], extra: int) -> tuple[Number, ...]:
    """Numbers of a record with ``extra`` more layers than in ``a``, one more in ``b``."""
    if len(a) != len(b):
        raise NotExtensible(f"a record has {len(a)} numbers with k layers and {len(b)} with k + 1")
    return tuple(x + extra * (y - x) for x, y in zip(a, b, strict=True))


def _match(a: Sequence[Item], b: Sequence[Item]) -> list[int]:
    """Per record of ``b``, the index of the record of ``a`` it aligns with, or -1 for an inserted one."""
    sig_a, sig_b = [x.sig for x in a], [x.sig for x in b]
    match = [-1] * len(b)
    for tag, i1, i2, j1, j2 in SequenceMatcher(None, sig_a, sig_b, autojunk=False).get_opcodes():
        if tag == "equal":
            match[j1:j2] = range(i1, i2)
        elif tag != "insert":
            raise NotExtensible(f"records {i1}-{i2} of k layers {tag} records {j1}-{j2} of k + 1, not an insertion")
    return match


def _merge(b: Sequence[Item], match: list[int]) -> None:
    """Join inserted blocks that the alignment cut in two around records it matched in between.

    Where the first layer runs fewer records than the others (its backward, when its input needs no gradient), the
    alignment can match the first layer's last records with a later layer's and leave the new layer's records in
    two pieces around them. Those matched records move past one piece when the records they pass are the same.
    """
    sig = [x.sig for x in b]
    changed = True
    while changed:
        changed = False
        blocks = _blocks(match)
        for (p1, d1), (p2, d2) in zip(blocks, blocks[1:], strict=False):
            start, gap = p1 + d1, p2 - (p1 + d1)
            right = all(sig[start + i] == sig[start + d2 + i] for i in range(gap))
            left = not right and all(sig[p1 + i] == sig[start + i] for i in range(gap))
            if not (right or left):
                continue
            aligned = match[start:p2]
            match[p1 : p2 + d2] = [-1] * (d1 + gap + d2)
            at = start + d2 if right else p1  # the matched records, after or before the joined block
            match[at : at + gap] = aligned
            changed = True
            break


def _blocks(match: list[int]) -> list[tuple[int, int]]:
    out, j = [], 0
    while j < len(match):
        if match[j] >= 0:
            j += 1
            continue
        start = j
        while j < len(match) and match[j] < 0:
            j += 1
        out.append((start, j - start))
    return out


def _centre(b: Sequence[Item], match: list[int], p: int, d: int) -> int:
    """Move the inserted block ``[p, p + d)`` to the middle of the run of copies it lies in; its new start.

    Which copy of a run of identical layers' records is "the inserted one" is arbitrary, but the first and last
    layers' records may differ in their numbers from the others' (the first layer's input is the embedding's); in
    the middle, the inserted copy and its predecessor are both records of middle layers.
    """
    sig = [x.sig for x in b]
    left = 0
    while p - left - 1 >= 0 and match[p - left - 1] >= 0 and sig[p - left - 1] == sig[p + d - left - 1]:
        left += 1
    right = 0
    while p + d + right < len(b) and match[p + d + right] >= 0 and sig[p + d + right] == sig[p + right]:
        right += 1
    lo, hi = p - left, p + d + right
    aligned = [match[j] for j in range(lo, hi) if match[j] >= 0]
    new = lo + (left + right) // 2
    positions = [j for j in range(lo, hi) if not new <= j < new + d]
    match[lo:hi] = [-1] * (hi - lo)
    for j, i in zip(positions, aligned, strict=True):
        match[j] = i
    return new


def _periodic(b: Sequence[Item], match: list[int], p: int, d: int) -> bool:
    """Whether each record of the block ``[p, p + d)`` follows an aligned copy of itself one block earlier."""
    return all(q - d >= 0 and match[q - d] >= 0 and b[q - d].sig == b[q].sig for q in range(p, p + d))


def _place(b: Sequence[Item], match: list[int], p: int, d: int) -> dict[int, int]:
    """Centre the inserted block ``[p, p + d)`` (:func:`_centre`), or the two parts it is made of; start -> length.

    Where the layers' records of two runs meet (a foreach op's allocations for every parameter, then the frees of
    the op before it), the alignment can take the new layer's records of both runs as one block: it is split where
    each part is a copy of the records before it.
    """
    trial = list(match)
    new = _centre(b, trial, p, d)
    if _periodic(b, trial, new, d):
        match[:] = trial
        return {new: d}
    for split in range(1, d):
        trial = list(match)
        second = _centre(b, trial, p + split, d - split)
        first = _centre(b, trial, p, split)
        if _periodic(b, trial, first, split) and _periodic(b, trial, second, d - split):
            match[:] = trial
            return {first: split, second: d - split}
    raise NotExtensible(f"inserted records {p}-{p + d} of k + 1 layers follow no copy of themselves one layer earlier")


def extend_list(
    a: Sequence[Item], b: Sequence[Item], extra: int, descending: Callable[[int], bool] = lambda _: False
) -> list[Item]:
    """The list of a model with ``extra`` more layers than ``a``'s (``b`` has one more).

    Args:
        a: The records with ``k`` layers.
        b: The records with ``k + 1`` layers.
        extra: How many layers to add to ``a``'s (``extra = 1`` gives ``b`` back).
        descending: Whether the layers' records at index ``j`` of ``b`` come last layer first (a backward).

    Raises:
        NotExtensible: ``b`` is not ``a`` with copies of records inserted.
    """
    if extra < 1:
        raise ValueError(f"extend_list: expected extra >= 1 layers, got {extra}")
    match = _match(a, b)
    _merge(b, match)
    starts: dict[int, int] = {}
    for p, d in _blocks(match):
        starts.update(_place(b, match, p, d))
    out: list[Item] = []
    j = 0
    while j < len(b):
        if match[j] >= 0:
            out.append(Item(b[j].sig, affine(a[match[j]].nums, b[j].nums, extra)))
            j += 1
            continue
        d = starts[j]
        out += _copies(a, b, match, j, d, extra, descending(j))
        j += d
    return out


def _copies(
    a: Sequence[Item], b: Sequence[Item], match: list[int], p: int, d: int, extra: int, desc: bool
) -> list[Item]:
    """``extra`` copies of the inserted block ``[p, p + d)`` of ``b``, in list order."""
    per_record = []
    for q in range(p, p + d):
        pred = q - d
        if pred < 0 or match[pred] < 0 or b[pred].sig != b[q].sig:
            raise NotExtensible(f"inserted record {q} of k + 1 layers follows no copy of itself one layer earlier")
        e, before, before_a = b[q].nums, b[pred].nums, a[match[pred]].nums
        if not len(e) == len(before) == len(before_a):
            raise NotExtensible(f"inserted record {q} has {len(e)} numbers, its predecessor {len(before)}")
        step = [x - y for x, y in zip(e, before, strict=True)]
        # The record of k layers with the same layer as the inserted one: its predecessor's partner when the layers
        # run last first (the predecessor is the next layer), else the predecessor with one layer fewer.
        change = [x - y for x, y in zip(e if desc else before, before_a, strict=True)]
        per_record.append((e, step, change))
    # Ascending, the inserted record is the first copy; descending, the last (the one next to the lower layers).
    first = 1 if not desc else extra
    return [
        Item(
            b[p + i].sig, tuple(v + (extra - 1) * c + (j - first) * s for v, s, c in zip(e, step, change, strict=True))
        )
        for j in range(1, extra + 1)
        for i, (e, step, change) in enumerate(per_record)
    ]
