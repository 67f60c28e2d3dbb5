"""Render a :class:`ModelProfile` as a plain-text table, separate from gathering it (as accelerate does)."""

from __future__ import annotations

from lightning_sac.dryrun import ModelProfile

__all__ = ["render_profile"]

_MIB = 2**20


def render_profile(profile: ModelProfile, *, max_depth: int = 2) -> str:
    """Return a table of the modules down to ``max_depth`` levels, with the step's peak and its breakdown.

    Columns: parameters, activations left alive by forward, peak during forward and backward (all MiB),
    forward and backward time (ms).
    """
    header = (
        f"{'module':<32} {'type':<20} {'params':>9} {'activ.':>9} {'fwd peak':>9} {'bwd peak':>9} "
        f"{'fwd ms':>8} {'bwd ms':>8}"
    )
    lines = [f"target {profile.device.name}, runtime estimate {profile.estimate} (memory MiB, time ms)", header]
    lines.append("-" * len(header))
    for fqn, m in profile.modules.items():
        if (fqn.count(".") + 1 if fqn else 0) > max_depth or not m.calls:
            continue
        name = ("  " * fqn.count(".") + (fqn or "<root>"))[:32]
        fwd_peak = sum(m.memory["peak_forward"].values()) / _MIB
        bwd_peak = sum(m.memory["peak_backward"].values()) / _MIB
        lines.append(
            f"{name:<32} {m.module_type[:20]:<20} {m.parameter_bytes / _MIB:>9.2f} {m.activation_bytes / _MIB:>9.2f} "
            f"{fwd_peak:>9.2f} {bwd_peak:>9.2f} {m.forward_ms:>8.3f} {m.backward_ms:>8.3f}"
        )
    lines.append("-" * len(header))
    parts = ", ".join(f"{k} {v / _MIB:.2f}" for k, v in profile.peak_breakdown.items() if v)
    lines.append(f"peak {profile.peak_bytes / _MIB:.2f} MiB at {profile.peak_location} ({parts})")
    if profile.kv_cache_peak is not None:
        lines.append(
            f"(profiled without KV caches in training, as a plan runs the model; with the model's caches on, as it "
            f"runs without a plan, the peak is {profile.plain_peak_bytes / _MIB:.2f} MiB)"
        )
    lines.append(
        f"step {profile.step_ms:.3f} ms = forward {profile.forward_ms:.3f} + backward {profile.backward_ms:.3f}"
        f" + optimizer {profile.optimizer_ms:.3f}"
    )
    return "\n".join(lines)
