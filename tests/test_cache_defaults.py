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

from lightning_sac import apply_plan, profile_model, profile_step, solve_plan


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


class _Layer(torch.nn.Module):
    def forward(self, x: torch.Tensor, use_cache: bool | None = None, *, scale: float = 1.0) -> torch.Tensor:
        return x * scale if use_cache is False else x


def test_use_cache_passed_positionally_is_switched_off_where_it_was_passed():
    # RecurrentGemma calls its decoder layers with use_cache positionally; adding the keyword on top raised
    # "got multiple values for argument 'use_cache'".
    from lightning_sac.adapters.caches import without_kv_caches

    layer, x = _Layer().train(), torch.ones(2, requires_grad=True)
    call = without_kv_caches(layer, (x, True), {"scale": 2.0})
    assert call.args == (x, False) and call.kwargs == {"scale": 2.0} and call.switched_off == ["use_cache"]
    assert torch.equal(layer(*call.args, **call.kwargs), 2 * x)
    call = without_kv_caches(layer, (x,), {"use_cache": True})
    assert call.args == (x,) and call.kwargs == {"use_cache": False}
    call = without_kv_caches(layer, (x, False), {})  # already off: left as it is
    assert call.args == (x, False) and call.kwargs == {} and call.switched_off == []


def test_the_run_with_caches_checks_its_stand_ins_as_the_first_run_does():
    # A time-series transformer checks its output distribution's arguments (torch.distributions validates by
    # default): `if not torch._is_all_true(valid): raise ValueError`. The first dry run gives that read the other
    # answer once the healthy one raised; the second run, with the model's caches on, gave it the healthy answer
    # only, and the ValueError reached the user.
    from transformers import TimeSeriesTransformerConfig, TimeSeriesTransformerForPrediction

    torch.manual_seed(0)
    config = TimeSeriesTransformerConfig(
        prediction_length=16,
        context_length=32,
        lags_sequence=[1, 2, 3],
        num_time_features=1,
        input_size=1,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
    )
    model = TimeSeriesTransformerForPrediction(config).train()
    g = torch.Generator().manual_seed(1)
    n, past = 8, 32 + 3
    batch = {
        "past_values": torch.randn(n, past, generator=g).abs() + 1,
        "past_time_features": torch.linspace(0, 1, past).repeat(n, 1).unsqueeze(-1),
        "past_observed_mask": torch.ones(n, past),
        "future_values": torch.randn(n, 16, generator=g).abs() + 1,
        "future_time_features": torch.linspace(1, 1.5, 16).repeat(n, 1).unsqueeze(-1),
    }
    profile = profile_model(model, batch, device="cpu")
    assert profile.kv_cache_off and profile.kv_cache_peak is not None  # the second run, with caches, ran
    assert [s["value"] for s in profile.placeholders] == ["True"]  # the argument check, answered "all valid"
