"""Reports of a plan: matplotlib figures and TensorBoard panels."""

from lightning_sac.report.tensorboard import TAG, log_measured, log_plan, plan_markdown

__all__ = ["TAG", "log_measured", "log_plan", "plan_markdown"]
