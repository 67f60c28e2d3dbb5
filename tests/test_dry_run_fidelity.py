"""The dry run takes the real step's code path: real batch values, libraries' fake-tensor checks, keyword batches."""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from zoo import FAMILIES, lm_batch

from lightning_sac import ProfilingError, profile_model
from lightning_sac.adapters.caches import CacheSwitch
from lightning_sac.dryrun import fingerprint_of, profile_fingerprint
from lightning_sac.dryrun.measured import measure_training_step
from lightning_sac.dryrun.step import model_inputs, model_loss
from lightning_sac.dryrun.values.compat import real_step_answers
from lightning_sac.ops.aten import is_sac_ignored, op_name


class OpsPerModule(TorchDispatchMode):
    """The ops each module's first forward call runs, as the profile lists them (SAC-ignored ops left out)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.ops: dict[str, list[str]] = defaultdict(list)
        self.stack: list[str] = []
        self.done: set[str] = set()
        for fqn, m in model.named_modules():
            m.register_forward_pre_hook(self._enter(fqn))
            m.register_forward_hook(self._leave(fqn))

    def _enter(self, fqn: str) -> Any:
        def hook(*_: Any) -> None:
            self.stack.append(fqn)

        return hook

    def _leave(self, fqn: str) -> Any:
        def hook(*_: Any) -> None:
            self.stack.pop()
            self.done.add(fqn)

        return hook

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not is_sac_ignored(func):
            for fqn in self.stack:
                if fqn not in self.done:
                    self.ops[fqn].append(op_name(func))
        return func(*args, **(kwargs or {}))


def real_ops(model: nn.Module, batch: Any, loss_fn: Any = None) -> dict[str, list[str]]:
    """The ops of a real step as it runs under a plan: in training, without KV caches
    (``lightning_sac.adapters.caches``)."""
    model = copy.deepcopy(model)
    with CacheSwitch(model), OpsPerModule(model) as seen:
        model_loss(loss_fn)(model, model_inputs(batch)).backward()
    return seen.ops


# T5 with an all-ones mask (its encoder-decoder dry run takes 4 s) in the matrix tier; the decoders' all-ones
# case, which takes the causal path, and T5's padded row stay quick.
CASES = [
    pytest.param(name, padded, id=f"{name}-{'padded row' if padded else 'all-ones mask'}", marks=marks)
    for name in ("gpt2", "llama", "bert", "t5")
    for padded in (False, True)
    for marks in [[pytest.mark.slow] if name == "t5" and not padded else []]
]


@pytest.mark.parametrize(("name", "padded"), CASES)
def test_every_module_runs_the_ops_of_the_real_step(name, padded):
    # With an all-ones mask transformers hands attention None and is_causal; on fake masks it used to build a
    # full mask and take another path, so planned modules ran other ops than the plan listed.
    family = FAMILIES[name]()
    if not padded:
        family.batch["attention_mask"] = torch.ones_like(family.batch["attention_mask"])
    profile = profile_model(family.model, family.batch, loss_fn=family.loss_fn, device="cpu")
    real = real_ops(family.model, family.batch, family.loss_fn)
    compared = [f for f, m in profile.modules.items() if m.op_stats is not None]
    assert len(compared) > 5
    for fqn in compared:
        assert profile.modules[fqn].op_stats.func_names == real[fqn], fqn


def test_transformers_fake_tensor_check_answers_as_in_training():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.utils.import_utils import is_tracing

    with FakeTensorMode():
        fake = torch.empty(2, 3)
    assert is_tracing(fake)
    with real_step_answers() as patched:
        assert not is_tracing(fake)
    assert patched == ["transformers.utils.import_utils.is_fake_tensor"]
    assert is_tracing(fake)


class Lengths(nn.Module):
    """Trims the batch to its longest row (``.item()`` on the mask) and scores only the real tokens (``x[mask]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, 64)
        self.head = nn.Linear(64, 128)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        longest = int(attention_mask.sum(1).max())
        keep = attention_mask[:, :longest].bool()
        hidden = self.embed(input_ids[:, :longest])[keep]
        return F.cross_entropy(self.head(hidden), labels[:, :longest][keep])


def test_data_dependent_code_on_batch_values_profiles_as_it_runs():
    torch.manual_seed(0)
    model, batch = Lengths(), lm_batch(128, seq=64, pad_from=40)
    batch["attention_mask"][:, 56:] = 0  # every row padded from 56: the step trims to 56 tokens
    profile = profile_model(model, batch, loss_fn=lambda loss: loss, device="cpu")
    measured = measure_training_step(copy.deepcopy(model), batch, loss_fn=lambda loss: loss)
    assert profile.peak_bytes == measured.peak_bytes
    assert profile.modules[""].op_stats.func_names == real_ops(model, batch, lambda loss: loss)[""]
    # 4 x 56 token positions, 3 x 56 + 40 of them real: the embedding holds all, the head scores the real ones.
    assert profile.modules["embed"].output_bytes == 4 * 56 * 64 * 4
    assert profile.modules["head"].output_bytes == (3 * 56 + 40) * 128 * 4
    # The user's batch is not touched (the dry run works on a copy).
    assert batch["attention_mask"][:, 56:].sum() == 0 and batch["input_ids"].dtype == torch.int64


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if (h > 0).any():  # a decision on values derived from the weights
            h = h * 2
        return h


def test_a_decision_on_weight_derived_values_names_op_module_and_line():
    with pytest.raises(ProfilingError, match="example_batch=.*strict=False") as info:
        profile_model(nn.Sequential(Branchy()), (torch.randn(4, 8),), device="cpu")
    err = info.value
    assert err.module == "0" and err.op in ("aten.is_nonzero.default", "aten._local_scalar_dense.default")
    assert err.source is not None and "test_dry_run_fidelity.py" in err.source and "(h > 0).any()" in err.source
    assert err.source in str(err)


def test_keyword_positional_and_mixed_batches_profile_alike():
    family = FAMILIES["gpt2"]()
    batch = family.batch
    rest = {"attention_mask": batch["attention_mask"], "labels": batch["labels"]}
    by_keyword = profile_model(family.model, batch, device="cpu")
    mixed = profile_model(family.model, (batch["input_ids"],), example_kwargs=rest, device="cpu")
    assert by_keyword.peak_bytes == mixed.peak_bytes and by_keyword.input_signature == mixed.input_signature
    assert profile_fingerprint(by_keyword) == fingerprint_of(family.model, batch)
    assert profile_fingerprint(mixed) == fingerprint_of(family.model, (batch["input_ids"],), rest)
    with pytest.raises(TypeError, match="tuple of positional inputs .* or a dict of keyword inputs"):
        profile_model(family.model, batch["input_ids"], device="cpu")
    with pytest.raises(TypeError, match="already a dict"):
        profile_model(family.model, batch, example_kwargs={"labels": batch["labels"]}, device="cpu")
