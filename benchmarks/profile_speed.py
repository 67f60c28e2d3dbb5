"""Time ``lightning_sac.profile_model`` against PyTorch's three-tracker pipeline on GPT models of several depths.

PyTorch's private ``torch.distributed._tools`` needs three trackers to gather what ``profile_model`` gathers in
one pass: ``MemTracker`` (per-module memory over a training step), ``RuntimeEstimator`` (per-module roofline
runtime, its own training step) and ``SACEstimator`` (per-module SAC op statistics, its own forward and
backward), plus the warm-up step that materializes the optimizer state. See ``_torch_reference.py`` for how
they are driven and for the exact (input-only) patches that let them run on a CPU-only machine.

Both sides run on fake tensors on the CPU device and use the same ``DeviceSpec`` numbers. Each side is warmed up
once (that untimed run also counts its forward/backward passes and optimizer steps through global hooks), then
timed with ``time.perf_counter``, best of ``--repeats``.

Run from the repository root::

    python benchmarks/profile_speed.py
    python benchmarks/profile_speed.py --depths 4 8 --repeats 1
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
from _torch_reference import count_passes, run_torch_pipeline  # noqa: E402

from lightning_sac.demos import GPT, GPTConfig  # noqa: E402

GOAL_RATIO_AT_4 = 0.3


class _LiteralSpec:
    """H100-SXM datasheet numbers, used only while ``lightning_sac.devices.spec`` is unavailable."""

    name = "H100-SXM (literal fallback)"
    dram_gbps = 3350.0
    _tflops = {torch.float32: 67.0, torch.float64: 67.0, torch.bfloat16: 989.4, torch.float16: 989.4}

    def peak_tflops(self, dtype: torch.dtype) -> float:
        return self._tflops.get(dtype, 67.0)


def _get_spec(device: str) -> Any:
    try:
        from lightning_sac.devices import get_device_spec
    except ImportError as err:
        print(f"[warn] lightning_sac.devices.spec unavailable ({err}); using literal H100-SXM numbers.")
        return _LiteralSpec()
    return get_device_spec(device)


def _get_profile_model() -> Callable[..., Any] | None:
    try:
        import lightning_sac

        return lightning_sac.profile_model
    except (ImportError, AttributeError) as err:
        print(f"[warn] lightning_sac.profile_model unavailable ({type(err).__name__}: {err}).")
        return None


def _best_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        gc.collect()
        t = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t)
    return best, result


def _fmt_passes(c: dict[str, int] | None) -> str:
    if c is None:
        return "-"
    return f"{min(c['forward'], c['backward'])} ({c['forward']}f/{c['backward']}b/{c['optimizer_step']}o)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 32], help="GPT blocks per model.")
    parser.add_argument("--device", default="H100-SXM", help="DeviceSpec name for both estimators.")
    parser.add_argument("--repeats", type=int, default=3, help="Timed runs per side; the best is reported.")
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument(
        "--torch-tradeoff-curves",
        action="store_true",
        help="Also fit SACEstimator's pwlf trade-off curves (profile_model does not fit curves; off by default).",
    )
    parser.add_argument("--torch-only", action="store_true", help="Time only torch's pipeline.")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    spec = _get_spec(args.device)
    profile_model = None if args.torch_only else _get_profile_model()
    loss_fn = lambda out: out.sum()  # noqa: E731
    optimizer_factory = lambda ps: torch.optim.AdamW(ps, foreach=True)  # noqa: E731

    print(
        f"GPT n_embd={args.n_embd} n_head={args.n_head} T={args.seq_len} B={args.batch} vocab={args.vocab}; "
        f"device spec {getattr(spec, 'name', args.device)}; fake tensors on CPU; best of {args.repeats}; "
        f"torch {torch.__version__}"
    )
    rows = []
    for depth in args.depths:
        cfg = GPTConfig(
            vocab_size=args.vocab,
            block_size=args.seq_len,
            n_layer=depth,
            n_head=args.n_head,
            n_embd=args.n_embd,
            dropout=0.1,
        )
        idx = torch.randint(0, args.vocab, (args.batch, args.seq_len))

        def torch_side(cfg: GPTConfig = cfg, idx: torch.Tensor = idx) -> dict[str, Any]:
            return run_torch_pipeline(
                lambda: GPT(cfg),
                (idx,),
                optimizer_factory,
                spec,
                loss_fn=loss_fn,
                tradeoff_curves=args.torch_tradeoff_curves,
            )

        with count_passes(GPT) as torch_counts:  # untimed warm-up, also counts passes
            torch_side()
        torch_s, torch_res = _best_time(torch_side, args.repeats)
        row: dict[str, Any] = {
            "depth": depth,
            "torch_s": torch_s,
            "torch_passes": dict(torch_counts),
            "torch_stages": torch_res["stage_seconds"],
            "ours_s": None,
            "ours_passes": None,
            "ours_error": None,
        }

        if profile_model is not None:
            # A fresh meta-device model per call (built outside the timing): profile_model fakes it itself.
            def ours_side(cfg: GPTConfig = cfg, idx: torch.Tensor = idx) -> Any:
                with torch.device("meta"):
                    model = GPT(cfg)
                t = time.perf_counter()
                profile = profile_model(
                    model,
                    (idx,),
                    loss_fn=loss_fn,
                    optimizer_factory=optimizer_factory,
                    device=spec,
                )
                return time.perf_counter() - t, profile

            try:
                with count_passes(GPT) as ours_counts:  # untimed warm-up, also counts passes
                    ours_side()
                best = float("inf")
                for _ in range(args.repeats):
                    gc.collect()
                    best = min(best, ours_side()[0])
                row["ours_s"] = best
                row["ours_passes"] = dict(ours_counts)
            except Exception as err:  # keep the torch numbers if ours is mid-development
                traceback.print_exc()
                row["ours_error"] = f"{type(err).__name__}: {err}"
        rows.append(row)
        ours_txt = f"{row['ours_s']:.2f}s" if row["ours_s"] is not None else "n/a"
        print(f"  depth {depth:>3}: torch {torch_s:.2f}s, ours {ours_txt}", flush=True)

    # ---- table -------------------------------------------------------------------------------------------
    print()
    print("Passes = forward+backward traversals of the model (f=forwards, b=backwards, o=optimizer steps).")
    header = (
        f"{'depth':>5} | {'torch s':>8} | {'ours s':>8} | {'ours/torch':>10} | "
        f"{'torch passes':>16} | {'ours passes':>16}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        ours_s = f"{r['ours_s']:.3f}" if r["ours_s"] is not None else "n/a"
        ratio = f"{r['ours_s'] / r['torch_s']:.3f}" if r["ours_s"] is not None else "n/a"
        print(
            f"{r['depth']:>5} | {r['torch_s']:>8.3f} | {ours_s:>8} | {ratio:>10} | "
            f"{_fmt_passes(r['torch_passes']):>16} | {_fmt_passes(r['ours_passes']):>16}"
        )
    print()
    print("torch pipeline stages of the best run (s):")
    for r in rows:
        print(f"  depth {r['depth']:>3}: " + ", ".join(f"{k} {v:.3f}" for k, v in r["torch_stages"].items()))
    for r in rows:
        if r["ours_error"]:
            print(f"  ours failed at depth {r['depth']}: {r['ours_error']}")

    # ---- goal ----------------------------------------------------------------------------------------------
    timed = sorted((r for r in rows if r["ours_s"] is not None), key=lambda r: r["depth"])
    goal = (
        f"Goal: ours <= {GOAL_RATIO_AT_4} x torch's time at depth 4, and the gap widening with depth "
        f"(ours/torch non-increasing as depth grows)"
    )
    if not timed or len(timed) != len(rows):
        print(f"{goal}: NOT EVALUATED (profile_model missing or failed).")
        return 0
    ratios = [r["ours_s"] / r["torch_s"] for r in timed]
    at4 = next((x for r, x in zip(timed, ratios, strict=True) if r["depth"] == 4), None)
    first_ok = at4 is not None and at4 <= GOAL_RATIO_AT_4
    widening = all(b <= a for a, b in zip(ratios, ratios[1:], strict=False))
    verdict = "HOLDS" if first_ok and widening else "DOES NOT HOLD"
    detail = (
        f"depth-4 ratio {'n/a (depth 4 not run)' if at4 is None else f'{at4:.3f}'}, "
        f"ratios by depth {[round(x, 3) for x in ratios]}"
    )
    print(f"{goal}: {verdict} ({detail}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
