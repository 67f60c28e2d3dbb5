"""The GPU suite runs only where CUDA is: elsewhere every test in this folder is collected and skipped, with why."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from .harness import FigureWriter

HERE = Path(__file__).parent
SKIP_REASON = "needs a CUDA device: torch.cuda.is_available() is False"

if torch.cuda.is_available():
    # Deterministic cuBLAS (the bit-equality tests) needs one of two workspace configurations, read when cuBLAS makes
    # its first handle: set before any test touches cuBLAS. ":4096:8" (32 MiB per handle) is torch's default from
    # Hopper on, so the suite measures the workspaces a user's run has; older GPUs default to 8 MiB + 128 KiB and get
    # ":16:8" (128 KiB), below what the device spec sets aside for them, never above.
    hopper_or_later = torch.cuda.get_device_capability()[0] >= 9
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8" if hopper_or_later else ":16:8")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's hook sees the whole session's items: mark only this folder's.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(skip)


@pytest.fixture
def figure(request: pytest.FixtureRequest, record_property: Callable[[str, object], None]) -> FigureWriter:
    """Record a figure of this test with the GPU's name (see :class:`~gpu.harness.FigureWriter`)."""
    return FigureWriter(request.node.nodeid, torch.cuda.get_device_name(), record_property)
