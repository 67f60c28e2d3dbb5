"""Fits of the strategy x precision x world-size matrix: plain, then AutoSAC at 80% of the plain per-rank peak.

Every rank of a cell is a process this harness starts itself (:func:`processes.start_ranks`, gloo), with the
environment Lightning reads for processes created outside it (``LOCAL_RANK``, ``WORLD_SIZE``, ...), so the same
processes run the plain fit and the planned one. The model is a Hugging Face Llama decoder (tiny config) in the
usual LightningModule; under FSDP2 ``configure_model`` shards each decoder layer and then the model with
``fully_shard`` (``fsdp2-mp``: with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, as
torchtitan does; ``fsdp2-keep``: ``reshard_after_forward=False``; ``fsdp2-reshard2``: ``reshard_after_forward=2``
(each rank keeps half of a unit's gathered parameters from forward to backward); ``hsdp``: over a 2 x (world / 2)
replicate x shard mesh), under FSDP1 Lightning's ``FSDPStrategy`` wraps each decoder layer. Each rank's batch peaks
come from :class:`fit_harness.BatchPeaks` (torch.profiler, started after sharding), independently of AutoSAC.

Lightning refuses ``FSDPStrategy`` on CPU (``type(strategy) is FSDPStrategy`` and a CPU accelerator) and FSDP1
itself needs ``device_id`` on CPU; :class:`CPUFSDPStrategy` passes ``device_id=cpu`` and, being a subclass, is
not refused. Nothing else differs from what ``FSDPStrategy`` does.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from fit_harness import BatchPeaks
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from processes import start_ranks
from torch.utils.data import DataLoader
from zoo import lm_batch

from lightning_sac import AutoSAC

__all__ = ["CPUFSDPStrategy", "CellResult", "LlamaModule", "run_cells", "tiny_llama"]

STEPS = 2  # the plan is applied from the first step; the second has the previous step's gradients and optimizer state


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy with FSDP1's ``device_id`` set to the CPU (see the module docstring)."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )
        return model


def tiny_llama() -> torch.nn.Module:
    """The matrix's model: a Hugging Face Llama of 3 layers, hidden 64 (unseeded: callers seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        use_cache=False,
    )
    return LlamaForCausalLM(config).train()


class LlamaModule(pl.LightningModule):
    """``self.model(**batch).loss`` of a tiny Llama; FSDP2 shards it in ``configure_model`` when asked to."""

    def __init__(
        self,
        fsdp2: bool,
        units: str = "layers",
        mixed: bool = False,
        reshard: bool | int = True,
        hsdp: bool = False,
        tp: bool = False,
    ) -> None:
        super().__init__()
        self.fsdp2 = fsdp2
        self.units = units
        self.mixed = mixed  # FSDP2's MixedPrecisionPolicy as torchtitan sets it: bf16 parameters, fp32 reduction
        # reshard_after_forward: False keeps each unit's parameters gathered until its backward; N keeps 1/N of them
        self.reshard = reshard
        self.hsdp = hsdp  # a 2-D mesh: parameters sharded within a group of ranks, replicated across the two groups
        self.tp = tp  # each layer's linears tensor-parallel (torchtitan's plan without sequence parallelism) first
        self.model = tiny_llama()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.tp:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            cols = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
            plan: dict[str, Any] = {name: ColwiseParallel() for name in cols}
            plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
            for layer in self.model.model.layers:
                parallelize_module(layer, self.device_mesh["tensor_parallel"], plan)
        if not self.fsdp2:
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self.device_mesh["data_parallel"]
        if self.hsdp:  # replicate x shard, 2 x (world / 2): HSDP
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, mesh.size() // 2), mesh_dim_names=("replicate", "shard"))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.mixed else None
        kw: dict[str, Any] = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
        if self.reshard is not True:
            kw["reshard_after_forward"] = self.reshard
        for layer in self.model.model.layers:
            if self.units == "sublayers":  # attention and MLP each a unit: a decoder layer contains two
                fully_shard(layer.self_attn, **kw)
                fully_shard(layer.mlp, **kw)
            else:
                fully_shard(layer, **kw)
        fully_shard(self.model, **kw)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        batches = [lm_batch(128, batch=4, seq=128) for _ in range(STEPS)]
        return DataLoader(batches, batch_size=None)


def _strategy(name: str, world_size: int, units: str = "layers") -> Any:
    if name == "single":
        return "auto"
    if name == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    if name in ("fsdp2", "fsdp2-mp", "fsdp2-keep", "fsdp2-reshard2", "hsdp"):
        return ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    if name == "tp2-fsdp2":  # a (world / 2) x 2 data-parallel x tensor-parallel mesh
        return ModelParallelStrategy(data_parallel_size=world_size // 2, tensor_parallel_size=2)
    if name == "tp":  # tensor parallelism over every rank, no FSDP
        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world_size)
    if name == "fsdp1":
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

        policy = {LlamaAttention, LlamaMLP} if units == "sublayers" else {LlamaDecoderLayer}
        return CPUFSDPStrategy(auto_wrap_policy=policy, process_group_backend="gloo")
    raise ValueError(name)


