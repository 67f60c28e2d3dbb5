"""The command line's checks of what the user typed, all made before any profiling.

Each wrong input raises a :class:`UsageError` whose message is one line: what was wrong and what to type instead.
``lightning-sac`` prints it and exits with code 2; only ``--debug`` shows a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import math
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from lightning_sac.devices import DeviceSpec, UnknownDeviceError, device_mismatch_message, get_device_spec

__all__ = [
    "CliParser",
    "Made",
    "UsageError",
    "call_factory",
    "check_plan_args",
    "closest",
    "load_factory",
    "notice",
    "parse_budget",
    "split_target",
]

_FACTORY_SHAPE = "(model, example_inputs[, loss_fn[, optimizer_factory]])"
# GiB per unit a user may write after the number: "80GB" and "80G" mean the marketing figure, 80 GiB of device.
_UNITS = {"k": 2**-20, "m": 2**-10, "g": 1.0, "t": 2**10}
_WITH_UNIT = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)\s*([kmgt])(?:i?b)?\s*$", re.IGNORECASE)


class UsageError(Exception):
    """A wrong input: its message is one line saying what was wrong and what to type instead."""


class CliParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage block) ending with where the help is."""

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE`` and exit with code 2."""
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def notice(text: str) -> None:
    """One line on stderr, prefixed with the program's name."""
    print(f"lightning-sac: {text}", file=sys.stderr)


def _number(value: float) -> str:
    return f"{value:.4g}" if value < 1e4 else f"{value:.0f}"


def parse_budget(text: str) -> float:
    """The value of ``--budget-gb``: a finite number of GiB above 0, without a unit.

    Raises:
        UsageError: A unit string (``"80GB"``: the message gives the number to type), no number, or not above 0.
    """
    with_unit = _WITH_UNIT.match(text)
    if with_unit:
        gib = float(with_unit.group(1)) * _UNITS[with_unit.group(2).lower()]
        raise UsageError(
            f"--budget-gb takes a number of GiB without a unit, got {text!r}: type --budget-gb {_number(gib)}"
        )
    try:
        value = float(text)
    except ValueError:
        raise UsageError(
            f"--budget-gb takes a number of GiB (the memory one device may use), got {text!r}: e.g. --budget-gb 40"
        ) from None
    if not (math.isfinite(value) and value > 0):
        raise UsageError(
            f"--budget-gb must be a number of GiB above 0, got {text!r}: type the memory one device may use, "
            "e.g. --budget-gb 40 (see the GiB column of: lightning-sac devices)"
        )
    return value


def _squash(name: str) -> str:
    return re.sub(r"[-_ ]", "", name).lower()


def closest(word: str, choices: Sequence[str]) -> str | None:
    """The choice ``word`` most likely misspells (ignoring case, ``-``, ``_`` and spaces), or ``None``."""
    by_key = {_squash(c): c for c in choices}
    match = difflib.get_close_matches(_squash(word), list(by_key), n=1, cutoff=0.6)
    return by_key[match[0]] if match else None


def _device(name: str | None, notes: list[str]) -> DeviceSpec:
    if name is None:
        spec = get_device_spec("auto")
        if spec.is_cuda:
            notes.append(
                f"planning for this machine's GPU, {spec.name} (no --device given); pass --device NAME to plan for "
                "another (list them with: lightning-sac devices)"
            )
        else:
            notes.append(
                "planning for this machine's CPU (no --device given); pass --device H100-SXM to plan for a GPU "
                "(list them with: lightning-sac devices)"
            )
        return spec
    try:
        return get_device_spec(name)
    except UnknownDeviceError as err:
        # The API's matcher decides (a family or a model's other name lists its entries, never another GPU);
        # only the wording of the remedy is the command line's.
        if err.match is None:
            raise UsageError(str(err)) from None
        raise UsageError(device_mismatch_message(err.match, cli=True)) from None


def _check_output(flag: str, path: str | None) -> None:
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{flag} {path} is a folder: name a file in it, e.g. {flag} {target / 'plan.json'}")
    if not target.parent.is_dir():
        raise UsageError(
            f"{flag} {path}: there is no folder {str(target.parent)!r}; create it first, or name a file here"
        )


def check_plan_args(args: argparse.Namespace) -> tuple[DeviceSpec, list[str]]:
    """Check ``lightning-sac plan``'s arguments (converting ``args.budget_gb``).

    Returns:
        The target device, and the lines to print once the factory loaded too: which device it plans for when
        ``--device`` is not given, and a warning when the budget is more than the device's memory.

    Raises:
        UsageError: The first wrong input.
    """
    hf_config = getattr(args, "hf_config", None)
    if args.factory is not None and hf_config is not None:
        raise UsageError(
            f"give a factory ({args.factory}) or --hf-config ({hf_config}), not both: the model comes from one of them"
        )
    if args.factory is None and hf_config is None:
        raise UsageError(
            "no model to plan: give MODULE:FACTORY (e.g. lightning-sac plan mymodule:make) or --hf-config "
            "path/to/config.json --batch 8 --seq 4096"
        )
    if args.factory is not None:
        split_target(args.factory)
    args.budget_gb = parse_budget(args.budget_gb)
    fsdp = getattr(args, "fsdp", None)
    if fsdp is not None:
        if fsdp < 2 or args.world_size not in (1, fsdp):
            raise UsageError(
                f"--fsdp {fsdp} means FSDP over {fsdp} devices (--world-size {fsdp} --sharding sharded): it needs "
                f"at least 2 devices and no other --world-size (got {args.world_size}); give one of the two"
            )
        args.world_size, args.sharding = fsdp, "sharded"
    if args.world_size < 1:
        raise UsageError(
            f"--world-size is the number of devices, at least 1, got {args.world_size}: e.g. --world-size 8"
        )
    if args.sharding == "sharded" and args.world_size == 1:
        raise UsageError(
            "--sharding sharded divides parameters, gradients and optimizer state over several devices, but the "
            "world size is 1: add --world-size N (N devices), or leave out --sharding sharded"
        )
    if args.n_segments < 1:
        raise UsageError(f"--n-segments must be at least 1, got {args.n_segments}: e.g. --n-segments 2")
    if args.candidates is not None and not args.candidates:
        raise UsageError("--candidates needs at least one module name pattern: e.g. --candidates 'blocks.*'")
    _check_output("--json", args.json)
    _check_output("--profile-json", args.profile_json)
    notes: list[str] = []
    spec = _device(args.device, notes)
    if args.budget_gb > spec.memory_gib:
        what = f"one {spec.name}" if args.device is not None else f"this machine ({spec.name})"
        notes.append(
            f"warning: --budget-gb {_number(args.budget_gb)} is more than the {spec.memory_gib:.1f} GiB of {what}; "
            f"a plan for it may not fit on the device (at most --budget-gb {math.floor(spec.memory_gib * 10) / 10:g})"
        )
    return spec, notes


