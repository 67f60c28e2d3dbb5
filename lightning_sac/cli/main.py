"""``lightning-sac``: plan checkpointing for a model from the command line, and list the device table.

    lightning-sac plan MODULE:FACTORY --budget-gb 40 --device H100-SXM [--world-size 8 --sharding sharded]
                       [--optimizer adamw|adam|sgd|none] [--loss output.loss|sum] [--json plan.json]
    lightning-sac plan --hf-config config.json --batch 8 --seq 4096 --budget-gb 70 [--lora r=16,targets=q_proj,v_proj]
    lightning-sac report plan.json --profile profile.json --out runs/plan
    lightning-sac devices

``MODULE`` is found from the current folder as ``python -m`` finds it (``mymodule:make`` for ``./mymodule.py``),
or is a path to a ``.py`` file. A wrong input gets one line on stderr saying what to type instead and exit code 2,
checked before any profiling (:mod:`lightning_sac.cli.args`, :mod:`lightning_sac.cli.checks`); ``--debug`` shows
the traceback instead.

Built the way accelerate builds ``estimate-memory``: ``gather_*`` functions return data, ``render_*`` functions
turn it into text, and each command's parser comes from ``*_command_parser(subparsers=None)``.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_sac.cli.args import CliParser, UsageError, call_factory, check_plan_args, load_factory, notice
from lightning_sac.cli.hf_config import add_hf_arguments, check_hf_args, hf_made
from lightning_sac.cli.sharding import add_sharding_arguments, check_units, declare_units, tensor_parallel_model
from lightning_sac.cli.step import TrainingStep, add_step_arguments, training_step
from lightning_sac.devices import DEVICE_SPECS, DeviceSpec
from lightning_sac.errors import BudgetError, LightningSACError
from lightning_sac.plan import BACKENDS, Plan, plan_unit

if TYPE_CHECKING:
    from lightning_sac.dryrun import ModelProfile

# The dry run, the solver and their checks are imported by the commands that run them, so that
# `lightning-sac --help` and `lightning-sac devices` start at the cost of `import torch`.

__all__ = [
    "devices_command_parser",
    "gather_devices",
    "gather_plan",
    "gather_report",
    "load_factory",
    "main",
    "plan_command_parser",
    "render_devices",
    "render_plan",
    "report_command_parser",
]


def _profile(
    model: Any, inputs: Any, step: TrainingStep, device: str | DeviceSpec, estimate: str, replace_existing: bool
) -> ModelProfile:
    from lightning_sac.profiling import profile_model

    return profile_model(
        model,
        inputs,
        loss_fn=step.loss,
        optimizer_factory=step.optimizer_factory,
        device=device,
        estimate=estimate,
        replace_existing=replace_existing,
    )


def gather_plan(
    target: str,
    *,
    budget_gb: float,
    device: str | DeviceSpec = "auto",
    world_size: int = 1,
    sharding: str = "replicated",
    estimate: str = "roofline",
    candidates: Sequence[str] | None = None,
    n_segments: int = 2,
    backend: str = "sac",
    replace_existing: bool = False,
    optimizer: str | None = None,
    loss: str | None = None,
) -> tuple[ModelProfile, Plan]:
    """Profile the factory's model and solve a plan; return both.

    The factory returns ``(model, example_inputs)``, optionally followed by ``loss_fn`` and
    ``optimizer_factory``, as :func:`~lightning_sac.profile_model` takes them: ``example_inputs`` is a tuple of
    positional inputs or a dict of keyword inputs (a tokenized Hugging Face batch). ``optimizer`` and ``loss`` are
    ``--optimizer`` and ``--loss`` (:func:`lightning_sac.cli.step.training_step` says who decides when not given).

    Raises:
        UsageError: The factory cannot be loaded or returns something else, or the step has no loss.
        BudgetError: The budget is below the minimum achievable peak (the Python API's message).
    """
    from lightning_sac.solver import solve_plan

    made = call_factory(target)
    step = training_step(made, optimizer, loss)
    profile = _profile(made.model, made.inputs, step, device, estimate, replace_existing)
    plan = solve_plan(
        profile,
        budget_gb,
        world_size=world_size,
        sharding=sharding,
        candidates=candidates,
        n_segments=n_segments,
        backend=backend,
    )
    return profile, plan


def render_plan(profile: ModelProfile, plan: Plan, about: Sequence[str] = ()) -> str:
    """The profile's step time and tensors at its peak (one device, no plan, unsharded), then the plan's table.

    One unit for both. The header's figure is the step's tensors alone (the profile knows no budget, so no
    reserve); every peak after it is the plan's device total, the reserve inside it.

    ``about`` are lines printed first: which model and which training step were planned.
    """
    unit = plan_unit(plan, [profile.peak_bytes, *profile.peak_breakdown.values()])
    zero = unit.value(0)
    shown = {k.replace("_", " "): unit.value(v) for k, v in profile.peak_breakdown.items()}
    parts = ", ".join(f"{k} {v}" for k, v in shown.items() if v != zero)
    parts = f" ({parts})" if parts else ""  # a model too small to show in the unit: no empty brackets
    header = (
        f"profile of one training step on {profile.device.name}, one device holding the whole model, no plan: "
        f"step {profile.step_ms:.3f} ms, tensors at the peak {unit(profile.peak_bytes)}{parts}"
    )
    return "\n".join([*about, header, plan.table(unit)])


def gather_devices() -> list[DeviceSpec]:
    """Every device of the table, in name order."""
    return [DEVICE_SPECS[name] for name in sorted(DEVICE_SPECS)]


def render_devices(specs: Sequence[DeviceSpec]) -> str:
    """A table of the devices: memory, dense throughput per dtype, bandwidth, allocator rounding."""
    keys = ["fp32", "tf32", "bf16", "fp16", "fp8"]
    header = f"{'device':<12} {'GiB':>7} " + " ".join(f"{k + ' TF/s':>10}" for k in keys) + f" {'GB/s':>7} {'round':>6}"
    lines = [header, "-" * len(header)]
    for s in specs:
        flops = " ".join(f"{s.tflops[k]:>10.1f}" if k in s.tflops else f"{'-':>10}" for k in keys)
        lines.append(f"{s.name:<12} {s.memory_gib:>7.1f} {flops} {s.dram_gbps:>7.0f} {s.allocator_rounding:>6}")
    return "\n".join(lines)


def _plan_command(args: argparse.Namespace) -> int:
    from lightning_sac.cli.checks import budget_message, check_candidates, check_checkpointable
    from lightning_sac.solver import solve_plan

    spec, notes = check_plan_args(args)
    hf = check_hf_args(args)
    made, about = hf_made(hf) if hf is not None else (call_factory(args.factory), None)
    check_candidates(args.candidates, made.model)
    check_units(args, made.model)  # before the dry run, which a wrong pattern would only make the user wait for
    model = tensor_parallel_model(args, made.model)  # one tensor-parallel rank's model with --tp
    for note in notes:  # after every check, so that a wrong input gets its one line alone
        notice(note)
    step = training_step(made, args.optimizer, args.loss)
    profile = _profile(model, made.inputs, step, spec, args.estimate, args.replace_existing)
    declare_units(args, model, profile)
    check_checkpointable(args.candidates, profile, args.n_segments, args.backend)
    try:
        plan = solve_plan(
            profile,
            args.budget_gb,
            world_size=args.world_size,
            sharding=args.sharding,
            candidates=args.candidates,
            n_segments=args.n_segments,
            backend=args.backend,
        )
    except BudgetError as err:
        raise UsageError(budget_message(err, args, profile)) from err
    print(render_plan(profile, plan, [line for line in (about, step.describe()) if line]))
    if args.json:
        Path(args.json).write_text(plan.to_json(indent=1))
        print(f"plan written to {args.json}")
    if args.profile_json:
        Path(args.profile_json).write_text(profile.to_json())
        print(f"profile written to {args.profile_json}")
    return 0


def gather_report(plan_path: str, profile_path: str | None, out: str, *, figures: bool = True) -> list[str]:
    """Write the plan's TensorBoard panels (figures need the profile) to ``out``; return the event files.

    Raises:
        UsageError: A file is missing, is not a plan's (profile's) JSON, or the profile is of another model.
    """
    from torch.utils.tensorboard import SummaryWriter

    from lightning_sac.cli.checks import read_plan, read_profile

    plan = read_plan(plan_path)
    profile = read_profile(profile_path, plan) if profile_path else None

    from lightning_sac.report import log_plan

    writer = SummaryWriter(out)
    try:
        log_plan(writer, plan, profile, figures=figures)
    finally:
        writer.close()
    return sorted(str(p) for p in Path(out).glob("events.out.tfevents.*"))


def _report_command(args: argparse.Namespace) -> int:
    files = gather_report(args.plan, args.profile, args.out, figures=not args.no_figures)
    print(f"wrote {len(files)} event file(s) to {args.out}; open them with: tensorboard --logdir {args.out}")
    return 0


def _devices_command(args: argparse.Namespace) -> int:
    print(render_devices(gather_devices()))
    return 0


def _parser(subparsers: Any, name: str, description: str) -> argparse.ArgumentParser:
    """A sub-command's parser: under ``lightning-sac`` when ``subparsers`` is given, standalone otherwise."""
    if subparsers is not None:
        parser: argparse.ArgumentParser = subparsers.add_parser(name, description=description, help=description)
    else:
        parser = CliParser(f"lightning-sac {name}", description=description)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    return parser


