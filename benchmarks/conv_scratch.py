"""What the CPU's convolution, norm, resampling and pooling kernels allocate beyond their outputs, and what
measuring it costs a dry run.

``--ratios``: each signature below runs once on real tensors under the allocator's events
(``lightning_sac.dryrun.cpu.scratch.peak_beyond``), and its scratch is printed against its input (for a backward,
the forward's input) and against its operands. Otherwise: the conv nets of ``tests/test_conv_workspace.py``, each
profiled for the CPU target in a fresh process (the first profile of the process after an unrelated warm-up, so
the signatures are measured in it), best of ``--repeats``, with the disk cache of measured scratch empty (each
process measures every signature) and warm (a process before measured them; ``LIGHTNING_SAC_CACHE_DIR`` points
at a temporary directory either way); with the plain prediction against torch.profiler's allocator events of a
real step.

    python benchmarks/conv_scratch.py --ratios
    python benchmarks/conv_scratch.py --repeats 3
    python benchmarks/conv_scratch.py --family convnext  # one fresh-process timing, as JSON
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_sac.dryrun.cpu.scratch import kernel_scratch, peak_beyond  # noqa: E402

MIB = 2**20
aten = torch.ops.aten
# name, batch, c_in, c_out, size, kernel, stride, groups
CONVS = (
    ("3x3 64->64", 2, 64, 64, 32, 3, 1, 1),
    ("1x1 64->256", 2, 64, 256, 32, 1, 1, 1),
    ("1x1 256->64", 2, 256, 64, 32, 1, 1, 1),
    ("depthwise 7x7 64", 2, 64, 64, 32, 7, 1, 64),
    ("stem 3x3 3->64", 2, 3, 64, 32, 3, 1, 1),
    ("stem 7x7/2 3->64", 8, 3, 64, 56, 7, 2, 1),
    ("3x3/2 64->128", 8, 64, 128, 56, 3, 2, 1),
    ("grouped 3x3 64, g=4", 2, 64, 64, 32, 3, 1, 4),
)


def _conv_rows(channels_last: bool, dtype: torch.dtype) -> None:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    for name, n, c_in, c_out, size, k, stride, groups in CONVS:
        x = torch.randn(n, c_in, size, size, dtype=dtype).contiguous(memory_format=fmt)
        w = torch.randn(c_out, c_in // groups, k, k, dtype=dtype).contiguous(memory_format=fmt)
        rest = ([stride] * 2, [k // 2] * 2, [1, 1], False, [0, 0], groups)
        with torch.no_grad():
            y, forward = peak_beyond(lambda: aten.convolution.default(x, w, None, *rest))  # noqa: B023
            go = torch.randn_like(y)
            masks = ([True, True, True], [False, True, True])
            backward = [
                peak_beyond(lambda m=m: aten.convolution_backward.default(go, x, w, [c_out], *rest, m))[1]  # noqa: B023
                for m in masks
            ]
        xb, yb = x.nbytes, y.nbytes
        layout = "channels-last" if channels_last else "contiguous"
        print(
            f"| {name} | {layout} {str(dtype)[6:]} | {xb / MIB:.3f} | {forward / xb:.2f} | {backward[0] / xb:.2f} | "
            f"{backward[1] / xb:.2f} | {backward[0] / (xb + yb):.2f} |"
        )


def _other_cases(x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """Norm, resampling and pooling calls on ``x``; the gradients are contiguous, as a flatten or a mean gives."""
    half = F.max_pool2d(x, 2)
    grad = torch.randn(half.shape)
    _, idx = aten.max_pool2d_with_indices.default(x, [2, 2], [2, 2])
    mean, var = torch.zeros(64), torch.ones(64)
    return {
        "native_batch_norm_backward": lambda: aten.native_batch_norm_backward.default(
            x, x, torch.ones(64), mean, var, mean, var, True, 1e-5, [True, True, True]
        ),
        "native_layer_norm (permuted input)": lambda: aten.native_layer_norm.default(
            x.permute(0, 2, 3, 1), [64], None, None, 1e-5
        ),
        "upsample_nearest2d 2x": lambda: aten.upsample_nearest2d.default(x, [64, 64]),
        "upsample_bilinear2d 2x": lambda: aten.upsample_bilinear2d.default(x, [64, 64], False),
        "max_pool2d_with_indices_backward": lambda: aten.max_pool2d_with_indices_backward.default(
            grad, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx
        ),
        "avg_pool2d_backward": lambda: aten.avg_pool2d_backward.default(
            grad, x, [2, 2], [2, 2], [0, 0], False, True, None
        ),
        "_adaptive_avg_pool2d_backward": lambda: aten._adaptive_avg_pool2d_backward.default(grad, x),
    }


def _other_rows() -> None:
    for channels_last in (False, True):
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        x = torch.randn(4, 64, 32, 32).contiguous(memory_format=fmt)
        layout = "channels-last" if channels_last else "contiguous"
        for name, run in _other_cases(x).items():
            with torch.no_grad():
                _, scratch = peak_beyond(run)
            print(f"| {name} | {layout} | {x.nbytes / MIB:.3f} | {scratch / x.nbytes:.2f} |")


def _one(name: str) -> dict[str, float]:
    """The first CPU-target profile of ``name`` in this process, after a warm-up on an unrelated MLP."""
    from test_conv_workspace import FAMILIES

    from lightning_sac import profile_model
    from lightning_sac.dryrun.measured import measure_training_step

    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    profile_model(mlp, (torch.randn(4, 8),), device="cpu")
    family = FAMILIES[name]()
    start, cpu = time.perf_counter(), time.process_time()
    profile = profile_model(
        family.model, family.batch, loss_fn=family.loss_fn, optimizer_factory=family.optimizer, device="cpu"
    )
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    measured = measure_training_step(
        copy.deepcopy(family.model), family.batch, loss_fn=family.loss_fn, optimizer_factory=family.optimizer
    )
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "predicted": profile.plain_peak_bytes,
        "measured": measured.peak_bytes,
        "signatures_run": kernel_scratch.measured,
        "signatures_from_disk": kernel_scratch.loaded,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratios", action="store_true", help="Print the scratch of each signature and exit.")
    parser.add_argument("--repeats", type=int, default=3, help="Fresh processes per model; the best is reported.")
    parser.add_argument("--family", help=argparse.SUPPRESS)  # one timing, as JSON (the fresh process's part)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", file=sys.stderr)
    if args.family:
        print(json.dumps(_one(args.family)))
        return
    if args.ratios:
        print(
            "| convolution | layout | input MiB | forward / input | backward / input | without grad_input | "
            "backward / (input + grad_output) |"
        )
        print("|---|---|---|---|---|---|---|")
        _conv_rows(False, torch.float32)
        _conv_rows(True, torch.float32)
        _conv_rows(False, torch.bfloat16)
        print("\n| op | layout | input MiB | scratch / input |\n|---|---|---|---|")
        _other_rows()
        return
    from test_conv_workspace import FAMILIES

    print(
        f"| model | profile s, empty disk cache (best of {args.repeats}) | warm disk cache | "
        "plain predicted / measured MiB |"
    )
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for name in FAMILIES:
            warm = os.path.join(root, f"{name}-warm")
            _family_run(name, warm)  # fills the warm cache
            cold_runs, warm_runs = [], []
            for i in range(args.repeats):  # interleaved, so that the host's load weighs on both alike
                cold_runs.append(_family_run(name, os.path.join(root, f"{name}-cold-{i}")))
                warm_runs.append(_family_run(name, warm))
            best = min(cold_runs, key=lambda r: r["seconds"])
            error = (best["predicted"] - best["measured"]) / best["measured"]
            print(
                f"| {name} | {best['seconds']:.3f} | {min(r['seconds'] for r in warm_runs):.3f} | "
                f"{best['predicted'] / MIB:.3f} / {best['measured'] / MIB:.3f} ({error:+.2%}) |"
            )


def _family_run(name: str, cache_dir: str) -> dict[str, float]:
    """``--family name`` in a fresh process whose disk cache of measured scratch is ``cache_dir``."""
    env = {**os.environ, "LIGHTNING_SAC_CACHE_DIR": cache_dir}
    out = subprocess.run(
        [sys.executable, __file__, "--family", name], capture_output=True, text=True, check=True, env=env
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
