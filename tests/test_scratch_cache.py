"""Measured CPU kernel scratch kept on disk (lightning_sac/dryrun/cpu/scratch_store.py).

A fresh :class:`KernelScratch` stands for a fresh process (a re-run, a DDP rank, a resumed fit): with the same cache
directory it measures nothing and answers the same bytes; another thread count or torch version measures again; a
corrupt file is reported once and measured past; a directory that cannot be written is reported, not raised.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import lightning_sac.dryrun.emulation as emulation
import lightning_sac.dryrun.recorded_step as recorded_step
from lightning_sac import profile_model
from lightning_sac.dryrun.cpu.scratch import KernelScratch, scratch_bound
from lightning_sac.dryrun.cpu.scratch_store import CACHE_DIR_ENV, ScratchStore, default_cache_dir

aten = torch.ops.aten
_BACKWARD = aten.convolution_backward.default


def _calls(fake: bool = True) -> list[tuple[tuple, dict]]:
    """Three convolution backward signatures of a small net: a 3x3, a 1x1 expansion, a stem without grad_input."""
    mode = FakeTensorMode() if fake else None
    calls = []
    for c_in, c_out, k, mask in ((16, 16, 3, [True] * 3), (16, 64, 1, [True] * 3), (3, 16, 3, [False, True, True])):
        x, w, grad = torch.zeros(2, c_in, 8, 8), torch.zeros(c_out, c_in, k, k), torch.zeros(2, c_out, 8, 8)
        if mode is not None:
            x, w, grad = (mode.from_tensor(t) for t in (x, w, grad))
        calls.append(((grad, x, w, [c_out], [1, 1], [k // 2] * 2, [1, 1], False, [0, 0], 1, mask), {}))
    return calls


def _answers(scratch: KernelScratch) -> list[int | None]:
    return [scratch(_BACKWARD, args, kwargs, None) for args, kwargs in _calls()]


def _refuse(*args, **kwargs):
    raise AssertionError("a signature on disk must not be run again")


def test_a_second_process_with_the_same_cache_measures_nothing_and_answers_the_same_bytes(tmp_path, monkeypatch):
    first = KernelScratch(cache_dir=tmp_path)
    measured = _answers(first)
    assert first.measured == 3 and first.loaded == 0
    assert all(isinstance(b, int) for b in measured) and sum(measured) > 0  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())  # nothing written until the dry run's end saves
    first.save()
    (path,) = tmp_path.iterdir()
    assert len(json.loads(path.read_text())["scratch"]) == 3

    monkeypatch.setattr(KernelScratch, "_measure", staticmethod(_refuse))
    second = KernelScratch(cache_dir=tmp_path)
    assert _answers(second) == measured
    assert second.measured == 0 and second.loaded == 3
    # Under a running profiler (a fit's measured step) a signature on disk is the kernel's figure, not the bound.
    third = KernelScratch(cache_dir=tmp_path)
    args, kwargs = _calls()[1]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        during = third(_BACKWARD, args, kwargs, None)
    assert during == measured[1] < scratch_bound(_BACKWARD, args, kwargs, None)


def test_another_thread_count_or_torch_version_measures_again(tmp_path, monkeypatch):
    first = KernelScratch(cache_dir=tmp_path)
    _answers(first)
    first.save()

    threads = torch.get_num_threads()
    other = KernelScratch(cache_dir=tmp_path)
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        _answers(other)
    finally:
        torch.set_num_threads(threads)
    assert other.measured == 3 and other.loaded == 0
    other.save()  # both thread counts in one file: the environment is the same
    assert len(list(tmp_path.iterdir())) == 1

    monkeypatch.setattr(torch, "__version__", "0.0.0+another")
    upgraded = KernelScratch(cache_dir=tmp_path)
    _answers(upgraded)
    assert upgraded.measured == 3 and upgraded.loaded == 0
    upgraded.save()  # another torch: another file beside the first
    assert len(list(tmp_path.iterdir())) == 2


@pytest.mark.parametrize("content", ["{not json", '{"format": 1, "environment": {}, "scratch": {"k": 1}}', "[]"])
def test_a_corrupt_cache_is_reported_once_and_measured_past(tmp_path, content):
    path = ScratchStore(tmp_path).path
    path.write_text(content)
    scratch = KernelScratch(cache_dir=tmp_path)
    with pytest.warns(UserWarning, match="corrupt kernel scratch cache") as record:
        measured = _answers(scratch)
        scratch.save()  # reads the file again to merge: no second warning
    assert len([w for w in record if "kernel scratch" in str(w.message)]) == 1
    assert scratch.measured == 3
    # The save replaced the corrupt file with the measured entries: the next process reads them.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = KernelScratch(cache_dir=tmp_path)
        assert _answers(again) == measured
    assert again.measured == 0 and again.loaded == 3


def test_a_directory_that_cannot_be_written_is_reported_not_raised(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    scratch = KernelScratch(cache_dir=blocker / "cache")  # under a regular file: no directory can be made
    with pytest.warns(UserWarning, match="could not read its kernel scratch cache") as record:
        answers = _answers(scratch)
        scratch.save()  # cannot write either: reported by the one warning already given
    assert len([w for w in record if "kernel scratch" in str(w.message)]) == 1
    assert scratch.measured == 3 and answers == _answers(scratch)


def test_the_cache_directory_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "here"))
    assert default_cache_dir() == tmp_path / "here"
    monkeypatch.setenv(CACHE_DIR_ENV, "")  # empty: no disk cache
    assert default_cache_dir() is None
    off = KernelScratch()
    _answers(off)
    off.save()
    assert off.measured == 3 and not list(tmp_path.iterdir())
    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "lightning_sac"


def test_a_dry_run_saves_what_it_measured_and_the_next_one_reads_it(tmp_path, monkeypatch):
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(), torch.nn.Conv2d(16, 8, 1)
    )
    batch = (torch.randn(2, 3, 16, 16),)
    peaks, scratches = [], []
    for _ in range(2):  # two processes' dry runs of the same net, sharing one cache directory
        scratch = KernelScratch(cache_dir=tmp_path)
        monkeypatch.setattr(emulation, "kernel_scratch", scratch)
        monkeypatch.setattr(recorded_step, "kernel_scratch", scratch)
        peaks.append(profile_model(net, batch, device="cpu").plain_peak_bytes)
        scratches.append(scratch)
    assert scratches[0].measured > 0 and scratches[0].loaded == 0
    assert scratches[1].measured == 0 and scratches[1].loaded == scratches[0].measured
    assert peaks[0] == peaks[1]
