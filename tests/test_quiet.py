"""torch.profiler's Kineto status lines stay off the console; every other line written meanwhile still shows."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lightning_sac.dryrun.measured import QuietProfile, filtered_native_stderr, is_profiler_chatter

CHATTER = "USDT:2026-11-23 12:20:27 17888:17888 SyncActivityProfilerHandler.cpp:52] profiler_start\n"


def test_only_the_status_lines_are_dropped(capfd):
    with filtered_native_stderr():
        os.write(2, CHATTER.encode())
        os.write(2, b"a real warning from C++\n")
        os.write(2, CHATTER.replace("USDT", "STAGE").encode())
    assert capfd.readouterr().err == "a real warning from C++\n"
    assert is_profiler_chatter(CHATTER) and not is_profiler_chatter("USDT probes are fine in prose\n")


def test_quiet_profile_records_the_same_events_without_the_chatter(capfd):
    def step() -> None:
        torch.ones(1024).add_(1).sum()

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as loud:
        step()
    printed = capfd.readouterr().err
    if not any(map(is_profiler_chatter, printed.splitlines(keepends=True))):
        pytest.skip("this torch's profiler prints no Kineto status lines")
    with QuietProfile(activities=[ProfilerActivity.CPU], profile_memory=True) as quiet:
        step()
    assert capfd.readouterr().err == ""

    def allocations(prof: profile) -> list[int]:
        return [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]

    assert allocations(quiet) == allocations(loud) and allocations(quiet)


@pytest.mark.slow  # a fresh interpreter
def test_the_solver_prints_no_banner_and_the_users_output_stays(tmp_path):
    # HiGHS prints its two-line banner from C++ once per process, at the first instance: a fresh interpreter.
    script = tmp_path / "solve.py"
    script.write_text(
        "import os\n"
        "from lightning_sac.solver.highs import new_highs\n"
        "print('before', flush=True)\n"
        "new_highs(time_limit_s=1.0, mip_gap=0.01)\n"
        "os.write(1, b'native output of the user\\n')\n"
        "print('after')\n"
    )
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]  # this checkout's package, whatever is installed
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True, env=env)
    assert done.stdout == "before\nnative output of the user\nafter\n"
    assert "HiGHS" not in done.stderr


@pytest.mark.slow  # a fresh interpreter each
@pytest.mark.parametrize("quiet", [True, False])
def test_a_measured_step_prints_no_unknown_block_notice_of_the_allocator(tmp_path, quiet):
    # c10 logs the notice at the process's first free, under a memory profiler, of a block from before it started:
    # a fresh interpreter each, the plain profiler as the control that shows it.
    profiler = "QuietProfile" if quiet else "profile"
    script = tmp_path / "step.py"
    script.write_text(
        "import torch\n"
        "from torch.profiler import profile\n"
        "from lightning_sac.dryrun.measured import QuietProfile\n"
        "older = torch.ones(1024)\n"
        f"with {profiler}(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True):\n"
        "    del older\n"
        "    (torch.ones(8) * 2).sum()\n"
        "print('done')\n"
    )
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True, env=env)
    assert done.stdout == "done\n"
    assert ("Memory block of unknown size" in done.stderr) is not quiet, done.stderr
