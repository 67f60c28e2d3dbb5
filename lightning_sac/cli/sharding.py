"""The command line's sharding: how many devices, DDP or FSDP, and which modules are FSDP's units.

``--fsdp N`` divides parameters, gradients and optimizer state over ``N`` devices; with ``--fsdp-units PATTERN``
the plan also counts what FSDP2 gathers, unit by unit, as a sharded training run does
(:func:`lightning_sac.sharding.declared.declared_layout`). Without units a sharded plan divides the states evenly
and gathers nothing: it misses each unit's gathered parameters, so the plan says so.
"""

from __future__ import annotations

import argparse
from typing import Any

from torch import nn

from lightning_sac.cli.args import UsageError, notice
from lightning_sac.dryrun import ModelProfile
from lightning_sac.sharding import declared_layout, declared_units

__all__ = ["add_sharding_arguments", "check_units", "declare_units"]


def add_sharding_arguments(parser: argparse.ArgumentParser) -> None:
    """``--world-size``, ``--sharding``, ``--fsdp`` and ``--fsdp-units``."""
    parser.add_argument("--world-size", type=int, default=1, help="number of devices the step runs on")
    parser.add_argument(
        "--sharding",
        choices=["replicated", "sharded"],
        default="replicated",
        help="replicated (DDP: every device holds all parameters, gradients, optimizer state) or sharded (FSDP: "
        "those divided over --world-size devices)",
    )
    parser.add_argument(
        "--fsdp",
        type=int,
        default=None,
        metavar="N",
        help="FSDP over N devices: the same as --world-size N --sharding sharded",
    )
    parser.add_argument(
        "--fsdp-units",
        nargs="+",
        default=None,
        metavar="PATTERN",
        help="the modules your script passes to fully_shard before the root (fqn globs whose * is one part of a "
        "name, such as 'model.layers.*', or class names such as LlamaDecoderLayer): the plan counts each unit's "
        "gathered parameters as FSDP2 holds them; needs --fsdp N",
    )


def check_units(args: Any, model: nn.Module) -> None:
    """Before the dry run: ``--fsdp-units`` needs sharding, and each pattern must name a module of ``model``.

    Raises:
        UsageError: ``--fsdp-units`` without sharding, or a pattern naming no module.
    """
    patterns = getattr(args, "fsdp_units", None)
    if patterns is None:
        return
    if args.sharding != "sharded":
        raise UsageError(
            f"--fsdp-units {' '.join(patterns)} names FSDP units, but the plan is not sharded: add --fsdp N "
            "(FSDP over N devices)"
        )
    try:
        declared_units(model, patterns)
    except ValueError as err:
        raise UsageError(f"--fsdp-units: {err}") from err


def declare_units(args: Any, model: nn.Module, profile: ModelProfile) -> None:
    """Give ``profile`` the FSDP2 units ``--fsdp-units`` names; say when a sharded plan has none.

    Raises:
        UsageError: ``--fsdp-units`` without sharding, or a pattern naming no module.
    """
    patterns = getattr(args, "fsdp_units", None)
    if patterns is None:
        if args.sharding == "sharded" and profile.sharded is None:
            notice(
                "sharded without FSDP units: parameters, gradients and optimizer state are divided evenly and no "
                "unit's gathered parameters are counted; name your fully_shard modules with --fsdp-units PATTERN "
                "(e.g. --fsdp-units 'model.layers.*') for what each device really holds"
            )
        return
    check_units(args, model)
    try:
        units = declared_units(model, patterns)
        profile.sharded = declared_layout(model, patterns, args.world_size)
    except ValueError as err:
        raise UsageError(f"--fsdp-units: {err}") from err
    notice(
        f"FSDP2 over {args.world_size} devices: {len(profile.sharded.units)} units ({len(units)} modules matching "
        "--fsdp-units, and the root holding the other parameters)"
    )
