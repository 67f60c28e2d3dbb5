"""What must not run twice or be kept twice: stateful ops, KV caches, the model's own checkpointing, a
checkpoint's inputs, and a plan that meets other ops than it was made for."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from zoo import FAMILIES, gpt2, self_checkpointing

from lightning_sac import BudgetError, apply_plan, optimal_op_policy, profile_model, solve_plan
from lightning_sac.adapters.caches import is_kv_cache, without_kv_caches
from lightning_sac.demos import ConvNet
from lightning_sac.dryrun.measured import measure_training_step
from lightning_sac.dryrun.step import default_loss
from lightning_sac.ops.aten import mutated_tensors
from lightning_sac.solver import find_candidates
from lightning_sac.solver.tradeoff import module_tradeoff

GIB = 2**30
aten = torch.ops.aten


# ----------------------------------------------------------------------------- stateful ops
def test_batch_norm_writes_its_running_statistics_though_its_schema_does_not_say_so():
    x, mean, var = torch.randn(4, 3, 8, 8), torch.zeros(3), torch.ones(3)
    assert not aten.native_batch_norm.default._schema.is_mutable  # the schema alone would miss it
    written = mutated_tensors(aten.native_batch_norm.default, (x, None, None, mean, var, True, 0.1, 1e-5), {})
    assert len(written) == 2 and written[0] is mean and written[1] is var
    assert mutated_tensors(aten.native_batch_norm.default, (x, None, None, mean, var, False, 0.1, 1e-5), {}) == []
    assert mutated_tensors(aten.addmm.default, (torch.zeros(3), torch.zeros(2, 2), torch.zeros(2, 3)), {}) == []


@pytest.mark.parametrize("op", ["cudnn_batch_norm", "miopen_batch_norm"])
def test_a_gpus_batch_norm_writes_its_running_statistics_too(op):
    # GPU-found: CUDA runs float32 BatchNorm as cudnn_batch_norm, whose schema declares no write and whose
    # decomposition calls native_batch_norm, which declares none either. The probe saw no write, a plan recomputed
    # it, and the running statistics were updated twice (an H100, a ResNet's bit-equality check: only the buffers
    # differed). The probe now follows the decomposition's own undeclared writes.
    x, mean, var = torch.randn(4, 3, 8, 8), torch.zeros(3), torch.ones(3)
    func = getattr(aten, op).default
    assert not func._schema.is_mutable
    written = mutated_tensors(func, (x, torch.ones(3), torch.zeros(3), mean, var, True, 0.1, 1e-5), {})
    assert len(written) == 2 and written[0] is mean and written[1] is var
    assert mutated_tensors(func, (x, torch.ones(3), torch.zeros(3), mean, var, False, 0.1, 1e-5), {}) == []


def test_stateful_ops_are_saved_by_every_policy():
    torch.manual_seed(0)
    profile = profile_model(ConvNet(width=8), (torch.randn(4, 3, 16, 16),), device="cpu")
    stats = profile.modules["features.0"].op_stats
    assert [stats.func_names[i] for i in stats.stateful_ops] == ["aten.native_batch_norm.default"]
    (bn,) = stats.stateful_ops
    stored = module_tradeoff(stats).stored
    assert any(bn in unit.ops for unit in stored)
    minimum = sum(u.memory for u in stored) / module_tradeoff(stats).total_memory
    for budget in (minimum, 0.5, 1.0):
        assert optimal_op_policy(stats, budget)[bn] == 1


# ----------------------------------------------------------------------------- KV caches
def test_an_empty_kv_cache_is_switched_off_in_training_and_a_filled_one_left_alone():
    from transformers import DynamicCache

    model = gpt2().model
    block0, block1 = model.transformer.h
    cache = DynamicCache(config=model.config)
    hidden = torch.randn(2, 4, 64)
    call = without_kv_caches(block1, (hidden,), {"past_key_values": cache, "use_cache": True})
    assert call.switched_off == ["use_cache", "past_key_values"] and call.holds_tokens == []
    assert call.kwargs == {"past_key_values": None, "use_cache": False} and call.args[0] is hidden
    cache.update(torch.randn(2, 4, 4, 16), torch.randn(2, 4, 4, 16), 0)  # layer 0 holds 4 tokens now
    assert without_kv_caches(block1, (hidden,), {"past_key_values": cache}).kwargs["past_key_values"] is None
    held = without_kv_caches(block0, (hidden,), {"past_key_values": cache, "use_cache": True})
    assert held.holds_tokens == ["past_key_values"] and held.kwargs["past_key_values"] is cache
    block1.eval()
    assert without_kv_caches(block1, (hidden,), {"past_key_values": cache}).switched_off == []


def test_a_planned_model_called_with_use_cache_trains_without_it_and_says_so_once():
    family = gpt2()
    profile = profile_model(family.model, family.batch, device="cpu")
    plan = solve_plan(profile, 0.6 * profile.peak_bytes / GIB)
    assert plan.decisions and plan.kv_cache_off
    plain, planned = copy.deepcopy(family.model), copy.deepcopy(family.model)
    handle = apply_plan(planned, plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            torch.manual_seed(3)  # GPT-2's dropout draws the same masks in both models
            out = planned(**family.batch, use_cache=True)
            out.loss.backward()
    said = [w for w in caught if "trains with use_cache=False" in str(w.message)]
    assert len(said) == 1 and out.past_key_values is None
    assert not [w for w in caught if "ran other ops" in str(w.message)]
    torch.manual_seed(3)
    reference = plain(**family.batch, use_cache=True)
    torch.testing.assert_close(out.loss, reference.loss)
    assert reference.past_key_values is not None
    handle.remove()
    assert planned(**family.batch, use_cache=True).past_key_values is not None


def test_a_planned_module_called_with_a_cache_holding_tokens_runs_unplanned():
    family = gpt2()
    profile = profile_model(family.model, family.batch, device="cpu")
    plan = solve_plan(profile, 0.7 * profile.peak_bytes / GIB, candidates=["transformer.h.?"])
    assert plan.decisions and all(f.startswith("transformer.h.") for f in plan.decisions)
    with torch.no_grad():
        prefix = family.model(input_ids=family.batch["input_ids"][:, :16], use_cache=True).past_key_values
    batch = {
        "input_ids": family.batch["input_ids"][:, 16:48],
        "labels": family.batch["labels"][:, 16:48],
        "attention_mask": torch.ones(4, 48, dtype=torch.long),
    }
    plain, planned = copy.deepcopy(family.model), copy.deepcopy(family.model)
    handle = apply_plan(planned, plan)
    torch.manual_seed(3)
    with pytest.warns(UserWarning, match="already holds tokens"):
        loss = planned(**batch, past_key_values=copy.deepcopy(prefix)).loss
    torch.manual_seed(3)
    torch.testing.assert_close(loss, plain(**batch, past_key_values=copy.deepcopy(prefix)).loss)
    assert all(w.calls == 0 for w in handle.wrappers.values())


def test_an_evaluation_call_with_grad_and_a_kv_cache_runs_unplanned_and_keeps_the_cache():
    # GPT-2's config has use_cache on: in evaluation mode with gradients on (a frozen-dropout fine-tune, a PPO
    # policy), every attention writes the model's DynamicCache. Run under a checkpoint, the recompute wrote it a
    # second time and backward failed ("aten.mul.Scalar encountered during backward but not found in storage").
    family = gpt2()
    assert family.model.config.use_cache
    profile = profile_model(family.model, family.batch, device="cpu")
    plan = solve_plan(profile, 0.7 * profile.peak_bytes / GIB)
    plain, planned = copy.deepcopy(family.model).eval(), copy.deepcopy(family.model).eval()
    handle = apply_plan(planned, plan)
    takers = _cache_takers(plain, family.batch)
    assert takers & set(handle.wrappers), (takers, list(handle.wrappers))  # some planned module gets the cache
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            out = planned(**family.batch)
            out.loss.backward()
    said = [w for w in caught if "evaluation mode with gradients on and a KV cache" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]  # once, for every module and call
    reference = plain(**family.batch)
    reference.loss.backward()
    torch.testing.assert_close(out.loss, reference.loss)
    tokens = family.batch["input_ids"].shape[1]
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() == tokens  # the user's cache
    for p, q in zip(plain.parameters(), planned.parameters(), strict=True):
        torch.testing.assert_close(q.grad, 2 * p.grad)  # two planned steps accumulated, one plain
    # The calls that took the cache ran unplanned; the others still ran their policies.
    assert {f for f, w in handle.wrappers.items() if w.calls == 0} == takers & set(handle.wrappers)
    assert all(w.calls == 2 for f, w in handle.wrappers.items() if f not in takers)


def _cache_takers(model: nn.Module, batch: dict[str, torch.Tensor]) -> set[str]:
    """The modules a forward of ``model`` calls with a KV cache among their arguments."""
    found: set[str] = set()

    def hook(fqn: str):  # noqa: ANN202
        def record(module, args, kwargs):  # noqa: ANN001, ANN202
            if any(is_kv_cache(v) for v in (*args, *kwargs.values())):
                found.add(fqn)

        return record

    handles = [m.register_forward_pre_hook(hook(f), with_kwargs=True) for f, m in model.named_modules()]
    with torch.no_grad():
        model(**batch)
    for h in handles:
        h.remove()
    return found


# ----------------------------------------------------------------------------- the model's own checkpointing
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_the_models_own_checkpoints_are_found_and_planned_around(reentrant):
    family = self_checkpointing(reentrant)
    profile = profile_model(family.model, family.batch, loss_fn=family.loss_fn, device="cpu")
    assert profile.checkpointed_modules == ["blocks.0", "blocks.1"]
    assert profile.checkpoint_callers == [""]
    found = {c.fqn for c in find_candidates(profile)}
    assert found == {"blocks.2", "blocks.3"}
    with pytest.raises(BudgetError, match="checkpoints 2 module.*remove the model's own torch.utils.checkpoint"):
        solve_plan(profile, 1e-6)


def test_hugging_face_checkpointing_is_named_and_replaced_on_request():
    family = FAMILIES["gpt2_gradient_checkpointing"]()
    profile = profile_model(family.model, family.batch, optimizer_factory=family.optimizer, device="cpu")
    assert "transformer.h.0" in profile.checkpointing_flags and profile.checkpoint_callers
    assert find_candidates(profile) == []
    with pytest.raises(BudgetError, match=r"gradient_checkpointing_disable\(\).*replace_existing=True"):
        solve_plan(profile, 0.85 * profile.peak_bytes / GIB)
    replaced = profile_model(
        family.model, family.batch, optimizer_factory=family.optimizer, device="cpu", replace_existing=True
    )
    assert replaced.checkpointed_modules == [] and replaced.replaced_checkpointing == profile.checkpointing_flags
    assert replaced.peak_bytes > profile.peak_bytes  # profiled as it runs without its own checkpointing
    plan = solve_plan(replaced, 0.85 * replaced.peak_bytes / GIB)
    assert plan.decisions and plan.replaces_checkpointing == profile.checkpointing_flags
    model = copy.deepcopy(family.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_plan(model, plan)
        assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        measured = measure_training_step(model, family.batch, optimizer_factory=family.optimizer).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.03 * plan.predicted_peak_bytes
    handle.remove()
    flags = [f for f, m in model.named_modules() if getattr(m, "gradient_checkpointing", None) is True]
    assert flags == profile.checkpointing_flags
    assert family.model.transformer.h[0].gradient_checkpointing is True  # profiling changed nothing


# ----------------------------------------------------------------------------- what a checkpoint keeps
class ReLUFirst(nn.Module):
    """Its first op saves only its own output, so nothing but a checkpoint keeps its input."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(torch.relu(x))))


