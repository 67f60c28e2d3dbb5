"""``lightning-sac plan --hf-config``: a causal LM planned from a local config.json, on the meta device, with LoRA.

Its numbers are ``profile_model``'s (and ``solve_plan``'s) on the same model built by hand from the same config, on
a batch of the same shape, with AdamW and the model's own loss: to the byte.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sac import BudgetError, Plan, profile_model, solve_plan
from lightning_sac.cli.hf_config import LoraSpec, parse_lora
from lightning_sac.cli.main import main

pytest.importorskip("transformers")

BATCH, SEQ = 2, 32
# Tiny decoders: hidden 64, 2 layers, 4 heads (2 key/value heads of 16), vocabulary 128.
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
# Mistral's sliding window shorter than the sequence, and bfloat16 weights as its Hub configs name them.
MISTRAL = {**LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 16}
MISTRAL["torch_dtype"] = "bfloat16"
# LoRA r=4 on q_proj (64 -> 64) and v_proj (64 -> 32) of 2 layers: A is r x in, B is out x r.
LORA_TRAINED = 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*deprecated", category=FutureWarning)


def _write(folder: Path, name: str, config: dict[str, Any]) -> Path:
    path = folder / name
    path.write_text(json.dumps(config))
    return path


def _by_hand(config: dict[str, Any], lora: bool = False) -> torch.nn.Module:
    """The model the config describes, built with its class on the meta device (bfloat16 when it says so)."""
    import transformers

    _quiet()
    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    config_class = getattr(transformers, config["architectures"][0].replace("ForCausalLM", "Config"))
    with torch.device("meta"):
        model = getattr(transformers, config["architectures"][0])(config_class(**kwargs))
        if config.get("torch_dtype") == "bfloat16":
            model = model.to(torch.bfloat16)
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model.train()


def _batch(batch: int = BATCH, seq: int = SEQ) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _direct(model: torch.nn.Module, device: str, batch: int = BATCH, seq: int = SEQ) -> Any:
    return profile_model(model, _batch(batch, seq), optimizer_factory=lambda ps: torch.optim.AdamW(ps), device=device)


def _cli(capsys: pytest.CaptureFixture[str], folder: Path, config: Path, *flags: str) -> tuple[str, dict, Plan]:
    profile, plan = folder / "profile.json", folder / "plan.json"
    argv = ["plan", "--hf-config", str(config), "--batch", str(BATCH), "--seq", str(SEQ)]
    argv += ["--profile-json", str(profile), "--json", str(plan), *flags]  # a later --batch or --seq wins
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out, json.loads(profile.read_text()), Plan.from_json(plan.read_text())


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_a_config_plans_as_the_model_built_by_hand(tmp_path, capsys, name):
    config = {"llama": LLAMA, "mistral": MISTRAL}[name]
    path = _write(tmp_path, f"{name}.json", config)
    out, profile, plan = _cli(capsys, tmp_path, path, "--device", "H100-SXM", "--budget-gb", "70")
    model = _by_hand(config)
    n_params = sum(p.numel() for p in model.parameters())
    dtype = "bfloat16" if name == "mistral" else "float32"
    lines = out.splitlines()
    assert lines[0] == (
        f"model: {config['architectures'][0]} from {path} on the meta device, {n_params:,} parameters ({dtype}); "
        f"batch {BATCH} x {SEQ} tokens (input_ids, attention_mask, labels)"
    )
    assert lines[1] == "training step: AdamW (torch defaults), loss = output.loss"
    direct = _direct(model, "H100-SXM")
    assert profile["peak_bytes"] == direct.peak_bytes
    assert plan.unconstrained_peak_bytes == solve_plan(direct, 70).unconstrained_peak_bytes
    # Every parameter trains: AdamW's two moments, each a parameter's bytes (the step counters live on the host).
    moments = 2 * sum(direct.device.round_bytes(p.numel() * p.element_size()) for p in model.parameters())
    assert profile["modules"][""]["optimizer_state_bytes"] == moments == direct.modules[""].optimizer_state_bytes


def test_lora_trains_only_the_adapters(tmp_path, capsys):
    path = _write(tmp_path, "config.json", LLAMA)
    out, profile, _ = _cli(
        capsys, tmp_path, tmp_path, "--lora", "r=4,targets=q_proj,v_proj,alpha=8", "--device", "H100-SXM",
        "--budget-gb", "70",
    )  # fmt: skip
    assert f"LoRA r=4 alpha=8 on q_proj, v_proj: {LORA_TRAINED:,} of them train" in out.splitlines()[0]
    assert str(path) in out.splitlines()[0]  # the folder's config.json
    model = _by_hand(LLAMA, lora=True)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == LORA_TRAINED
    direct = _direct(model, "H100-SXM")
    assert profile["peak_bytes"] == direct.peak_bytes
    # The adapters' tensors are multiples of 512 bytes: two fp32 moments of each, nothing for frozen weights.
    assert profile["modules"][""]["optimizer_state_bytes"] == 2 * 4 * LORA_TRAINED


@pytest.mark.slow  # two dry runs and three solves, about 15 s here; the tests above check the same dry run
def test_a_budget_below_the_unplanned_peak_gets_the_plan_solve_plan_makes(tmp_path, capsys):
    path = _write(tmp_path, "llama.json", LLAMA)
    direct = _direct(_by_hand(LLAMA), "cpu", batch=4, seq=64)  # activations above the weights and their state
    with pytest.raises(BudgetError) as below:
        solve_plan(direct, 1e-6)
    budget = (below.value.minimum_bytes + direct.peak_bytes) / 2 / 2**30  # halfway: some modules must checkpoint
    flags = ("--batch", "4", "--seq", "64", "--device", "cpu", "--budget-gb", repr(budget))
    out, profile, plan = _cli(capsys, tmp_path, path, *flags)
    expected = solve_plan(direct, budget)
    assert profile["peak_bytes"] == direct.peak_bytes
    assert plan.decisions and sorted(plan.decisions) == sorted(expected.decisions)
    assert (plan.predicted_peak_bytes, plan.unconstrained_peak_bytes) == (
        expected.predicted_peak_bytes,
        expected.unconstrained_peak_bytes,
    )
    assert plan.predicted_peak_bytes <= plan.budget_bytes < plan.unconstrained_peak_bytes
    assert "without a plan" in out


def test_lora_flag_parsing():
    assert parse_lora("r=16,targets=q_proj,v_proj") == LoraSpec(16, ("q_proj", "v_proj"))
    assert parse_lora("r=8, alpha=32") == LoraSpec(8, None, 32)
    assert parse_lora("targets=q_proj,k_proj,v_proj,o_proj,r=2") == LoraSpec(
        2, ("q_proj", "k_proj", "v_proj", "o_proj")
    )


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(["plan", "--budget-gb", "1", "--device", "H100-SXM", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_wrong_hf_config_inputs_get_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = str(_write(tmp_path, "config.json", LLAMA))
    assert "no file 'missing.json'" in _error(capsys, ["--hf-config", "missing.json", "--batch", "2", "--seq", "8"])
    (tmp_path / "empty").mkdir()
    assert "the folder empty holds no config.json" in _error(capsys, ["--hf-config", "empty"])
    assert "needs --seq" in _error(capsys, ["--hf-config", path, "--batch", "2"])
    assert "needs --batch, a whole number above 0, got 0" in _error(capsys, ["--hf-config", path, "--batch", "0"])
    common = ["--hf-config", path, "--batch", "2", "--seq", "8"]
    assert "--lora has no alhpa=: did you mean alpha=?" in _error(capsys, [*common, "--lora", "r=4,alhpa=8"])
    assert "r= takes a whole number above 0, got '0'" in _error(capsys, [*common, "--lora", "r=0"])
    assert "gives no rank" in _error(capsys, [*common, "--lora", "targets=q_proj"])
    unknown = _write(tmp_path, "unknown.json", {"model_type": "not-a-model", "hidden_size": 8})
    line = _error(capsys, ["--hf-config", str(unknown), "--batch", "2", "--seq", "8"])
    assert f"--hf-config {unknown} is not a config transformers reads" in line and "not-a-model" in line
    assert not (tmp_path / "plan.json").exists()


def _parallelized_by_hand(config: dict[str, Any]) -> torch.nn.Module:
    """The config's model parallelized as a training script does: each layer by the model's own
    ``base_model_tp_plan`` over the mesh's ``tp`` dim, then ``fully_shard`` per layer and the root over ``dp``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _by_hand(config)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {k.removeprefix("layers.*."): styles[v]() for k, v in model.config.base_model_tp_plan.items()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


