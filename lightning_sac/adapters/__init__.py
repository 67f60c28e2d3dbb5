"""How lightning-sac sees the user's model and this torch: through ``torch.compile``'s wrappers, with KV caches off.

Takes a user's module (compiled or not) and the installed torch; gives the module as written, the switch that runs
it without KV caches, and what torch's checkpoint API offers. Every later stage reads the model through these.
"""

from __future__ import annotations

from lightning_sac.adapters.caches import CacheCall, CacheSwitch, is_kv_cache, layer_indices, without_kv_caches
from lightning_sac.adapters.checkpoint import sac_sees_outputs
from lightning_sac.adapters.compiled import (
    compile_backends,
    compiled_parts,
    profiles_uncompiled,
    traced_module,
    uncompiled,
)
from lightning_sac.adapters.host_random import HostGenerators, host_generator_states, host_generators

__all__ = [
    "CacheCall",
    "CacheSwitch",
    "HostGenerators",
    "compile_backends",
    "compiled_parts",
    "host_generator_states",
    "host_generators",
    "is_kv_cache",
    "layer_indices",
    "profiles_uncompiled",
    "sac_sees_outputs",
    "traced_module",
    "uncompiled",
    "without_kv_caches",
]
