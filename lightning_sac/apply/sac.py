"""The SAC backend: each planned module's forward under ``torch.utils.checkpoint`` with a selective policy.

The module's ``forward`` is replaced by an instance attribute that calls the class's forward inside a
non-reentrant checkpoint; deleting the attribute restores the module exactly. Nothing is re-registered, so
parameters, module names and ``state_dict`` keys never change and checkpoints load with or without a plan.
Under ``torch.compile`` the wrapper takes :meth:`PlannedForward.run_traced` instead (:mod:`lightning_sac.apply.traced`).
"""

from __future__ import annotations

from typing import Any

from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from lightning_sac.apply.planned import CallState, PlannedForward

__all__ = ["SelectiveCheckpointForward"]


class SelectiveCheckpointForward(PlannedForward):
    """A module's forward run under a non-reentrant checkpoint that saves exactly the ops the plan saves.

    Each call gets fresh ``create_selective_checkpoint_contexts`` whose policy is :meth:`PlannedForward.decide`.
    """

    def run(self, state: CallState, *args: Any, **kwargs: Any) -> Any:
        """Run the forward under ``torch.utils.checkpoint`` with the selective policy."""

        def contexts() -> tuple[Any, Any]:
            # A fresh call state for the forward; recompute reads SAC's cache and does not ask the policy.
            # An in-place op shares its parent's decision, so a saved parent's cache entry is mutated by its
            # saved in-place ops (dropout's bernoulli_ on empty_like's output); on recompute both return the
            # cached, final value and nothing is applied twice.
            return create_selective_checkpoint_contexts(
                lambda ctx, func, *a, **k: self.decide(state, func, a, k, ctx.op_output),
                allow_cache_entry_mutation=True,
            )

        return checkpoint(self.inner, *args, use_reentrant=False, context_fn=contexts, **kwargs)
