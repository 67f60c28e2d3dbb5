"""What this torch's ``torch.utils.checkpoint`` offers a selective policy."""

from __future__ import annotations

import inspect

from torch.utils.checkpoint import SelectiveCheckpointContext

__all__ = ["sac_sees_outputs"]


def sac_sees_outputs() -> bool:
    """Whether this torch passes each op's output to a selective-checkpoint policy (``ctx.op_output``).

    torch 2.12 added it; before, the policy is asked before the op runs. Without it the backend still applies any
    plan but one that keeps dropout noise as masks, which must see the noise it keeps.
    """
    return "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters
