"""The one matcher of device names, for the API (``get_device_spec``) and the command line (``--device``) alike.

A name resolves when it is a table name or an alias, ignoring case, ``-``, ``_``, spaces and a leading vendor word
(``"NVIDIA"``, ``"GeForce"``, ``"Tesla"``, ``"AMD Instinct"``). Otherwise it is never taken for another GPU: a
family prefix (``"H100"``) or a name of a known model (``"H100-80GB"``) lists that model's entries with their
memory for the user to pick; only a misspelling of one of a model's variants (``"H100-SMX"``) is suggested; a
name of no known model lists the table. The V100 once suggested for ``"H100"`` is what this rules out: a close
spelling of another model is another GPU.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

__all__ = ["DEVICE_ALIASES", "DeviceMatch", "match_device_name", "mismatch_message", "model_of", "normalize"]

#: Other names of table entries, each naming exactly one entry (a name that fits several, such as "H100-80GB"
#: for both H100s, is no alias: the matcher lists them). Matched like table names.
DEVICE_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "H100 SXM5": "H100-SXM",  # the datasheets' form-factor name
        # The capacity without its unit, as people shorten it; each model has one entry of that capacity.
        "A100-40": "A100-40GB",
        "A100-80": "A100-80GB",
        "A800-40": "A800-40GB",
        "A800-80": "A800-80GB",
        # GeForce and workstation cards by their number alone: no other entry has it.
        "3090": "RTX-3090",
        "4090": "RTX-4090",
        "5090": "RTX-5090",
        "A6000": "RTX-A6000",
        "GH200 480GB": "GH200",  # the driver's name of the HBM3 superchip
        # The HBM3e superchip's GPU: H200's memory class, bandwidth and compute (see DRIVER_NAME_PATTERNS).
        "GH200 144G HBM3e": "H200",
        "GH200 144GB": "H200",
    }
)

_VENDOR = re.compile(r"^(?:\s*(?:nvidia|amd|geforce|tesla|instinct)(?=[\s_-])[\s_-]*)+", re.IGNORECASE)
_FIRST_NUMBER = re.compile(r"\d+")
# A close spelling counts as a misspelling only this close (difflib's ratio): "H100-SMX" for "H100-SXM" is 0.86,
# "GH200 480GB" for "GH200" 0.67 (a driver's name of a part, not a typo).
_MISSPELLING_CUTOFF = 0.75

Kind = Literal["exact", "alias", "family", "misspelling", "model", "unknown"]


def normalize(name: str) -> str:
    """``name`` as the matcher compares it: no leading vendor word, no ``-``, ``_`` or spaces, lower case."""
    return re.sub(r"[-_ ]", "", _VENDOR.sub("", name)).lower()


def model_of(name: str) -> str | None:
    """The model a name is of: up to the end of its first number, normalized (``"H100-80GB"`` gives ``"h100"``).

    ``None`` for a name without a number (``"cpu"``).
    """
    bare = _VENDOR.sub("", name)
    number = _FIRST_NUMBER.search(bare)
    return normalize(bare[: number.end()]) if number else None


@dataclass(frozen=True)
class DeviceMatch:
    """What a device name matched.

    Attributes:
        query: The name as given.
        kind: ``"exact"`` or ``"alias"`` (resolved); ``"family"`` (a prefix of several names, or of one longer
            name); ``"misspelling"`` (close to one variant of the model it names); ``"model"`` (a model of the
            table, not one of its names); ``"unknown"``.
        name: The entry resolved to; ``None`` unless ``kind`` is ``"exact"`` or ``"alias"``.
        candidates: The entries to offer: the family, the model's entries, or the one close spelling.
    """

    query: str
    kind: Kind
    name: str | None = None
    candidates: tuple[str, ...] = ()


def _extends(name: str, key: str) -> bool:
    """Whether ``name`` is longer than ``key`` and begins with it at a boundary, not inside a number.

    "A100-40GB" extends "a100" (a separator follows) but not "a10" (a digit follows): "A10" is another model.
    """
    bare = _VENDOR.sub("", name)
    seen = 0
    for i, char in enumerate(bare):
        if char in "-_ ":
            continue
        if seen == len(key):
            return not (char.isdigit() and bare[i - 1].isdigit())
        if char.lower() != key[seen]:
            return False
        seen += 1
    return False


def _family(key: str, names: Iterable[str]) -> list[str]:
    if len(key) < 2:
        return []
    return sorted(n for n in names if model_of(n) is not None and _extends(n, key))


def match_device_name(query: str, names: Iterable[str], aliases: Mapping[str, str] = DEVICE_ALIASES) -> DeviceMatch:
    """Match ``query`` against the table's ``names`` (and ``aliases``): see the module's docstring.

    Args:
        query: The name a user gave.
        names: The table's canonical names.
        aliases: Other names, each of exactly one entry of ``names``.
    """
    table = sorted(names)
    key = normalize(query)
    by_key = {normalize(n): n for n in table}
    if key in by_key:
        return DeviceMatch(query, "exact", by_key[key])
    by_alias = {normalize(a): n for a, n in aliases.items()}
    if key in by_alias:
        return DeviceMatch(query, "alias", by_alias[key])
    family = _family(key, table)
    if family:
        return DeviceMatch(query, "family", candidates=tuple(family))
    model = model_of(query)
    same_model = [n for n in table if model is not None and model_of(n) == model]
    if not same_model:
        return DeviceMatch(query, "unknown")
    # Only among the model's own entries: a close spelling of another model is another GPU.
    close = difflib.get_close_matches(key, [normalize(n) for n in same_model], n=1, cutoff=_MISSPELLING_CUTOFF)
    if close:
        return DeviceMatch(query, "misspelling", candidates=(by_key[close[0]],))
    return DeviceMatch(query, "model", candidates=tuple(same_model))


def _spell(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def mismatch_message(match: DeviceMatch, memory_gib: Mapping[str, float], *, cli: bool = False) -> str:
    """The one line a name that resolved to no entry gets, for the API (``cli=False``) or ``--device``.

    Args:
        match: What the name matched (not ``"exact"`` or ``"alias"``).
        memory_gib: Every entry's memory, GiB: its keys are the names listed for an unknown name.
        cli: Word the remedy for the command line (``--device NAME``) instead of Python.
    """
    query, offered = match.query, match.candidates
    listed = ", ".join(f"{n} ({memory_gib[n]:g} GiB)" for n in offered)
    if match.kind in ("family", "model"):
        what = "is not a full device name" if match.kind == "family" else "names no entry of the table"
        if cli:
            return (
                f"device {query!r} {what}: {_spell(offered)}? the table has {listed}: type the one you train on, "
                f"e.g. --device {offered[0]} (their figures: lightning-sac devices)"
            )
        return (
            f"Device {query!r} {what}: {_spell(offered)}? The table has {listed}. Name the one you train on, "
            f"e.g. {offered[0]!r}, or pass your own DeviceSpec."
        )
    if match.kind == "misspelling":
        guess = offered[0]
        if cli:
            return (
                f"unknown device {query!r}: did you mean {guess}? Type --device {guess} "
                "(list the devices with: lightning-sac devices)"
            )
        return f"Unknown device {query!r}: did you mean {guess!r}? ({guess}: {memory_gib[guess]:g} GiB)"
    known = ", ".join(sorted(memory_gib))
    spec = (
        "DeviceSpec(name='my-gpu', memory_gib=48, tflops={'fp32': 90.0, 'bf16': 360.0}, dram_gbps=900, "
        "allocator_rounding=512, is_cuda=True)"
    )
    if cli:
        return (
            f"unknown device {query!r}: type one of {known} after --device (their figures: lightning-sac devices); "
            f"for other hardware plan from Python with device={spec}"
        )
    return (
        f"Unknown device {query!r}. Known devices: {known} (matched ignoring case, '-', '_' and spaces), or 'auto' "
        f"to detect the visible device. For other hardware pass your own spec instead of a name, e.g. "
        f"get_device_spec({spec})."
    )