@pytest.mark.slow  # a plan and a direct profile (12 s); the copy itself: tests/test_tensor_parallel.py
def test_tp_plans_one_rank_of_the_model_parallelize_module_and_fully_shard_make(tmp_path, capsys):
    # --tp 2 --fsdp 2: the model's own base_model_tp_plan on 2 x 2 devices, against the same model parallelized and
    # sharded for real (torch's fake process group of 4 ranks: this process is rank 0) and profiled directly.
    from conftest import fake_ranks

    config = {**LLAMA, "use_cache": False}  # one dry run (with caches on, the plain step is profiled twice)
    path = _write(tmp_path, "llama.json", config)
    flags = ["--device", "H100-SXM", "--budget-gb", "70", "--tp", "2", "--fsdp", "2", "--fsdp-units", "model.layers.*"]
    _, profile, plan = _cli(capsys, tmp_path, path, *flags)
    with fake_ranks(4):
        direct = _direct(_parallelized_by_hand(config), "H100-SXM")
    assert profile["peak_bytes"] == direct.peak_bytes
    assert (
        plan.unconstrained_peak_bytes
        == solve_plan(direct, 70, world_size=2, sharding="sharded").unconstrained_peak_bytes
    )
    # One rank's shards: half of each split linear, then half of that over FSDP's 2 ranks (the optimizer's moments).
    assert profile["modules"][""]["optimizer_state_bytes"] == direct.modules[""].optimizer_state_bytes


def test_wrong_tp_inputs_get_one_line(tmp_path, capsys):
    path = str(_write(tmp_path, "config.json", LLAMA))
    common = ["--hf-config", path, "--batch", "2", "--seq", "8"]
    assert "at least 2, got 1" in _error(capsys, [*common, "--tp", "1"])
    assert "but no --tp T says over how many" in _error(
        capsys, [*common, "--tp-plan", "model.layers.*.mlp.up_proj=colwise"]
    )
    assert "does not split evenly over 3" in _error(capsys, [*common, "--tp", "3"])
    assert "split 'sequence'" in _error(capsys, [*common, "--tp", "2", "--tp-plan", "model.norm=sequence"])
    assert "'model.blocks.*' name no module" in _error(
        capsys, [*common, "--tp", "2", "--tp-plan", "model.blocks.*=colwise"]
    )
    no_plan = str(
        _write(
            tmp_path,
            "gpt2.json",
            {
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "n_embd": 64,
                "n_layer": 2,
                "n_head": 4,
                "vocab_size": 128,
            },
        )
    )
    assert "has no Hugging Face base_model_tp_plan" in _error(
        capsys, ["--hf-config", no_plan, "--batch", "2", "--seq", "8", "--tp", "2"]
    )