def test_a_checkpoint_keeps_its_input_and_the_plan_counts_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), ReLUFirst(64), nn.Linear(64, 1024), nn.Tanh())
    x = torch.randn(512, 64)
    profile = profile_model(model, (x,), device="cpu")
    freed = next(k for k, e in enumerate(profile.timeline) if e.kind == "free" and e.name == "1")
    # The first Linear's output, 512 x 64 float32, dies as the Sequential moves on, unless a checkpoint keeps it.
    assert profile.modules["1"].freed_inputs == [[freed, 512 * 64 * 4]]
    with pytest.raises(BudgetError) as info:
        solve_plan(profile, 1e-6, candidates=["1"])
    plan = solve_plan(profile, info.value.minimum_bytes * 1.01 / GIB, candidates=["1"])
    assert list(plan.decisions) == ["1"]
    planned = copy.deepcopy(model)
    apply_plan(planned, plan)
    measured = measure_training_step(planned, (x,)).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * plan.predicted_peak_bytes, (measured, plan)


# ----------------------------------------------------------------------------- a plan that does not match
@pytest.mark.parametrize("backend", ["sac", "graph"])
def test_a_plan_that_meets_other_ops_keeps_no_more_than_no_plan(backend):
    family = FAMILIES["bert"]()
    profile = profile_model(family.model, family.batch, device="cpu")
    layer = "bert.encoder.layer.0"
    with pytest.raises(BudgetError) as info:
        solve_plan(profile, 1e-6, candidates=[layer], backend=backend)
    plan = solve_plan(profile, info.value.minimum_bytes * 1.01 / GIB, candidates=[layer], backend=backend)
    assert list(plan.decisions) == [layer]
    plain, planned = copy.deepcopy(family.model).eval(), copy.deepcopy(family.model).eval()
    handle = apply_plan(planned, plan)
    # Without dropout (eval mode, gradients on: fine-tuning without it), the layer runs fewer ops than profiled.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = default_loss(planned(**family.batch))
        loss.backward()
        default_loss(planned(**family.batch)).backward()
    said = [str(w.message) for w in caught if "ran other ops" in str(w.message)]
    assert len(said) == 1 and f"module '{layer}'" in said[0]
    assert handle.wrappers[layer].mismatched_calls == 2
    reference = default_loss(plain(**family.batch))
    reference.backward()
    torch.testing.assert_close(loss, reference)
    plain.zero_grad()
    planned.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unplanned_peak = measure_training_step(plain, family.batch).peak_bytes
        planned_peak = measure_training_step(planned, family.batch).peak_bytes
    assert planned_peak <= unplanned_peak