def plan_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The parser of ``lightning-sac plan``."""
    description = "Profile a model on fake tensors for a target device and print the cheapest checkpointing plan."
    parser = _parser(subparsers, "plan", description)
    parser.add_argument(
        "factory",
        nargs="?",
        default=None,
        help="MODULE:FACTORY returning (model, example_inputs[, loss_fn[, optimizer]]), inputs a tuple or a dict; "
        "MODULE is found from the current folder (mymodule:make for ./mymodule.py) or is a path (dir/mymodule.py:make)",
    )
    add_hf_arguments(parser)
    parser.add_argument("--budget-gb", required=True, help="memory budget per device, a number of GiB (e.g. 40)")
    parser.add_argument(
        "--device",
        default=None,
        help="target device, a name of `lightning-sac devices` (any case; H100-SXM, h100 sxm) or an alias (4090); "
        "a model with several entries (H100) lists them; default: this one",
    )
    add_sharding_arguments(parser)
    add_step_arguments(parser)
    parser.add_argument(
        "--estimate",
        choices=["roofline", "benchmark"],
        default="roofline",
        help="step times from the device's datasheet (roofline) or timed on this machine's CPU (benchmark)",
    )
    parser.add_argument("--candidates", nargs="*", default=None, help="fqn glob patterns of checkpoint units")
    parser.add_argument(
        "--n-segments", type=int, default=2, help="lines of each module's memory/recompute trade-off fit (default 2)"
    )
    parser.add_argument(
        "--backend", choices=BACKENDS, default="sac", help="how the plan will be applied (its recompute cost)"
    )
    parser.add_argument(
        "--replace-existing",
        action="store_true",
        help="plan as if the model's Hugging Face gradient checkpointing were off (applying the plan turns it off)",
    )
    parser.add_argument("--json", default=None, help="also write the plan to this JSON file")
    parser.add_argument("--profile-json", default=None, help="also write the profile (for `report` figures)")
    parser.set_defaults(func=_plan_command)
    return parser


def report_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The parser of ``lightning-sac report``."""
    description = "Write a plan's TensorBoard panels (plan table, peaks; figures with --profile) without training."
    parser = _parser(subparsers, "report", description)
    parser.add_argument("plan", help="plan JSON from `lightning-sac plan --json`")
    parser.add_argument("--profile", default=None, help="profile JSON from `lightning-sac plan --profile-json`")
    parser.add_argument("--out", required=True, help="TensorBoard log directory to write to")
    parser.add_argument("--no-figures", action="store_true")
    parser.set_defaults(func=_report_command)
    return parser


def devices_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The parser of ``lightning-sac devices``."""
    description = "List the target devices and their datasheet figures."
    parser = _parser(subparsers, "devices", description)
    parser.set_defaults(func=_devices_command)
    return parser


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lightning-sac`` command line; returns the exit code.

    Exit codes: 0 done; 2 a wrong input (arguments, files, the factory, a budget below the minimum), one line on
    stderr; 1 an unexpected failure, one line naming where it happened. ``--debug`` raises instead.
    """
    parser = CliParser("lightning-sac", description="Automatic selective activation checkpointing.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    plan_command_parser(subparsers)
    report_command_parser(subparsers)
    devices_command_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except (UsageError, LightningSACError, ValueError) as err:
        # What the user can fix: one line, no traceback (tracebacks with --debug).
        if args.debug:
            raise
        print(f"lightning-sac: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:
        if args.debug:
            raise
        where = traceback.extract_tb(err.__traceback__)[-1]
        print(
            f"lightning-sac: error: {type(err).__name__}: {_one_line(err)} ({where.filename}:{where.lineno}); "
            "rerun with --debug for the traceback",
            file=sys.stderr,
        )
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
