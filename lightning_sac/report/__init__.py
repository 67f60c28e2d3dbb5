"""Reports of a plan: its figures (matplotlib), TensorBoard panels, and the profile's table.

Takes a profile, a plan and measured steps; gives what a user reads: trade-off curves, memory predicted beside
measured, the plan's table, per-module profile rows.
"""

from __future__ import annotations

from lightning_sac.report.profile_table import render_profile
from lightning_sac.report.tensorboard import PEAKS, TAG, PeakSeries, log_measured, log_peaks, log_plan, plan_markdown

__all__ = [
    "PEAKS",
    "TAG",
    "PeakSeries",
    "log_measured",
    "log_peaks",
    "log_plan",
    "plan_markdown",
    "render_profile",
]
