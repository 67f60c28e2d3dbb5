"""profile_model on the three test models: structure, orders, analytic bytes, JSON, the user's model untouched."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import GPT_CONFIG, adamw, conv_case, gpt_case, mlp_case
from torch import nn

from lightning_sac import DeviceSpec, ModelProfile, get_device_spec, profile_model
from lightning_sac.dryrun import CATEGORIES, PHASES


def gpt_param_numels(c=GPT_CONFIG) -> dict[str, list[int]]:
    """Numel of each parameter tensor per top-level owner, from the architecture (the LM head is tied)."""
    d = c.n_embd
    block = [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]
    return {"wte": [c.vocab_size * d], "wpe": [c.block_size * d], "block": block, "ln_f": [d, d]}


def test_gpt_fqns_and_structure():
    case = gpt_case()
    p = profile_model(case.model, case.inputs, loss_fn=case.loss_fn, device="cpu")
    assert set(p.modules) == {name for name, _ in case.model.named_modules()}
    assert next(iter(p.modules)) == ""
    called = [f for f in p.modules if p.modules[f].calls]
    assert called == p.forward_pre_order  # modules dict is in forward pre-order; each module runs once
    assert p.modules["blocks"].calls == 0  # the ModuleList container never runs
    assert p.modules["blocks.0.attn"].module_type == "CausalSelfAttention"
    assert p.modules["blocks.0.attn.qkv"].is_leaf and not p.modules["blocks.0"].is_leaf
    assert p.modules["blocks.0"].op_stats is not None and p.modules["blocks.0.ln_1"].op_stats is None


def test_mlp_execution_orders_exact():
    case = mlp_case()
    p = profile_model(case.model, case.inputs, device="cpu")
    assert p.forward_pre_order == [
        "",
        "0",
        "0.fc",
        "0.act",
        "0.out",
        "0.drop",
        "1",
        "2",
        "2.fc",
        "2.act",
        "2.out",
        "2.drop",
    ]
    assert p.forward_post_order == [
        "0.fc",
        "0.act",
        "0.out",
        "0.drop",
        "0",
        "1",
        "2.fc",
        "2.act",
        "2.out",
        "2.drop",
        "2",
        "",
    ]
    # Backward mirrors forward. The drop layers have p=0 and return their input, so they begin as soon as
    # the module they wrap does and end at once.
    assert p.backward_pre_order == [
        "",
        "2",
        "2.drop",
        "2.out",
        "2.act",
        "2.fc",
        "1",
        "0",
        "0.drop",
        "0.out",
        "0.act",
        "0.fc",
    ]
    assert p.backward_post_order == [
        "2.drop",
        "2.out",
        "2.act",
        "2.fc",
        "2",
        "1",
        "0.drop",
        "0.out",
        "0.act",
        "0.fc",
        "0",
        "",
    ]


def test_gpt_backward_order_mirrors_forward():
    case = gpt_case()
    p = profile_model(case.model, case.inputs, loss_fn=case.loss_fn, device="cpu")
    blocks = [f for f in p.backward_pre_order if f.startswith("blocks.") and f.count(".") == 1]
    assert blocks == ["blocks.1", "blocks.0"]
    post = p.backward_post_order
    for fqn in p.forward_pre_order:
        children = [f for f in post if f.startswith(fqn + ".") and f.count(".") == fqn.count(".") + 1]
        for child in children:  # every child's backward ends before its parent's
            assert post.index(child) < post.index(fqn)
    assert p.backward_pre_order[0] == "" and post[-1] == ""


def test_gpt_parameter_gradient_optimizer_bytes_are_analytic():
    case = gpt_case()
    p = profile_model(case.model, case.inputs, loss_fn=case.loss_fn, optimizer_factory=adamw, device="cpu")
    n = gpt_param_numels()
    all_numels = n["wte"] + n["wpe"] + n["block"] * GPT_CONFIG.n_layer + n["ln_f"]
    param_bytes = 4 * sum(all_numels)
    # AdamW keeps exp_avg and exp_avg_sq (fp32, parameter-shaped) and a 4-byte step tensor per parameter.
    state_bytes = 2 * param_bytes + 4 * len(all_numels)
    root = p.modules[""]
    assert root.parameter_bytes == param_bytes == 2 * 793_088 + 4 * (512 * 128 + 128 * 128 + 256)  # 2 blocks
    assert root.gradient_bytes == param_bytes
    assert root.optimizer_state_bytes == state_bytes
    qkv = p.modules["blocks.1.attn.qkv"]
    assert qkv.parameter_bytes == 4 * (128 * 384 + 384)
    assert qkv.optimizer_state_bytes == 2 * qkv.parameter_bytes + 8
    assert p.modules["lm_head"].parameter_bytes == p.modules["wte"].parameter_bytes == 4 * 512 * 128
    # Parameters and optimizer state are alive all step long, so the peak holds all of them.
    assert p.peak_breakdown["parameter"] == param_bytes
    assert p.peak_breakdown["optimizer_state"] == state_bytes
    assert p.peak_breakdown["other"] == 2 * 4 * 128 * 8  # int64 token ids, and the targets loss_fn closes over
    assert p.peak_bytes == sum(p.peak_breakdown.values())
    assert set(p.peak_breakdown) == set(CATEGORIES)


def test_gpt_module_io_bytes_and_snapshots():
    case = gpt_case()
    p = profile_model(case.model, case.inputs, loss_fn=case.loss_fn, optimizer_factory=adamw, device="cpu")
    b, t, c, v = 4, 128, GPT_CONFIG.n_embd, GPT_CONFIG.vocab_size
    assert p.modules["blocks.0"].input_bytes == p.modules["blocks.0"].output_bytes == b * t * c * 4
    assert p.modules["lm_head"].output_bytes == b * t * v * 4
    assert p.modules[""].input_bytes == b * t * 8
    block = p.modules["blocks.0"]
    assert set(block.memory) == set(PHASES)
    pre, post, peak = (sum(block.memory[k].values()) for k in ("pre_forward", "post_forward", "peak_forward"))
    assert pre < post <= peak
    assert block.memory["peak_backward"]["temporary"] > 0
    assert block.forward_ms > 0 and block.backward_ms > 0
    assert p.step_ms == pytest.approx(p.forward_ms + p.backward_ms + p.optimizer_ms)
    # A parent's forward time includes its children's.
    assert block.forward_ms >= p.modules["blocks.0.attn"].forward_ms + p.modules["blocks.0.mlp"].forward_ms


def test_cuda_target_rounds_every_allocation_to_512_bytes():
    case = gpt_case()
    p = profile_model(case.model, case.inputs, loss_fn=case.loss_fn, optimizer_factory=adamw, device="H100-SXM")
    ln = p.modules["blocks.0.ln_1"]  # weight and bias of 128 fp32 = 512 bytes each
    assert ln.parameter_bytes == 1024
    # Two moments per parameter; AdamW's 4-byte step counters stay on the host (not fused, not capturable).
    assert ln.optimizer_state_bytes == 4 * 512
    for name in p.modules:
        stats = p.modules[name].op_stats
        if stats is not None:
            assert all(m % 512 == 0 for m in stats.memory)
    assert p.device == get_device_spec("h100-sxm")


def test_json_round_trip_is_exact():
    case = gpt_case()
    p = profile_model(case.model, case.inputs, loss_fn=case.loss_fn, optimizer_factory=adamw, device="A100-40GB")
    text = p.to_json()
    q = ModelProfile.from_json(text)
    assert q == p
    assert q.to_json() == text
    assert isinstance(q.device, DeviceSpec)
    assert all(isinstance(pair, tuple) for m in q.modules.values() if m.op_stats for pair in m.op_stats.inplace_ops)


def test_users_model_is_not_changed():
    case = gpt_case()
    model = case.model
    model.blocks[0].mlp.fc.weight.grad = torch.ones_like(model.blocks[0].mlp.fc.weight)
    before = copy.deepcopy(model.state_dict())
    grad_before = model.blocks[0].mlp.fc.weight.grad.clone()
    profile_model(model, case.inputs, loss_fn=case.loss_fn, optimizer_factory=adamw, device="cpu")
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert torch.equal(model.blocks[0].mlp.fc.weight.grad, grad_before)
    assert all(p.grad is None for n, p in model.named_parameters() if n != "blocks.0.mlp.fc.weight")
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters() if p._post_accumulate_grad_hooks)
    assert model.training


def test_meta_device_model_profiles_like_the_real_one():
    case = gpt_case()
    real = profile_model(case.model, case.inputs, loss_fn=case.loss_fn, optimizer_factory=adamw, device="cpu")
    with torch.device("meta"):
        meta_model = type(case.model)(GPT_CONFIG)
    meta = profile_model(meta_model, case.inputs, loss_fn=case.loss_fn, optimizer_factory=adamw, device="cpu")
    assert meta.peak_bytes == real.peak_bytes
    assert meta.modules[""].parameter_bytes == real.modules[""].parameter_bytes


def test_frozen_parameters_have_no_gradient_or_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    model[0].requires_grad_(False)
    p = profile_model(model, (torch.randn(4, 32),), optimizer_factory=adamw, device="cpu")
    assert p.modules["0"].gradient_bytes == 0 and p.modules["0"].optimizer_state_bytes == 0
    assert p.modules["2"].gradient_bytes == 4 * (64 * 8 + 8)
    assert p.modules[""].optimizer_state_bytes == 2 * 4 * (64 * 8 + 8) + 8


def test_render_profile_shows_the_peak_and_modules_to_the_requested_depth():
    from lightning_sac import render_profile

    case = gpt_case()
    p = profile_model(case.model, case.inputs, loss_fn=case.loss_fn, device="cpu")
    text = render_profile(p, max_depth=2)  # root 0, blocks 1 (the ModuleList), blocks.1 2
    assert f"peak {p.peak_bytes / 2**20:.2f} MiB at {p.peak_location}" in text
    assert "  blocks.1 " in text and "blocks.1.attn" not in text
    assert "blocks.1.attn" in render_profile(p, max_depth=3)


def test_mlp_and_conv_bytes_are_analytic():
    mlp = mlp_case()
    p = profile_model(mlp.model, mlp.inputs, optimizer_factory=adamw, device="cpu")
    numel = 2 * (256 * 1024 + 1024 + 1024 * 256 + 256)  # two MLPs, fc and out with biases
    assert p.modules[""].parameter_bytes == p.modules[""].gradient_bytes == 4 * numel
    assert p.modules[""].optimizer_state_bytes == 2 * 4 * numel + 4 * 8  # 8 tensors with a step each
    assert p.modules["0.fc"].input_bytes == 64 * 256 * 4 and p.modules["0.fc"].output_bytes == 64 * 1024 * 4

    conv = conv_case()
    p = profile_model(conv.model, conv.inputs, loss_fn=conv.loss_fn, optimizer_factory=adamw, device="cpu")
    params = [3 * 16 * 9, 16, 16, 16, 16 * 32 * 9, 32, 32, 32, 32 * 10, 10]  # conv, bn, conv, bn, head
    assert p.modules[""].parameter_bytes == 4 * sum(params)
    # BatchNorm buffers: running mean and variance (fp32) and num_batches_tracked (one int64).
    assert p.modules[""].buffer_bytes == 4 * (16 + 16 + 32 + 32) + 2 * 8
    assert p.modules[""].optimizer_state_bytes == 2 * 4 * sum(params) + 4 * len(params)
    assert p.peak_breakdown["buffer"] == p.modules[""].buffer_bytes
    assert p.modules["features.0"].output_bytes == 16 * 16 * 32 * 32 * 4
