"""A step that draws a random scalar to take a rare branch (LayerDrop) is profiled on the path that runs every layer.

Hugging Face's speech encoders (Wav2Vec2, HuBERT, WavLM) skip each layer in a share of training steps (``layerdrop``,
0.1 by default): ``if torch.rand([]) < layerdrop``. The dry run's draw was a fake tensor and that decision stopped it
with a ProfilingError; a uniform draw of a few values now gets the top of its range (``real_values.py``), so the
profile is of the step that runs every layer, which is also the one that holds the most.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from zoo import wav2vec2_ctc

from lightning_sac import apply_plan, profile_model, solve_plan
from lightning_sac.dryrun.measured import measure_training_step

GIB = 2**30


class _Sometimes(nn.Module):
    """Skips its layer when a uniform draw in [0, 1) falls low; a tanh when a draw in [2, 3) does."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.rand([]) >= 0.25:
            x = self.layer(x)
        if torch.empty(()).uniform_(2.0, 3.0) < 2.999:
            x = torch.tanh(x)
        return x


def test_uniform_draws_take_the_top_of_their_range_and_leave_the_random_stream_alone():
    torch.manual_seed(0)
    model, x = _Sometimes(), torch.randn(4, 8)
    state = torch.get_rng_state()
    profile = profile_model(model, (x,), loss_fn=lambda out: out.sum(), device="cpu")
    assert torch.equal(torch.get_rng_state(), state)
    assert profile.modules["layer"].calls == 1  # the layer ran: 0.99999994 >= 0.25
    assert "aten.tanh.default" not in profile.modules[""].op_stats.func_names  # 2.9999998 < 2.999 is false


def test_hugging_face_layerdrop_is_profiled_with_every_layer_and_exactly():
    ref = wav2vec2_ctc(layerdrop=0.1)  # Hugging Face's default
    profile = profile_model(ref.model, ref.batch, loss_fn=ref.loss_fn, optimizer_factory=ref.optimizer, device="cpu")
    layers = [f for f in profile.modules if f.startswith("wav2vec2.encoder.layers.") and f.count(".") == 3]
    assert layers == ["wav2vec2.encoder.layers.0", "wav2vec2.encoder.layers.1"]
    assert all(profile.modules[f].calls == 1 for f in layers)
    # The step that runs every layer is the same model's with LayerDrop off (it still draws): predicted exactly.
    every_layer = copy.deepcopy(ref.model)
    every_layer.config.layerdrop = 0.0
    measured = measure_training_step(every_layer, ref.batch, loss_fn=ref.loss_fn, optimizer_factory=ref.optimizer)
    assert profile.peak_bytes == measured.peak_bytes


@pytest.mark.parametrize("backend", ["sac", pytest.param("graph", marks=pytest.mark.slow)])  # quick tier: 5 minutes
def test_a_plan_for_a_model_that_skips_layers_trains_as_the_plain_model(backend):
    from test_real_models import two_steps

    ref = wav2vec2_ctc(layerdrop=0.5)
    profile = profile_model(ref.model, ref.batch, loss_fn=ref.loss_fn, optimizer_factory=ref.optimizer, device="cpu")
    plan = solve_plan(profile, 0.7 * profile.peak_bytes / GIB, backend=backend)
    assert plan.decisions and plan.predicted_peak_bytes <= 0.7 * profile.peak_bytes
    model = copy.deepcopy(ref.model)
    calls: list[str] = []
    for i, layer in enumerate(model.wav2vec2.encoder.layers):
        layer.register_forward_hook(lambda *_, i=i: calls.append(i))
    plain = two_steps(model, ref)
    assert 0 < len(calls) < 4  # two layers, two steps: some skipped, some run
    planned = copy.deepcopy(ref.model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="lightning-sac")  # no mismatch, no unplanned call
        handle = apply_plan(planned, plan)
        steps = two_steps(planned, ref)
    assert all(w.mismatched_calls == 0 for w in handle.wrappers.values())
    handle.remove()
    for (loss0, grads0, bufs0), (loss1, grads1, bufs1) in zip(plain, steps, strict=True):
        assert torch.equal(loss0, loss1)
        assert grads0.keys() == grads1.keys() and bufs0.keys() == bufs1.keys()
        assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)
        assert all(torch.equal(bufs0[n], bufs1[n]) for n in bufs0)
