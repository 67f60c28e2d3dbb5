"""The README's quick-start output is what the example prints: the same lines in the same order, the same plan
table (modules and their count), numbers aside (timings and the step count differ from run to run)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Lines of Lightning's own (seed, accelerators, tips, a deprecation in its pytree helper), which the README trims.
LIGHTNING = ("Seed set", "GPU available", "TPU available", "💡", "`Trainer.fit` stopped")
_NUMBER = re.compile(r"[-+]?\d+(\.\d+)?")


def readme_block() -> list[str]:
    """The text block under the quick start's "It prints" line."""
    text = (REPO / "README.md").read_text()
    start = text.index("```text\n", text.index("It prints, less Lightning's own lines")) + len("```text\n")
    return text[start : text.index("```", start)].splitlines()


def shape(line: str, logdir: str) -> str:
    """A line with its numbers as ``#`` and the log folder as the README's."""
    return _NUMBER.sub("#", line.replace(logdir, "lightning_logs")).rstrip()


def test_the_readme_block_has_the_example_s_structure():
    block = readme_block()
    table = [line for line in block if line.startswith("model.")]
    assert len(table) >= 3 and block[1] == "AutoSAC plan (sac backend):" and block[-1].strip().startswith("open them")
    assert sum(line.startswith("AutoSAC measured the first planned step") for line in block) == 1
    # Every numbered line of the table: a module, then three numbers.
    assert all(re.fullmatch(r"model\.[\w.]+ +[\d.]+ +[\d.]+ +[\d.]+", line) for line in table)


@pytest.mark.slow  # the example's fit, a fresh interpreter
def test_the_example_prints_what_the_readme_shows(tmp_path):
    logdir = str(tmp_path / "logs")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}  # both streams in the order printed
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "gpt_autosac.py"), "--steps", "3", "--logdir", logdir],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    printed = [
        line
        for line in done.stdout.splitlines()
        if line.strip() and not line.startswith(LIGHTNING) and "site-packages/lightning" not in line
    ]
    ours = [shape(line, logdir) for line in printed]
    readme = [shape(line, logdir) for line in readme_block()]
    assert ours == readme, "\n".join(sorted(set(ours) ^ set(readme)))
    modules = [line.split()[0] for line in printed if line.startswith("model.")]
    assert modules == [line.split()[0] for line in readme_block() if line.startswith("model.")]
