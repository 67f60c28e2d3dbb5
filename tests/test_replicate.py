"""A deep model of identical layers is dry-run with 4, 5 and 6 of them and its profile extended (issue "The largest
models": 405B-class plans in seconds).

The extension must give the profile the whole dry run gives, every byte, index and name equal (milliseconds to
1e-9, summed in another order), or not be used: a model whose layers differ, or whose records are not affine in the
number of layers, is dry-run whole.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM
from zoo import _llama_config

import lightning_sac.profiling.profile as profile_module
from lightning_sac import profile_model
from lightning_sac.profiling import replicate
from lightning_sac.profiling.extend import Item, NotExtensible, extend_list
from lightning_sac.profiling.replicate import _differences, repeated_layers


def _records(layers: int, descending: bool = False) -> list[Item]:
    """A list as a step records it: a head, two records per layer (the first layer has one more), a tail.

    Each number is affine in the layer (``lam``) and in the number of layers, as memory and indices are.
    """
    out = [Item("embed", (10 * layers,))]
    for lam in range(layers - 1, -1, -1) if descending else range(layers):
        out.append(Item("a", (lam, 100 + 5 * lam + 3 * layers)))
        if lam == 0:
            out.append(Item("first-only", (layers,)))
        out.append(Item("b", (lam, 200 + 7 * lam + layers)))
    out.append(Item("head", (2 * layers, 9)))
    return out


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("layers", [5, 6, 9, 80])
def test_a_list_is_extended_to_the_list_of_more_layers(descending, layers):
    got = extend_list(_records(4, descending), _records(5, descending), layers - 4, lambda _: descending)
    assert got == _records(layers, descending)


def test_one_more_layer_gives_the_longer_list_back():
    a, b = _records(4), _records(5)
    assert extend_list(a, b, 1) == b


def test_lists_that_differ_by_more_than_an_insertion_are_not_extended():
    a, b = _records(4), _records(5)
    b[0] = Item("another embed", b[0].nums)
    with pytest.raises(NotExtensible, match="not an insertion"):
        extend_list(a, b, 3)


def _llama(layers: int) -> nn.Module:
    """The zoo's tiny Llama (KV caches on by default, as a pretrained config has them) with ``layers`` layers."""
    config = _llama_config()
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def test_the_layer_list_is_found_and_a_layer_that_differs_is_seen():
    model = _llama(8)
    assert repeated_layers(model, min_layers=8) == ("model.layers", model.get_submodule("model.layers"))
    assert repeated_layers(model) is None  # fewer layers than replication pays for
    # Every layer keeps the config, whose text has the transformers version ("5.24.0"): not a layer's position.
    config = _llama_config()
    config.num_hidden_layers = 40
    with torch.device("meta"):
        deep = LlamaForCausalLM(config)
    assert repeated_layers(deep) == ("model.layers", deep.get_submodule("model.layers"))
    # layer_idx differs in every layer (it is the position); a sliding window set on one layer is a difference.
    model.get_submodule("model.layers.3.self_attn").sliding_window = 16
    assert repeated_layers(model, min_layers=8) is None
    model = _llama(8)
    model.get_submodule("model.layers.5.mlp").register_forward_hook(lambda *_: None)
    assert repeated_layers(model, min_layers=8) is None
    # PEFT keeps each adapted layer's own name in an attribute: the same name but for the layer's position.
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(_llama(8), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert repeated_layers(peft, min_layers=8) == ("base_model.model.model.layers", peft.base_model.model.model.layers)


class _Counted:
    """``dry_run`` that notes how many layers the model had at each call."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers, self.calls = layers, []
        self.real = profile_module.dry_run

    def __call__(self, *args, **kwargs):
        self.calls.append(len(self.layers))
        return self.real(*args, **kwargs)


def _both(model, batch, monkeypatch, layers, device="H100-SXM"):
    monkeypatch.setattr(replicate, "MIN_LAYERS", 7)
    counted = _Counted(layers)
    monkeypatch.setattr(profile_module, "dry_run", counted)
    kwargs = dict(optimizer_factory=lambda ps: torch.optim.AdamW(ps), device=device)
    extended = profile_model(model, batch, **kwargs)
    runs = list(counted.calls)
    whole = profile_model(model, batch, replicate=False, **kwargs)
    return extended, whole, runs


@pytest.mark.slow  # 15 s: the mechanism's quick tests below run small models through the same path
def test_a_lora_decoder_profile_made_from_four_five_and_six_layers_is_the_whole_one(monkeypatch):
    from peft import LoraConfig, get_peft_model

    # KV caches on (as a pretrained config has them); frozen embeddings: the first layer's backward runs fewer
    # modules than the others'.
    model = get_peft_model(_llama(7), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    layers = model.get_submodule("base_model.model.model.layers")
    ids = torch.randint(3, 128, (2, 16))
    extended, whole, runs = _both(model, {"input_ids": ids, "labels": ids}, monkeypatch, layers)
    assert runs == [4, 5, 6]
    assert _differences(extended, whole) == []
    assert len(extended.timeline) == len(whole.timeline)
    assert any(f.endswith("layers.6.mlp") for f in extended.modules)
    assert extended.kv_cache_off and extended.kv_cache_peak == whole.kv_cache_peak  # the step with caches on too
    # The model is given back with all its layers, the same modules.
    assert len(layers) == 7 and [type(x) for x in layers] == [type(layers[0])] * 7


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(16), nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class _Blocks(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(_Block() for _ in range(n))
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_residual_stack_made_from_four_five_and_six_blocks_is_the_whole_one(monkeypatch, caplog):
    model = _Blocks(9)
    with caplog.at_level(logging.INFO, logger=replicate.__name__):
        extended, whole, runs = _both(model, (torch.randint(0, 32, (4, 8)),), monkeypatch, model.blocks, device="cpu")
    assert runs == [4, 5, 6]
    assert "the profile of 9 layers of blocks is extended from dry runs of (4, 5, 6) of them" in caplog.text
    assert _differences(extended, whole) == []
    assert extended.peak_bytes == whole.peak_bytes and "blocks.8.fc1" in extended.modules


class _SquareScratch(torch.autograd.Function):
    """The identity, whose backward makes a temporary that grows with the square of the layer's position."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, position: int) -> torch.Tensor:  # noqa: ANN001
        ctx.position = position
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        scratch = torch.ones(64 * (ctx.position + 1) ** 2, dtype=grad.dtype) * 2
        return grad + scratch.sum() * 0, None


class _Squares(nn.Module):
    """A layer whose backward's temporary is not affine in its position (its forward's ops are the same)."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SquareScratch.apply(torch.relu(self.fc(x)), self.layer_idx)


class _Stack(nn.Module):
    def __init__(self, n: int, by_count: bool = False) -> None:
        super().__init__()
        self.n, self.by_count = n, by_count
        self.layers = nn.ModuleList(_Squares(i) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = [self.layers[i] for i in range(self.n)] if self.by_count else self.layers
        for layer in layers:
            x = layer(x)
        return x


class _Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        h = self.fc(x)
        return torch.cat([h, h], -1)[..., :16] if wide else torch.relu(h)


class _EveryFourth(nn.Module):
    """Layers of one class, every fourth told by its caller to run other ops (as a global-attention layer)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Wide() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, wide=i % 4 == 3)
        return x