def _where(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "unknown place"


def _import(module_name: str, target: str) -> Any:
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise UsageError(f"no file {module_name!r} (from {os.getcwd()}): check the path in {target}")
        # Like `python path/to/file.py`: its folder comes first on sys.path, so its own imports resolve.
        sys.path.insert(0, str(path.resolve().parent))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None  # a .py file always has a loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
        return module
    # Like `python -m`: the current folder first on sys.path, so that `mymodule:make` finds ./mymodule.py.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not (module_name == err.name or module_name.startswith(err.name + ".")):
            raise  # the module exists and one of its own imports failed: the caller reports that
        local = [p.stem for p in Path.cwd().glob("*.py")]
        guess = closest(module_name, local)
        hint = f"did you mean {guess}? " if guess else ""
        raise UsageError(
            f"no module {module_name!r} in this folder ({os.getcwd()}) or on the Python path: {hint}"
            f"run from the folder that holds {module_name.replace('.', '/')}.py, or give its path: "
            f"path/to/{module_name.rsplit('.', 1)[-1]}.py:FACTORY"
        ) from None


def split_target(target: str) -> tuple[str, str]:
    """``MODULE:FACTORY`` as ``(MODULE, FACTORY)``.

    Raises:
        UsageError: Not of that form.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        example = f"{module_name or target}:make" if target.endswith(".py") else "mymodule:make"
        raise UsageError(
            f"expected MODULE:FACTORY, got {target!r}: e.g. lightning-sac plan {example} for a function make() "
            "in mymodule.py of this folder (or lightning_sac.demos:gpt_example)"
        )
    return module_name, attr


def load_factory(target: str) -> Callable[[], Any]:
    """Import ``MODULE:FACTORY`` (a module, found from the current folder as ``python -m`` would, or a ``.py``).

    Raises:
        UsageError: No ``:``, no such module or file, its import failed, or it has no such function.
    """
    module_name, attr = split_target(target)
    try:
        module = _import(module_name, target)
    except UsageError:
        raise
    except Exception as err:
        raise UsageError(
            f"importing {module_name} failed: {type(err).__name__}: {err} ({_where(err)}); "
            "rerun with --debug for the traceback"
        ) from err
    if not hasattr(module, attr):
        own = sorted(
            n
            for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        guess = closest(attr, own)
        hint = f"did you mean {module_name}:{guess}? " if guess else ""
        listed = f"its functions: {', '.join(own[:8])}" if own else "it defines no function"
        raise UsageError(f"{module_name} has no {attr!r}: {hint}{listed}")
    factory = getattr(module, attr)
    if not callable(factory):
        raise UsageError(f"{target} is a {type(factory).__name__}, not a function returning {_FACTORY_SHAPE}")
    return factory


@dataclass
class Made:
    """What a factory returned, with the optional parts filled in with ``None``."""

    model: Any
    inputs: Any
    loss_fn: Any = None
    optimizer_factory: Any = None


def call_factory(target: str) -> Made:
    """Load and call the factory ``target`` names; check what it returns.

    Raises:
        UsageError: It cannot be loaded, raised, or returned something else than the expected tuple.
    """
    factory = load_factory(target)
    try:
        made = factory()
    except Exception as err:
        raise UsageError(
            f"{target}() raised {type(err).__name__}: {err} ({_where(err)}); rerun with --debug for the traceback"
        ) from err
    if not isinstance(made, tuple) or not 2 <= len(made) <= 4:
        got = f"a tuple of {len(made)}" if isinstance(made, tuple) else f"a {type(made).__name__}"
        raise UsageError(f"{target}() returned {got}: it must return {_FACTORY_SHAPE}")
    result = Made(*made)
    if not hasattr(result.model, "named_modules"):
        raise UsageError(
            f"{target}() returned a {type(result.model).__name__} first: the model, a torch.nn.Module, comes first "
            f"in {_FACTORY_SHAPE}"
        )
    if not isinstance(result.inputs, tuple | dict):
        # Checked here, not in the dry run: a wrong input is the user's to fix, exit 2 like the others.
        hint = " (for a single tensor x return (x,))" if hasattr(result.inputs, "shape") else ""
        raise UsageError(
            f"{target}() returned a {type(result.inputs).__name__} as the example inputs: they must be a tuple of "
            f"positional inputs (model(*inputs)) or a dict of keyword inputs (model(**inputs)){hint}"
        )
    return result
