"""Shared test models: a small GPT with dropout, an MLP and a conv net, each with inputs and a loss.

Two tiers. ``python -m pytest -q -n 2`` runs the quick tier (pyproject's ``addopts`` deselects ``slow``) on both
cores: every module's behaviour on small models, in at most 5 minutes on 2 cores. ``python -m pytest -q -m slow``
runs the matrix tier; ``.ci/run`` runs both. A new test is quick unless it needs more than one process (world size 2
or 4, a fresh interpreter, the installed entry point), the inductor compile, or a real-model fit of more than about
10 s here that a quick test of the same behaviour already covers: then mark it ``@pytest.mark.slow``. Before
marking, make it cheaper: a session- or module-scoped fixture for a profile that tests only read, shapes no
larger than the assertion needs, in-process calls rather than subprocesses, no sleeps. No test asserts a timing
ratio: calibration and benchmark figures are checked for what was measured and how, and their quality is
printed by ``benchmarks/``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_sac import ModelProfile, ModuleOpStats, profile_model
from lightning_sac.demos import GPT, MLP, ConvNet, GPTConfig
from lightning_sac.dryrun.cpu.scratch_store import CACHE_DIR_ENV
from lightning_sac.ops.aten import is_sac_ignored, op_name
from lightning_sac.solver.tradeoff import module_tradeoff


@pytest.fixture(scope="session", autouse=True)
def _no_panels_left_in_the_working_directory():  # noqa: ANN202
    # AutoSAC writes its panels under the Trainer's default_root_dir, the working directory unless a test names one.
    logs = Path.cwd() / "lightning_sac_logs"
    existed = logs.exists()
    yield
    assert existed or not logs.exists(), f"a test left {logs}: give its Trainer default_root_dir=tmp_path"


@pytest.fixture(scope="session", autouse=True)
def _kernel_scratch_cached_in_a_temporary_directory(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN202
    # The dry run keeps measured CPU kernel scratch in the user's cache directory: the tests keep theirs in a
    # directory of this session (subprocesses inherit it), never in the real home or the repository.
    previous = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(tmp_path_factory.mktemp("lightning_sac_cache"))
    yield
    if previous is None:
        del os.environ[CACHE_DIR_ENV]
    else:
        os.environ[CACHE_DIR_ENV] = previous


# The mode the session started in: a module-scoped fixture's fit can turn it on before a test's own fixture runs.
_SESSION_DETERMINISTIC = (
    torch.are_deterministic_algorithms_enabled(),
    torch.is_deterministic_algorithms_warn_only_enabled(),
)


@pytest.fixture(autouse=True)
def _deterministic_mode_restored():  # noqa: ANN202
    # Trainer(deterministic=True) turns deterministic algorithms on for the process and never off; they pick some
    # kernels (cuDNN attention is refused under them), so each test starts from the mode the session started in.
    torch.use_deterministic_algorithms(_SESSION_DETERMINISTIC[0], warn_only=_SESSION_DETERMINISTIC[1])
    yield
    torch.use_deterministic_algorithms(_SESSION_DETERMINISTIC[0], warn_only=_SESSION_DETERMINISTIC[1])


@dataclass
class Case:
    name: str
    model: nn.Module
    inputs: tuple[Any, ...]
    loss_fn: Callable[[Any], torch.Tensor] | None


GPT_CONFIG = GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=128, dropout=0.1)


def gpt_case() -> Case:
    torch.manual_seed(0)
    idx = torch.randint(0, GPT_CONFIG.vocab_size, (4, 128))
    targets = torch.randint(0, GPT_CONFIG.vocab_size, (4, 128))

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return Case("gpt", GPT(GPT_CONFIG), (idx,), loss)


def mlp_case() -> Case:
    torch.manual_seed(0)
    return Case("mlp", nn.Sequential(MLP(256, 1024), nn.ReLU(), MLP(256, 1024)), (torch.randn(64, 256),), None)


def conv_case() -> Case:
    torch.manual_seed(0)
    labels = torch.randint(0, 10, (16,))
    return Case(
        "conv",
        ConvNet(width=16),
        (torch.randn(16, 3, 32, 32),),
        lambda out: nn.functional.cross_entropy(out, labels),
    )


CASES = {"gpt": gpt_case, "mlp": mlp_case, "conv": conv_case}


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]()


@contextlib.contextmanager
def fake_ranks(world_size: int) -> Iterator[None]:
    """This process as rank 0 of torch's ``fake`` process group of ``world_size`` ranks: FSDP shards as over a real
    one, its collectives move no data and need no other process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


@functools.cache
def _gpt_profile_json(device: str) -> str:
    case = gpt_case()
    return profile_model(
        case.model, case.inputs, loss_fn=case.loss_fn, optimizer_factory=adamw, device=device
    ).to_json()


def gpt_profile(device: str = "cpu") -> ModelProfile:
    """The test GPT's profile with AdamW for ``device``: profiled once per session, a fresh copy for each caller."""
    return ModelProfile.from_json(_gpt_profile_json(device))


def recompute_all_policy(stats: ModuleOpStats) -> list[int]:
    """Every op recomputed but those a policy must save (stateful ops, in-place writes to outside storage...)."""
    forced = {i for unit in module_tradeoff(stats).stored for i in unit.ops}
    return [int(i in forced) for i in range(len(stats.func_names))]


class SacOps(TorchDispatchMode):
    """Records the names of the ops SAC asks its policy about (SAC-ignored ones left out, as in a profile).

    Args:
        names: The list to append to (a fresh one when not given), read from :attr:`names`.
    """

    def __init__(self, names: list[str] | None = None) -> None:
        super().__init__()
        self.names = [] if names is None else names

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not is_sac_ignored(func):
            self.names.append(op_name(func))
        return func(*args, **(kwargs or {}))
