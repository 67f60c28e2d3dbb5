"""Measured CPU kernel scratch kept on disk, so that a second process on this host measures nothing again.

A re-run of a script, each rank of a DDP job and a resumed fit start a fresh process, and each would measure
every signature of its model again (:mod:`lightning_sac.dryrun.cpu.scratch`): about 30 ms a signature on two
threads of a busy host. The answers are kept in one JSON file per environment, in the user's cache directory:
``$LIGHTNING_SAC_CACHE_DIR`` if set (an empty value turns the disk cache off), else
``$XDG_CACHE_HOME/lightning_sac``, else ``~/.cache/lightning_sac``.

The file is named by a hash of everything of the process that can change a kernel's scratch without showing in a
call's signature: torch's version and build configuration (oneDNN's version among it), the CPU capability torch
dispatches to, whether oneDNN is built in, the CPU's model name and oneDNN's environment variables. The entries
inside are keyed by the signature and the per-call settings (thread count, oneDNN switches). A write goes to a
temporary file that replaces the old one (:func:`os.replace`), merged with what other processes wrote meanwhile;
two processes writing at once can lose one's new entries, which are then measured again, never wrong. A file
that cannot be read or parsed, or a directory that cannot be written, is reported once by a warning and
otherwise ignored: the measurement then happens in the process, as without a disk cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
import warnings
from pathlib import Path

import torch

__all__ = ["CACHE_DIR_ENV", "ScratchStore", "default_cache_dir", "scratch_environment"]

CACHE_DIR_ENV = "LIGHTNING_SAC_CACHE_DIR"
_FORMAT = 1
# A host that profiles many models keeps the newest entries only, so that loading the file stays a few
# milliseconds (an entry is about 300 bytes of JSON).
MAX_ENTRIES = 20_000


def default_cache_dir() -> Path | None:
    """``$LIGHTNING_SAC_CACHE_DIR``, ``$XDG_CACHE_HOME/lightning_sac`` or ``~/.cache/lightning_sac``; ``None``: off.

    An empty ``LIGHTNING_SAC_CACHE_DIR`` turns the disk cache off.
    """
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured is not None:
        return Path(configured).expanduser() if configured else None
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "lightning_sac"


@functools.cache
def _cpu_model() -> str:
    """The CPU's model name (oneDNN's blocking follows its caches, not only its instruction set), or the machine."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # not Linux: the architecture and processor platform reports
        pass
    return f"{platform.machine()} {platform.processor()}".strip()


def scratch_environment() -> dict[str, str]:
    """What of this process changes a kernel's scratch without showing in the call: the cache file's key."""
    return {
        "torch": torch.__version__,
        # oneDNN's version and the build's options are in torch's build configuration, not in its version alone.
        "build": hashlib.sha256(torch.__config__.show().encode()).hexdigest()[:16],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_available": str(torch.backends.mkldnn.is_available()),
        "cpu": _cpu_model(),
        # ONEDNN_MAX_CPU_ISA, DNNL_DEFAULT_FPMATH_MODE and the like change oneDNN's kernels.
        "onednn_env": ";".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("ONEDNN_", "DNNL_"))),
    }


class ScratchStore:
    """The measured scratch of one environment, in one JSON file of a cache directory.

    Args:
        directory: Where the file lives; created on the first write.
        environment: What the file is for; ``None``: :func:`scratch_environment` of this process now.

    Attributes:
        path: The file.
    """

    def __init__(self, directory: str | os.PathLike[str], environment: dict[str, str] | None = None) -> None:
        self.environment = scratch_environment() if environment is None else environment
        digest = hashlib.sha256(json.dumps(self.environment, sort_keys=True).encode()).hexdigest()[:20]
        self.path = Path(directory) / f"cpu_scratch-{digest}.json"
        self._warned = False

    def _warn(self, message: str) -> None:
        # Once per store: a dry run reads and writes the file more than once, and one report says it all.
        if not self._warned:
            self._warned = True
            warnings.warn(f"{message}; kernel scratch is measured in this process instead.", stacklevel=3)

    def load(self) -> dict[str, int]:
        """The entries the file holds; empty when there is no file, or when it cannot be read (warned once)."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as err:
            self._warn(f"lightning_sac could not read its kernel scratch cache {self.path} ({err})")
            return {}
        try:
            data = json.loads(text)
            entries = data["scratch"] if data.get("format") == _FORMAT else {}
            if data.get("environment", self.environment) != self.environment or not isinstance(entries, dict):
                raise ValueError("its environment or its entries are not this file's")
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in entries.values()):
                raise ValueError("an entry is not a byte count")
        except (ValueError, AttributeError, KeyError, TypeError) as err:  # JSONDecodeError is a ValueError
            self._warn(f"lightning_sac ignores its corrupt kernel scratch cache {self.path} ({err})")
            return {}
        return entries

    def save(self, new: dict[str, int]) -> None:
        """Add ``new`` to the file's entries (as on disk now), written atomically; a failure is warned once."""
        if not new:
            return
        entries = {**self.load(), **new}
        if len(entries) > MAX_ENTRIES:
            entries = dict(list(entries.items())[-MAX_ENTRIES:])
        payload = json.dumps({"format": _FORMAT, "environment": self.environment, "scratch": entries})
        tmp: str | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=self.path.name, suffix=".tmp", dir=self.path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(payload)
            os.replace(tmp, self.path)  # readers see the old file or the new one, never a part
            tmp = None
        except OSError as err:
            self._warn(f"lightning_sac could not write its kernel scratch cache {self.path} ({err})")
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
