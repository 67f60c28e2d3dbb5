"""A KV-cache switch left to a config that turns caches off is left as it is.

The Hugging Face Trainer sets ``model.config.use_cache = False`` on the model it trains. T5 then calls its decoder
stack with ``use_cache=None``, and the decoder's own copy of the config turns caches on: the real step builds an
``EncoderDecoderCache`` that its layers fill. The dry run passed ``use_cache=False`` to the model's call instead,
which T5 passes on to its decoder: it profiled a step without the cache, no plan switched caches off, and at run
time the cross-attention met a cache holding tokens and ran unplanned: a T5 plan measured 7.7% over its budget.
"""

from __future__ import annotations

import copy

import torch
from loop_harness import LoopPeaks

from lightning_sac import apply_plan, profile_step, solve_plan


def _t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=256, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, decoder_start_token_id=0
    )
    model = T5ForConditionalGeneration(config)
    model.config.use_cache = False  # as the Trainer sets it; the decoder's config copy keeps use_cache=True
    return model


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-3)  # no state: the first step is every step


def _step_peak(model: torch.nn.Module, batch: dict) -> int:
    optimizer, peaks = _sgd(model), LoopPeaks()
    peaks.start()
    peaks.step_begin(model, optimizer)
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    peaks.step_end()
    return peaks.finish()[0]


def test_a_t5_whose_config_turns_caches_off_is_planned_as_it_runs():
    ids = torch.randint(1, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    model = _t5()
    profile = profile_step(
        model,
        (batch,),
        lambda m, inputs: m(**inputs[0]).loss,
        make_optimizer=_sgd,
        device="cpu",
    )
    assert "decoder" in profile.kv_cache_off, "the decoder's config turns caches on: the plan must turn them off"
    plain = _step_peak(copy.deepcopy(model), batch)
    # The plain step with its caches (the step as it runs without a plan) is the dry run's, within 0.1%.
    assert abs(profile.plain_peak_bytes / plain - 1) < 1e-3, (profile.plain_peak_bytes, plain)
    plan = solve_plan(profile, 0.8 * plain / 2**30)
    handle = apply_plan(model, plan)
    planned = _step_peak(model, batch)
    assert all(w.calls > 0 and w.mismatched_calls == 0 for w in handle.wrappers.values())
    handle.remove()
    assert abs(planned / plan.predicted_peak_bytes - 1) < 5e-3, (planned, plan.predicted_peak_bytes)
    assert planned <= plan.budget_bytes
