"""Keep torch.profiler's native start/stop chatter off the user's console, and nothing else.

Kineto (torch 2.13's CPU wheel) writes ``USDT: ... profiler_start`` / ``profiler_stop`` and ``STAGE: ...`` lines
straight to file descriptor 2 from C++ each time a profiler starts or stops, whatever ``KINETO_LOG_LEVEL`` says.
``sys.stderr`` cannot catch them, so :func:`filtered_native_stderr` points descriptor 2 at a temporary file
around the profiler's own start and stop only (never around the user's code) and writes back every line that is
not that chatter: a real warning printed there still reaches the user.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

from torch.profiler import profile

__all__ = ["QuietProfile", "filtered_native_stderr", "is_profiler_chatter"]

# "USDT:2026-11-23 12:20:27 17888:17888 SyncActivityProfilerHandler.cpp:52] profiler_start"
_CHATTER = re.compile(r"^(USDT|STAGE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.cpp:\d+\] ")


def is_profiler_chatter(line: str) -> bool:
    """Whether ``line`` is one of Kineto's status lines (``USDT: ...`` / ``STAGE: ...``)."""
    return _CHATTER.match(line) is not None


@contextlib.contextmanager
def filtered_native_stderr() -> Iterator[None]:
    """Drop Kineto's status lines written to descriptor 2 inside the block; pass every other line through.

    Where descriptor 2 cannot be redirected (no such descriptor), the block runs unchanged.
    """
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace")
    kept = [line for line in text.splitlines(keepends=True) if not is_profiler_chatter(line)]
    if kept:
        sys.stderr.write("".join(kept))
        sys.stderr.flush()


class QuietProfile(profile):
    """``torch.profiler.profile`` whose start and stop print no Kineto status lines (see the module docstring).

    Takes the same arguments; only :meth:`start` and :meth:`stop` differ, so the profiled code's own output is
    untouched.
    """

    def start(self) -> None:
        """Start profiling, filtering Kineto's status lines."""
        with filtered_native_stderr():
            super().start()

    def stop(self) -> None:
        """Stop profiling, filtering Kineto's status lines."""
        with filtered_native_stderr():
            super().stop()
