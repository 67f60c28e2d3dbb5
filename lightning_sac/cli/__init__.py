"""The ``lightning-sac`` command: profile, plan and check a model from the shell, without a training script.

Takes a model spec (a demo, a Hugging Face config, ``module:factory``), a device and a budget; gives the profile, the
plan as a table or JSON, and checks of a saved plan. ``python -m lightning_sac`` runs it too.
"""

from __future__ import annotations

from lightning_sac.cli.main import main

__all__ = [
    "main",
]