def test_records_that_are_not_affine_in_the_layer_are_dry_run_whole(monkeypatch, caplog):
    model = _Stack(9)
    # On the CPU (no allocation trace, whose records would already differ in size) the timeline's bytes differ.
    with caplog.at_level(logging.INFO, logger=replicate.__name__):
        extended, whole, runs = _both(model, (torch.randn(4, 16),), monkeypatch, model.layers, device="cpu")
    assert runs == [4, 5, 6, 9]
    assert "the 6-layer profile differs" in caplog.text
    assert _differences(extended, whole) == []


def test_a_model_that_needs_all_its_layers_is_dry_run_whole(monkeypatch, caplog):
    model = _Stack(9, by_count=True)  # indexes its layers up to a count it keeps: IndexError with fewer
    with caplog.at_level(logging.INFO, logger=replicate.__name__):
        extended, whole, runs = _both(model, (torch.randn(4, 16),), monkeypatch, model.layers)
    assert runs == [4, 9]
    assert "IndexError" in caplog.text
    assert _differences(extended, whole) == [] and len(model.layers) == 9


def test_layers_called_with_arguments_of_their_own_are_dry_run_whole(monkeypatch, caplog):
    model = _EveryFourth(9)
    with caplog.at_level(logging.INFO, logger=replicate.__name__):
        extended, whole, runs = _both(model, (torch.randn(4, 16),), monkeypatch, model.layers)
    assert runs == [4, 5, 6, 9]
    assert "called with different arguments" in caplog.text
    assert _differences(extended, whole) == []
