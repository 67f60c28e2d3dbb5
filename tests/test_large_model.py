"""A meta-device model of over 2B parameters profiles on a laptop-sized budget of host memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, resource, torch
    from lightning_sac import profile_model
    from lightning_sac.demos import GPT, GPTConfig

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=20, n_embd=2560, dropout=0.1)
    with torch.device("meta"):
        model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    idx = torch.randint(0, cfg.vocab_size, (4, 1024))
    prof = profile_model(model, (idx,), optimizer_factory=lambda ps: torch.optim.AdamW(ps), device="H100-SXM")
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"n_params": n_params, "rss_gib": peak_rss / 2**20, "import_rss_gib": base / 2**20,
                      "parameter_bytes": prof.modules[""].parameter_bytes, "peak_bytes": prof.peak_bytes,
                      "state": prof.peak_breakdown["optimizer_state"]}))
    """
)


@pytest.mark.slow  # a fresh interpreter, to read the process's own peak RSS: the matrix tier
def test_two_billion_parameter_meta_model_profiles_within_a_few_gib_of_rss():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=600)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["n_params"] > 2_000_000_000
    assert r["parameter_bytes"] == 4 * r["n_params"]  # every tensor is a multiple of 512 bytes here
    assert r["state"] >= 2 * r["parameter_bytes"]  # AdamW moments, plus 512-byte step tensors
    assert r["peak_bytes"] > 4 * r["parameter_bytes"]  # params + grads + 2 moments, then activations
    assert r["rss_gib"] < 3.0, r  # versus 8 GiB for the fp32 weights alone, 32 GiB for the training state
