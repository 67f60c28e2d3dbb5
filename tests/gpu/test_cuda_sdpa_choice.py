"""The SDPA kernel the emulation picks for this GPU by name is the one CUDA picks on it.

A machine without a GPU profiles a CUDA target's attention through :func:`lightning_sac.dryrun.cuda.sdpa.
choose_backend`, from the device table's compute capability and torch's switches. Here the same calls go to
torch's own selection on the GPU (``torch._fused_sdp_choice``, what ``scaled_dot_product_attention`` asks), over
dtypes, head dims, masks, causality, dropout, grouped-query heads and the deterministic-algorithms mode. A
different answer is a plan whose op sequence the GPU does not run (the plan falls back) and whose memory is another
kernel's.
"""

from __future__ import annotations

import itertools

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_sac.dryrun.cuda.sdpa import choose_backend

from .harness import deterministic
from .models import named_spec

NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_DIMS = (64, 60, 128, 192, 256, 512)
MASKS = ("none", "bool", "float")


def _tensors(device: str, dtype: torch.dtype, d: int, mask: str, gqa: bool) -> tuple[torch.Tensor, ...]:
    b, h, s = 2, 8, 128
    kv = 2 if gqa else h
    q = torch.zeros(b, h, s, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.zeros(b, kv, s, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.zeros(b, kv, s, d, dtype=dtype, device=device, requires_grad=True)
    if mask == "none":
        return q, k, v, None
    m = torch.ones(b, 1, s, s, dtype=torch.bool, device=device)
    return q, k, v, (m if mask == "bool" else torch.zeros(b, 1, s, s, dtype=dtype, device=device))


def _choices(spec: object) -> tuple[int, list[str]]:
    wrong, n = [], 0
    for dtype, d, mask, causal, p, gqa in itertools.product(
        DTYPES, HEAD_DIMS, MASKS, (False, True), (0.0, 0.1), (False, True)
    ):
        if causal and mask != "none":
            continue  # SDPA refuses a mask with is_causal
        q, k, v, m = _tensors("cuda", dtype, d, mask, gqa)
        try:
            real = torch._fused_sdp_choice(q, k, v, m, p, causal, enable_gqa=gqa)
        except RuntimeError:
            real = -1  # "No available kernel", as choose_backend raises
        with FakeTensorMode():
            fq, fk, fv, fm = _tensors("cpu", dtype, d, mask, gqa)
            try:
                ours = choose_backend(spec, fq, fk, fv, fm, p, causal, gqa)
            except RuntimeError:
                ours = -1
        n += 1
        if ours != real:
            case = f"{str(dtype)[6:]} d={d} mask={mask} causal={causal} p={p} gqa={gqa}"
            wrong.append(f"{case}: GPU {NAMES.get(real, real)}, emulated {NAMES.get(ours, ours)}")
    return n, wrong


def test_the_emulated_sdpa_choice_is_the_gpu_s(figure):
    spec = named_spec()
    n, wrong = _choices(spec)
    with deterministic():
        n_det, wrong_det = _choices(spec)
    figure("calls_compared", n + n_det)
    figure("differing", len(wrong) + len(wrong_det))
    figure("differing_calls", "; ".join(wrong + [f"deterministic {w}" for w in wrong_det])[:4000])
    assert not wrong and not wrong_det, (wrong + [f"deterministic: {w}" for w in wrong_det])[:40]
