"""The command line's checks that need the model, its profile or a file; its own wording of a BudgetError.

Like :mod:`lightning_sac.cli.args`, each wrong input becomes a one-line :class:`~lightning_sac.cli.args.UsageError`
that says what to type instead, in the command line's syntax (``--sharding sharded --world-size N``), where the
Python API's messages speak Python (``sharding='sharded'``).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_sac.cli.args import UsageError
from lightning_sac.dryrun import ModelProfile, profile_fingerprint
from lightning_sac.errors import BudgetError
from lightning_sac.plan import Plan
from lightning_sac.solver import find_candidates

__all__ = ["budget_message", "check_candidates", "check_checkpointable", "read_plan", "read_profile"]

_GIB = 2**30
_SHOWN = 6


def _glob_of(fqns: Sequence[str]) -> str:
    """A pattern to offer: the first numbered module's siblings (``blocks.0`` gives ``blocks.*``)."""
    for fqn in fqns:
        if re.search(r"(^|\.)\d+$", fqn):
            return re.sub(r"\d+$", "*", fqn)
    return fqns[0] if fqns else "*"


def _some(names: Sequence[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (f" ... ({len(names)} in all)" if len(names) > _SHOWN else "")


def check_candidates(patterns: Sequence[str] | None, model: Any) -> None:
    """Check that each ``--candidates`` pattern matches a module of ``model`` (by fqn, with ``*`` wildcards).

    Raises:
        UsageError: A pattern matching no module: the message lists some module names and a pattern to type.
    """
    if patterns is None:
        return
    fqns = [fqn for fqn, _ in model.named_modules() if fqn]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(fqn, p) for fqn in fqns)]
    if unmatched:
        shallow = [f for f in fqns if f.count(".") <= 1] or fqns
        raise UsageError(
            f"--candidates {' '.join(unmatched)} matches no module of the model: its modules include "
            f"{_some(shallow)}; give module names, * for any part, e.g. --candidates '{_glob_of(fqns)}'"
        )


def check_checkpointable(patterns: Sequence[str] | None, profile: ModelProfile, n_segments: int, backend: str) -> None:
    """Check that the modules ``--candidates`` matches include one a plan may checkpoint.

    Raises:
        UsageError: None of them can be: the message names modules that can.
    """
    if patterns is None:
        return
    if find_candidates(profile, patterns, n_segments, backend):
        return
    # The root ("") is a candidate too, but not one to type after --candidates.
    possible = [c.fqn for c in find_candidates(profile, None, n_segments, backend) if c.fqn]
    can = f"modules that can: {_some(possible)}" if possible else "no module of this model can"
    raise UsageError(
        f"no module matching --candidates {' '.join(patterns)} can be checkpointed (a candidate runs once per step, "
        f"holds activations to free and is not a single layer or inside the model's own checkpointing); {can}"
    )


def _decimals(gib: float) -> int:
    """3 decimals, more below 0.1 GiB so that a figure keeps 3 significant digits."""
    return max(3, 2 - math.floor(math.log10(gib))) if gib > 0 else 3


def budget_message(err: BudgetError, args: argparse.Namespace, profile: ModelProfile) -> str:
    """A BudgetError in the command line's words: the budget to type, and the other ways out as flags."""
    minimum = err.minimum_bytes / _GIB
    digits = _decimals(minimum)
    # Rounded up, so that the number to type is a budget the plan fits in.
    enough = math.ceil(minimum * 10**digits) / 10**digits
    ways = [f"type --budget-gb {enough:.{digits}f} or more"]
    if args.sharding == "replicated":
        ways.append(
            "shard parameters, gradients and optimizer state over N devices with --sharding sharded --world-size N"
        )
    else:
        ways.append(f"shard them over more devices with a --world-size above {args.world_size}")
    if getattr(args, "hf_config", None) is not None:
        ways.append(f"plan a smaller batch (--batch below {args.batch}) or shorter sequences (--seq below {args.seq})")
    else:
        ways.append("make the factory's batch smaller or its sequences shorter")
    if args.candidates is not None:
        ways.append("allow more modules in --candidates (or leave it out)")
    own = profile.checkpointed_modules or profile.checkpoint_callers
    if profile.checkpointing_flags and not args.replace_existing:
        ways.append("add --replace-existing to let the plan replace the model's own gradient checkpointing")
    elif own:
        ways.append(f"remove the model's own torch.utils.checkpoint calls ({_some(own)}), which plans work around")
    return (
        f"--budget-gb {args.budget_gb:g} is below the minimum achievable peak of {minimum:.{digits}f} GiB per device "
        f"on {profile.device.name} (world size {args.world_size}, {args.sharding}; "
        f"{err.unconstrained_bytes / _GIB:.{digits}f} GiB without a plan): " + "; or ".join(ways)
    )


def _read_json(path: str, what: str, writer: str) -> Any:
    file = Path(path)
    if file.is_dir():
        raise UsageError(f"{path} is a folder, not {what}: pass the file that {writer} wrote")
    if not file.is_file():
        raise UsageError(f"no file {path!r} (from {Path.cwd()}): pass {what}, the file that {writer} writes")
    try:
        return json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise UsageError(f"{path} is not {what} (not JSON: {err}): pass the file that {writer} wrote") from None


def _mismatch(path: str, what: str, writer: str, d: Any) -> UsageError:
    keys = f"its keys: {_some(sorted(d))}" if isinstance(d, dict) else f"a JSON {type(d).__name__}"
    return UsageError(f"{path} is not {what} ({keys}): pass the file that {writer} wrote")


def read_plan(path: str) -> Plan:
    """The plan in ``path``, a file ``lightning-sac plan --json`` wrote.

    Raises:
        UsageError: No such file, or not a plan's JSON.
    """
    what, writer = "a plan", "lightning-sac plan ... --json FILE"
    d = _read_json(path, what, writer)
    try:
        return Plan.from_dict(d)
    except (KeyError, TypeError, AttributeError, ValueError):
        raise _mismatch(path, what, writer, d) from None


def read_profile(path: str, plan: Plan) -> ModelProfile:
    """The profile in ``path``, a file ``lightning-sac plan --profile-json`` wrote, made for ``plan``'s model.

    Raises:
        UsageError: No such file, not a profile's JSON, or a profile of another model or batch than the plan's.
    """
    what, writer = "a profile", "lightning-sac plan ... --profile-json FILE"
    d = _read_json(path, what, writer)
    try:
        profile = ModelProfile.from_dict(d)
    except (KeyError, TypeError, AttributeError, ValueError):
        raise _mismatch(path, what, writer, d) from None
    if plan.fingerprint and profile_fingerprint(profile) != plan.fingerprint:
        raise UsageError(
            f"{path} profiles another model or batch than the plan's (fingerprints differ): pass the --profile-json "
            "file written by the same lightning-sac plan command as the plan"
        )
    return profile