def _fit(strategy: str, precision: str, world_size: int, callbacks: list[Any], units: str, root: str) -> LlamaModule:
    pl.seed_everything(0)
    module = LlamaModule(
        fsdp2=strategy.startswith("fsdp2") or strategy in ("hsdp", "tp2-fsdp2"),
        units=units,
        mixed=strategy == "fsdp2-mp",
        reshard={"fsdp2-keep": False, "fsdp2-reshard2": 2}.get(strategy, True),
        hsdp=strategy == "hsdp",
        tp=strategy in ("tp", "tp2-fsdp2"),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=_strategy(strategy, world_size, units),
        precision=precision,  # type: ignore[arg-type]
        max_steps=STEPS,
        callbacks=callbacks,
        logger=False,
        default_root_dir=root,  # AutoSAC's panels: in the test's folder, not the working directory
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    return module


class _Calls(pl.Callback):
    """How often each planned module ran, and how often it ran other ops than profiled (read before teardown)."""

    def __init__(self, sac: AutoSAC) -> None:
        self.sac = sac
        self.seen: dict[str, list[int]] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        handle = self.sac._handle
        wrappers = handle.wrappers if handle is not None else {}
        self.seen = {f: [w.calls, w.mismatched_calls] for f, w in wrappers.items()}


@dataclass
class CellResult:
    """One rank's side of a cell: both fits' batch peaks and losses, and AutoSAC's plan and prediction."""

    rank: int
    plain_peaks: list[int]
    plain_losses: list[float]
    budget_bytes: int
    planned_peaks: list[int]
    planned_losses: list[float]
    decisions: dict[str, list[int]]
    fingerprint: str
    predicted_plain: int
    predicted_peak: int
    calls: dict[str, list[int]]  # per planned module: its calls, and those that ran other ops than profiled
    own_measured: int | None = None  # AutoSAC's own measurement (measure=True) of the second step, in a third fit


def _rank(rank: int, cell: tuple[tuple[str, ...], tuple[str, ...], int, dict[str, Any]], port: int, out: str) -> None:
    strategies, precisions, world_size, autosac = cell
    autosac = dict(autosac)
    units = autosac.pop("units", "layers")
    own_measure = autosac.pop("own_measure", False)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    torch.set_num_threads(1)
    for strategy, precision in _combos(strategies, precisions):
        plain_peaks = BatchPeaks(at_train_start=True)
        plain = _fit(strategy, precision, world_size, [plain_peaks], units, out)
        peak = torch.tensor(max(plain_peaks.peaks))
        if world_size > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        budget = int(0.8 * int(peak))
        sac = AutoSAC(budget_gb=budget / 2**30, measure=False, log_figures=False, **autosac)
        planned_peaks, calls = BatchPeaks(at_train_start=True), _Calls(sac)
        planned = _fit(strategy, precision, world_size, [sac, planned_peaks, calls], units, out)
        assert sac.plan is not None
        own_measured = None
        if own_measure:  # the same planned fit again, measured by AutoSAC itself (one profiler at a time)
            own = AutoSAC(budget_gb=budget / 2**30, measure=True, log_figures=False, **autosac)
            _fit(strategy, precision, world_size, [own], units, out)
            own_measured = None if own.measured is None else own.measured.peak_bytes
        result = CellResult(
            rank=rank,
            plain_peaks=plain_peaks.peaks,
            plain_losses=plain.losses,
            budget_bytes=sac.plan.budget_bytes,
            planned_peaks=planned_peaks.peaks,
            planned_losses=planned.losses,
            decisions={f: list(d.op_policy) for f, d in sac.plan.decisions.items()},
            fingerprint=sac.plan.fingerprint,
            predicted_plain=sac.plan.unconstrained_peak_bytes,
            predicted_peak=sac.plan.predicted_peak_bytes,
            calls=calls.seen,
            own_measured=own_measured,
        )
        Path(out, f"{strategy}_{precision}_rank{rank}.json").write_text(json.dumps(asdict(result)))


def _combos(strategies: tuple[str, ...], precisions: tuple[str, ...]) -> list[tuple[str, str]]:
    # FSDP2's own mixed precision (bf16 parameters, fp32 reduction) runs without Lightning's autocast, as torchtitan
    # runs it: only in "32-true"; so do reshard_after_forward=False and HSDP, whose precision changes nothing they test.
    fp32_only = ("fsdp2-mp", "fsdp2-keep", "fsdp2-reshard2", "hsdp", "tp", "tp2-fsdp2")
    return [(s, p) for s in strategies for p in precisions if s not in fp32_only or p == "32-true"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_cells(
    strategies: tuple[str, ...], world_size: int, precisions: tuple[str, ...], out: Path, **autosac: Any
) -> dict[tuple[str, str], list[CellResult]]:
    """Run the cells of one world size, each strategy and precision in turn, in the same ``world_size`` processes.

    Most of a cell's time is starting processes and importing: the cells of a world size share them (the
    process group Lightning initializes in the first fit serves the later ones). ``autosac`` are more arguments
    of AutoSAC (e.g. ``candidates``), ``units="sublayers"`` shards each decoder layer's attention and MLP as
    units instead of the layer, and ``own_measure=True`` fits the planned cell a third time with AutoSAC's own
    measurement (``CellResult.own_measured``).

    Returns:
        Per ``(strategy, precision)``, every rank's result.
    """
    out.mkdir(parents=True, exist_ok=True)
    start_ranks(_rank, ((strategies, precisions, world_size, autosac), _free_port(), str(out)), world_size)
    return {
        (s, p): [CellResult(**json.loads(Path(out, f"{s}_{p}_rank{r}.json").read_text())) for r in range(world_size)]
        for s, p in _combos(strategies, precisions)
    }
