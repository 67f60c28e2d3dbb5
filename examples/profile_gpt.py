"""Profile a small GPT's training step for a target device, and check the CPU prediction against a real step.

python examples/profile_gpt.py                      # plan for this CPU, then measure a real CPU step
python examples/profile_gpt.py --device H100-SXM    # plan for an H100 from this machine
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F

from lightning_sac import profile_model, render_profile
from lightning_sac.demos import GPT, GPTConfig
from lightning_sac.dryrun.measured import measure_training_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="target device name (see lightning_sac.known_devices())")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=4096, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=256)
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    targets = torch.randint(0, config.vocab_size, (args.batch, args.seq))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def optimizer(params):  # noqa: ANN001, ANN202
        return torch.optim.AdamW(params, lr=3e-4)

    start = time.perf_counter()
    profile = profile_model(model, (idx,), loss_fn=loss_fn, optimizer_factory=optimizer, device=args.device)
    print(f"profiled in {time.perf_counter() - start:.2f} s (fake tensors, no real memory)\n")
    print(render_profile(profile))

    if not profile.device.is_cuda:
        measured = measure_training_step(copy.deepcopy(model), (idx,), loss_fn=loss_fn, optimizer_factory=optimizer)
        error = (profile.peak_bytes - measured.peak_bytes) / measured.peak_bytes
        print(
            f"\npredicted peak {profile.peak_bytes / 2**20:.2f} MiB, measured {measured.peak_bytes / 2**20:.2f} MiB "
            f"(torch.profiler allocator events of a real CPU step): {error:+.1%}"
        )


if __name__ == "__main__":
    main()
