"""Re-exports :mod:`lightning_sac.apply.recompute`, where the recompute model of both backends now lives."""

from lightning_sac.apply.recompute import (
    BACKENDS,
    check_backend,
    fixed_overhead_ms,
    output_op,
    overhead_ms,
    recompute_costs,
    recompute_ms,
    recompute_transient,
    recomputed_ops,
    rerun_output_bytes,
    skipped_ops,
)

__all__ = [
    "BACKENDS",
    "check_backend",
    "fixed_overhead_ms",
    "output_op",
    "overhead_ms",
    "recompute_costs",
    "recompute_ms",
    "recompute_transient",
    "recomputed_ops",
    "rerun_output_bytes",
    "skipped_ops",
]
