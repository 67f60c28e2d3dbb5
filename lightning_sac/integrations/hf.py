"""``AutoSACCallback``: AutoSAC's plan for a Hugging Face ``Trainer`` fine-tune, before its first step.

The callback sees what the Trainer hands every callback (the model, its optimizer and the prepared training
dataloader), never the Trainer itself: the step it dry-runs is the Trainer's default one, ``model(**batch).loss``,
with the Trainer's optimizer, mixed precision (``bf16``/``fp16``) and ``gradient_accumulation_steps``. A Trainer
subclass with its own ``compute_loss`` passes itself, ``AutoSACCallback(..., trainer=trainer)`` (or
``callback.trainer = trainer`` after building it), and its ``compute_loss`` is dry-run instead.

Messages go through the Trainer's logging: the ``transformers`` logger, so ``TrainingArguments(log_level="info")``
shows the plan table (an over-budget measurement is a warning at any level); with ``report_to="tensorboard"`` the
plan's panels and the measured step are written beside the Trainer's own events, under ``runs/lightning_sac``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.utils import logging
except ImportError as err:  # an optional extra: say how to get it
    raise ImportError(
        "lightning_sac.integrations.hf needs the Hugging Face Trainer: pip install 'lightning-sac[hf]' "
        f"(transformers and accelerate). ({err})"
    ) from err

from lightning_sac.apply import PlanHandle, apply_plan
from lightning_sac.devices import DeviceSpec
from lightning_sac.dryrun import MemoryTimeline, ModelProfile, placeholder_message
from lightning_sac.errors import ProfilingError
from lightning_sac.integrations.measure import LoopMeasurement
from lightning_sac.integrations.planner import LoopStep, PlanSettings, first_batch, plan_for_step, plan_json, plan_of
from lightning_sac.integrations.shapes import ShapeWatch, planned_shapes
from lightning_sac.lightning import broadcast_from_rank_zero, measured_verdict, own_checkpointing_message, plan_message
from lightning_sac.plan import Plan
from lightning_sac.report import PeakSeries

__all__ = ["AutoSACCallback"]

# Under the library's root logger: the Trainer's log_level and handlers apply to it.
logger = logging.get_logger("transformers.lightning_sac")


def accepts_loss_kwargs(model: torch.nn.Module) -> bool:
    """Whether the Trainer passes ``num_items_in_batch`` to ``model``'s forward (its test, ``Trainer.__init__``)."""
    unwrap = getattr(model, "get_base_model", None)  # PEFT's wrapper: the Trainer asks the model it wraps
    base = unwrap() if callable(unwrap) else model
    if hasattr(base, "accepts_loss_kwargs"):
        return bool(base.accepts_loss_kwargs)
    params = inspect.signature(base.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


def num_items_in_batch(batch: Any) -> torch.Tensor | None:
    """What the Trainer passes as ``num_items_in_batch`` for a batch with labels: a float scalar on its device.

    Its value (the label tokens of the accumulation cycle) changes no tensor's size; the argument's presence does
    change the code path of some models (T5 builds its cross-attention cache with it), so the dry run passes it.
    """
    labels = batch.get("labels") if isinstance(batch, dict) else None
    return labels.ne(-100).sum() / 1 if isinstance(labels, torch.Tensor) else None


def model_output_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The Trainer's default loss: ``model(**batch)``'s ``loss``, with ``num_items_in_batch`` where it passes one.

    Raises:
        ProfilingError: The batch is not a mapping, or the model returned no loss.
    """
    if not isinstance(batch, dict):
        raise ProfilingError(
            f"AutoSACCallback dry-runs model(**batch) as the Trainer does, but the batch is a {type(batch).__name__}, "
            "not a dict; pass trainer=trainer if your Trainer computes its loss otherwise."
        )
    items = num_items_in_batch(batch) if accepts_loss_kwargs(model) else None
    out = model(**batch) if items is None else model(**batch, num_items_in_batch=items)
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ProfilingError(
            f"{type(model).__name__}(**batch) returned no loss (the batch's keys: {sorted(batch)}): the Trainer's "
            "default step needs one (pass labels in the batch). A Trainer subclass with its own compute_loss: "
            "AutoSACCallback(..., trainer=trainer)."
        )
    return loss


def _check_launch(args: TrainingArguments) -> None:
    """Refuse what the callback does not plan for, before anything runs."""
    if args.fsdp or args.deepspeed:
        raise ValueError(
            "AutoSACCallback plans single-process and DDP training; this Trainer runs FSDP or DeepSpeed "
            f"(fsdp={args.fsdp!r}, deepspeed={args.deepspeed!r}). Train without them, or use AutoSAC with "
            "Lightning's FSDP strategies (lightning_sac.AutoSAC), or remove the callback."
        )


class AutoSACCallback(TrainerCallback):
    """Fit a Hugging Face ``Trainer``'s training into a memory budget: plan and apply selective checkpointing.

    In ``on_train_begin`` (the optimizer, scheduler and DDP wrapper exist), process 0 dry-runs one training step
    on fake tensors and solves for the cheapest plan within the budget; every process applies the identical plan
    to the model. At the end of training the model's modules get their own ``forward`` back. The arguments are
    :class:`~lightning_sac.AutoSAC`'s where they apply; and:

    Args:
        budget_gb: Memory budget per device, GiB.
        budget_fraction: Or: the budget as a fraction of the target device's memory.
        device: Target device name or ``DeviceSpec``; default the Trainer's device.
        estimate: ``"roofline"`` or ``"benchmark"`` (CPU only).
        candidates: Module classes or fqn glob patterns allowed as checkpoint units.
        backend: ``"sac"`` or ``"graph"``.
        n_segments: Lines of each module's trade-off fit.
        solver_time_limit_s: HiGHS time limit.
        strict: ``True``: a budget below the minimum, or a step that cannot be dry-run, stops training before its
            first step. ``False``: warn, then apply the minimum-memory plan, or train without a plan.
        example_batch: The batch to plan for (a dict, as the Trainer passes it to the model), instead of the first
            batch of the training dataloader.
        log_figures: Write the plan's figures to TensorBoard (with ``report_to="tensorboard"``).
        measure: Profile the second optimizer step with torch.profiler and compare its peak with the budget.
        replace_existing: Let the plan replace the model's own ``gradient_checkpointing`` (off while applied).
        report_only: Plan and report, apply nothing.
        trainer: The ``Trainer``, for one whose ``compute_loss`` is its own: the dry run calls it.

    Attributes:
        plan: The applied plan, after ``on_train_begin``.
        profile: The dry run's profile (process 0).
        measured: The measured step's memory timeline, when measured.
    """

    def __init__(
        self,
        budget_gb: float | None = None,
        *,
        budget_fraction: float | None = None,
        device: str | DeviceSpec | None = None,
        estimate: str = "roofline",
        candidates: Sequence[Any] | None = None,
        backend: str = "sac",
        n_segments: int = 2,
        solver_time_limit_s: float = 30.0,
        strict: bool = True,
        example_batch: Any = None,
        log_figures: bool = True,
        measure: bool = True,
        replace_existing: bool = False,
        report_only: bool = False,
        trainer: Any = None,
    ) -> None:
        self.settings = PlanSettings(
            budget_gb, budget_fraction, device, estimate, candidates, backend, n_segments, solver_time_limit_s, strict,
            replace_existing,
        )  # fmt: skip
        flags = {"log_figures": log_figures, "measure": measure, "report_only": report_only}
        self.settings.check(flags, example_batch)
        self.example_batch = example_batch
        self.log_figures = log_figures
        self.measure = measure
        self.report_only = report_only
        self.trainer = trainer
        self.plan: Plan | None = None
        self.profile: ModelProfile | None = None
        self.measured: MemoryTimeline | None = None
        self._handle: PlanHandle | None = None
        self._measurement = LoopMeasurement()
        self._watch = ShapeWatch({}, logger.warning)
        self._writer: Any = None
        self._peaks = PeakSeries()

    # ------------------------------------------------------------------ Trainer events
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Plan on process 0, hand every process the plan, apply it."""
        _check_launch(args)
        model, optimizer = kwargs["model"], kwargs.get("optimizer")
        step = LoopStep(
            self._compute_loss(),
            optimizer,
            autocast_dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None,
            accumulate=args.gradient_accumulation_steps,
            world_size=args.world_size,
            data_parallel=args.world_size > 1,
            compiled=bool(args.torch_compile),
            share=() if self.trainer is None else (self.trainer,),
        )
        rank_zero = args.process_index == 0
        loader = kwargs.get("train_dataloader")

        def make() -> dict[str, Any]:  # on process 0 alone: the others take no batch and wait for its plan
            batch = self.example_batch if self.example_batch is not None else first_batch(loader)
            return {"plan": plan_json(self._make_plan(model, batch, step, args)), "shapes": planned_shapes(batch)}

        payload = broadcast_from_rank_zero(rank_zero, make, _broadcast)
        self.plan = plan_of(payload)
        self._watch = ShapeWatch(payload["shapes"], logger.warning)
        self._peaks = PeakSeries()
        if self.plan is None:
            return
        if not self.report_only:
            self._handle = apply_plan(model, self.plan, backend=self.settings.backend)
            self._watch.attach(model)
        if rank_zero:
            logger.info(plan_message(self.plan, self.settings.backend, report_only=self.report_only))
            if self._tensorboard(args) is not None:
                self._peaks.plan(self._writer, self.plan, self.profile, state.global_step, figures=self.log_figures)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Start the profiler at the first optimizer step; open the measured window at the second."""
        if self._handle is None or not self.measure or self._measurement.failed or self.measured is not None:
            return
        if args.process_index != 0:
            return
        if not self._measurement.running:
            self._measurement.start()
        elif not self._measurement.in_window:
            self._measurement.begin(kwargs["model"], kwargs.get("optimizer"))

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Read the measured step once it ended; compare it with the budget."""
        if self._measurement.in_window and self.plan is not None:
            try:
                self.measured = self._measurement.end(str(args.device))
            except Exception as err:  # noqa: BLE001 - the measurement is a check beside training, never its end
                self._measurement.abandon(failed=True)
                logger.warning(
                    f"AutoSACCallback could not measure the planned step ({type(err).__name__}: {err}). Training goes "
                    "on with the plan; its prediction is not compared with a measurement."
                )
                return
            spec = self.settings.target(args.device)
            over, message = measured_verdict(self.plan, self.measured.peak_bytes, args.device.type, spec.is_cuda)
            (logger.warning if over else logger.info)(message)
            if self._writer is not None:
                self._peaks.measured(
                    self._writer, self.plan, state.global_step - 1, self.measured, figures=self.log_figures
                )

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Give the model its own forwards back; close the profiler and the writer."""
        if self._writer is not None and self.plan is not None and state.global_step > 0:
            self._peaks.fit_end(self._writer, self.plan, state.global_step - 1)
        self.remove()

    def remove(self) -> None:
        """Remove the plan from the model (``trainer.train()`` raised: the Trainer has no event for that)."""
        self._watch.detach()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._measurement.abandon()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # ------------------------------------------------------------------ planning
    def _compute_loss(self) -> Any:
        if self.trainer is None:
            return model_output_loss
        trainer = self.trainer

        def compute_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
            count = trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None
            items = num_items_in_batch(batch) if count else None
            return trainer.compute_loss(model, batch, num_items_in_batch=items)

        return compute_loss

    def _make_plan(self, model: torch.nn.Module, batch: Any, step: LoopStep, args: TrainingArguments) -> Plan | None:
        try:
            plan, self.profile = plan_for_step(model, batch, step, self.settings, args.device)
        except ProfilingError as err:
            if self.settings.strict:
                raise
            logger.warning(
                f"AutoSACCallback could not dry-run the training step, so training runs without a plan: {err}"
            )
            return None
        if self.profile.placeholders:
            logger.info(placeholder_message(self.profile.placeholders))
        own = own_checkpointing_message(self.profile)
        if own is not None:
            logger.info(own.replace("AutoSAC(replace_existing=True)", "AutoSACCallback(replace_existing=True)"))
        return plan

    def _tensorboard(self, args: TrainingArguments) -> Any:
        """Our ``SummaryWriter`` beside the Trainer's TensorBoard events (``None`` unless it reports to TensorBoard)."""
        if "tensorboard" not in (args.report_to or []):
            return None
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # Where the Trainer's TensorBoardCallback writes: $TENSORBOARD_LOGGING_DIR, else output_dir/runs/<run>.
            root = os.getenv("TENSORBOARD_LOGGING_DIR") or os.path.join(args.output_dir or ".", "runs")
            self._writer = SummaryWriter(os.path.join(root, "lightning_sac"))
        return self._writer


def _broadcast(obj: Any) -> Any:
    """``obj`` from process 0 on every process of the Trainer's process group (itself without one)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
