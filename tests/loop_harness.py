"""Loops outside Lightning's Trainer measured from the outside: a Hugging Face Trainer's and a Fabric loop's steps.

The ground truth of issue "Beyond the Lightning Trainer", as :mod:`fit_harness` is for Lightning fits: one
torch.profiler runs over the training steps, started after any planning, and each optimizer step's peak is the bytes
of the tensors alive at its start (parameters, gradients, optimizer state, the batches the step's forwards receive,
DDP's gradient buckets by its reducer's sizes) plus the highest net allocation inside the step's window. Never the
running sum: with gloo a collective's buffer can be freed on gloo's worker thread, which the profiler does not see.
Shares nothing with the integrations' own measurement, so they run with ``measure=False`` beside it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function

from lightning_sac.dryrun import tensors_of, unique_bytes

__all__ = ["LoopPeaks", "TokenDataset", "hf_llama", "llama_loss"]

VOCAB, SEQ = 256, 64


def hf_llama() -> torch.nn.Module:
    """A Hugging Face Llama of 2 layers, hidden 64, seeded: every run starts from the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        use_cache=False,
    )
    return LlamaForCausalLM(config).train()


class TokenDataset(torch.utils.data.Dataset):
    """Dict samples of random token ids, labels equal to the ids (the Trainer's causal-LM batches)."""

    def __init__(self, n: int = 16, seed: int = 1) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def llama_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A Fabric loop's step: the model's own causal-LM loss."""
    return model(**batch).loss


class LoopPeaks:
    """Each step's peak (see the module docstring): :meth:`start`, then :meth:`step_begin`/:meth:`step_end`.

    Attributes:
        peaks: Bytes per optimizer step, in order, after :meth:`finish`.
    """

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self._prof: Any = None
        self._starts: list[list[torch.Tensor]] = []
        self._buckets: list[int] = []
        self._batch: list[torch.Tensor] = []
        self._hook: Any = None
        self._range: Any = None

    def start(self) -> None:
        # The CPU allocator reports to a profiler the frees of blocks an earlier profiler saw allocated: collect
        # the garbage of earlier runs first, or its frees would count against this one.
        gc.collect()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()

    def step_begin(self, model: torch.nn.Module, optimizer: Any, wrapped: torch.nn.Module | None = None) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        params = list(model.parameters())
        state = [v for s in inner.state.values() for v in s.values()]
        self._starts.append([*params, *model.buffers(), *[p.grad for p in params if p.grad is not None]])
        self._starts[-1] += tensors_of(state)
        self._buckets.append(_bucket_bytes(wrapped))
        self._batch = []
        self._hook = model.register_forward_pre_hook(
            lambda m, a, k: self._batch.extend(tensors_of((a, k))), with_kwargs=True
        )
        self._range = record_function(f"loop_harness_step_{len(self._starts) - 1}")
        self._range.__enter__()

    def step_end(self) -> None:
        self._range.__exit__(None, None, None)
        self._hook.remove()
        self._starts[-1] = [*self._starts[-1], *self._batch]  # the step's batches were alive when it began

    def finish(self) -> list[int]:
        self._prof.__exit__(None, None, None)
        events = list(self._prof.profiler.kineto_results.events())
        memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        windows = {}
        for e in events:
            if e.name().startswith("loop_harness_step_"):
                windows[int(e.name().rsplit("_", 1)[1])] = (e.start_ns(), e.start_ns() + e.duration_ns())
        self.peaks = []
        for i in sorted(windows):
            lo, hi = windows[i]
            alive = peak = unique_bytes(self._starts[i]) + self._buckets[i]
            for t, d in memory:
                if lo <= t <= hi:
                    alive += d
                    peak = max(peak, alive)
            self.peaks.append(peak)
        return self.peaks


def _bucket_bytes(wrapped: torch.nn.Module | None) -> int:
    """DDP's gradient buckets as its reducer sizes them (0 without DDP): no tensor the step sees reaches them."""
    if not isinstance(wrapped, DistributedDataParallel):
        return 0
    buckets = wrapped.reducer._get_zeros_like_grad_buckets()  # zero tensors of the buckets' sizes, dropped here
    return sum(b.buffer().numel() * b.buffer().element_size() for b in buckets)


def hf_peaks_callback(peaks: LoopPeaks, trainer_ref: Callable[[], Any]) -> Any:
    """A ``TrainerCallback`` feeding ``peaks`` from the Trainer's events (started after every earlier callback)."""
    from transformers import TrainerCallback

    class _Peaks(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            peaks.start()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            peaks.step_begin(kw["model"], kw["optimizer"], trainer_ref().model_wrapped)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            peaks.step_end()

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            peaks.finish()

    return _Peaks()
