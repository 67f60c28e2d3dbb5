"""The command line's sharding: how many devices, DDP or FSDP, which modules are FSDP's units, tensor parallelism.

``--fsdp N`` divides parameters, gradients and optimizer state over ``N`` devices; with ``--fsdp-units PATTERN``
the plan also counts what FSDP2 gathers, unit by unit, as a sharded training run does
(:func:`lightning_sac.sharding.declared.declared_layout`). Without units a sharded plan divides the states evenly
and gathers nothing: it misses each unit's gathered parameters, so the plan says so.

``--tp T`` plans one of ``T`` tensor-parallel ranks: the linears a plan names (``--tp-plan``, or a Hugging Face
model's own ``base_model_tp_plan``) split as ``parallelize_module``'s ``ColwiseParallel()``/``RowwiseParallel()``
split them, with the collectives' buffers (:func:`lightning_sac.sharding.declared_tensor_parallel`); with ``--fsdp
N`` the FSDP2 units shard the rank's TP-local parameters over the ``N`` data-parallel ranks (``N x T`` devices).
"""

from __future__ import annotations

import argparse
from typing import Any

from torch import nn

from lightning_sac.cli.args import UsageError, notice
from lightning_sac.dryrun import ModelProfile
from lightning_sac.sharding import DECLARED_STYLES, declared_layout, declared_tensor_parallel, declared_units

__all__ = ["add_sharding_arguments", "check_units", "declare_units", "tensor_parallel_model"]


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
    parser.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="T",
        help="tensor parallel over T devices: plan one rank, its linears split as parallelize_module's "
        "ColwiseParallel()/RowwiseParallel() split them (with --fsdp N: N x T devices, FSDP2 over the N)",
    )
    parser.add_argument(
        "--tp-plan",
        nargs="+",
        default=None,
        metavar="PATTERN=STYLE",
        help="which linears --tp splits, each PATTERN (as for --fsdp-units) =colwise or =rowwise, e.g. "
        "'model.layers.*.mlp.up_proj=colwise'; default: a Hugging Face model's own base_model_tp_plan",
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


def _tp_styles(args: Any, model: nn.Module) -> tuple[dict[str, str], str]:
    """``{fqn: style}`` of ``--tp-plan`` or the model's ``base_model_tp_plan``, and where they came from."""
    entries: list[tuple[str, str]]
    if args.tp_plan is not None:
        entries = [tuple(e.split("=", 1)) if "=" in e else (e, "") for e in args.tp_plan]
        source = "--tp-plan"
    else:
        hf_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
        if not hf_plan:
            raise UsageError(
                f"--tp {args.tp} needs to know which linears to split: this model has no Hugging Face "
                "base_model_tp_plan; name them with --tp-plan PATTERN=colwise|rowwise (e.g. "
                "--tp-plan 'model.layers.*.mlp.up_proj=colwise' 'model.layers.*.mlp.down_proj=rowwise')"
            )
        prefix = getattr(model, "base_model_prefix", "")
        prefix = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
        entries = [(prefix + pattern, style) for pattern, style in hf_plan.items()]
        source = "the model's base_model_tp_plan"
    styles: dict[str, str] = {}
    for pattern, style in entries:
        if style not in DECLARED_STYLES:
            raise UsageError(
                f"--tp: {pattern!r} is split {style!r} in {source}; AutoSAC models 'colwise' and 'rowwise' linears "
                "(parallelize_module's ColwiseParallel() and RowwiseParallel()); give --tp-plan PATTERN=colwise or "
                "PATTERN=rowwise for each linear to split"
            )
        try:
            styles.update((fqn, style) for fqn in declared_units(model, [pattern]))
        except ValueError as err:
            raise UsageError(f"--tp-plan: {err}") from err
    return styles, source


def tensor_parallel_model(args: Any, model: nn.Module) -> nn.Module:
    """The model as one ``--tp`` rank computes it (``model`` itself without ``--tp``); before the dry run.

    Raises:
        UsageError: ``--tp`` below 2, ``--tp-plan`` without ``--tp``, no plan to split by, a style other than
            colwise and rowwise, a pattern naming no module or not a linear, or a size that does not divide one.
    """
    if args.tp is None:
        if args.tp_plan is not None:
            raise UsageError(
                f"--tp-plan {' '.join(args.tp_plan)} names what to split, but no --tp T says over how many"
            )
        return model
    if args.tp < 2:
        raise UsageError(f"--tp T is tensor parallelism over T devices, at least 2, got {args.tp}")
    styles, source = _tp_styles(args, model)
    try:
        local = declared_tensor_parallel(model, styles, args.tp)
    except ValueError as err:
        raise UsageError(f"--tp {args.tp}: {err}") from err
    cols = sum(s == "colwise" for s in styles.values())
    notice(
        f"tensor parallel over {args.tp} devices ({source}): {cols} linears column-parallel, {len(styles) - cols} "
        "row-parallel; the plan is one rank's"
    )
    return local
