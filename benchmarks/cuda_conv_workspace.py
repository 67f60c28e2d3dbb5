"""What cuDNN's convolutions allocate beyond their outputs on this GPU: forward and backward scratch, per signature.

A fake-tensor dry run sees a convolution's outputs but not the workspace cuDNN takes from the caching allocator
for the algorithm torch picks (``cudnn.benchmark`` off: cuDNN's heuristics; on: the fastest measured one). This
script runs each convolution twice on real tensors and reports, for the second run, the allocator's peak during
the call less what was allocated before and the call's outputs: the scratch a profile must add. Signatures: every
convolution of the tests' ResNet (``tests/zoo.py``, 512 images of 32 x 32, as ``tests/gpu`` runs it) and common
vision shapes (a 3-channel stem, 3x3 and 1x1 bottleneck convolutions, a depthwise 7x7), in fp32 and bf16,
contiguous and channels-last, with ``cudnn.benchmark`` off and on.

    python benchmarks/cuda_conv_workspace.py [--out figures.jsonl]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

MIB = 2**20


@dataclass(frozen=True)
class Conv:
    name: str
    batch: int
    c_in: int
    c_out: int
    size: int
    kernel: int
    stride: int = 1
    groups: int = 1


SIGNATURES = (
    # tests/zoo.py ResNet(width=16) on 512 x 3 x 32 x 32
    Conv("resnet.conv1", 512, 3, 16, 32, 3),
    Conv("resnet.layer1 3x3", 512, 16, 16, 32, 3),
    Conv("resnet.layer2 3x3 s2", 512, 16, 32, 32, 3, 2),
    Conv("resnet.layer2 1x1 s2", 512, 16, 32, 32, 1, 2),
    Conv("resnet.layer2 3x3", 512, 32, 32, 16, 3),
    # common vision shapes
    Conv("stem 7x7 s2", 64, 3, 64, 224, 7, 2),
    Conv("3x3 64->64", 64, 64, 64, 56, 3),
    Conv("1x1 64->256", 64, 64, 256, 56, 1),
    Conv("1x1 256->64", 64, 256, 64, 56, 1),
    Conv("depthwise 7x7", 64, 96, 96, 56, 7, 1, 96),
)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)


def measure(conv: Conv, dtype: torch.dtype, channels_last: bool) -> dict[str, float]:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(conv.batch, conv.c_in, conv.size, conv.size, device="cuda", dtype=dtype).to(memory_format=fmt)
    w = torch.randn(conv.c_out, conv.c_in // conv.groups, conv.kernel, conv.kernel, device="cuda", dtype=dtype)
    w = w.to(memory_format=fmt)
    pad = conv.kernel // 2
    out: dict[str, float] = {}
    for _ in range(2):  # the second run: algorithm chosen, cuDNN's plans cached
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = F.conv2d(x, w, None, conv.stride, pad, 1, conv.groups)
        torch.cuda.synchronize()
        out["forward_MiB"] = (torch.cuda.max_memory_allocated() - before - _nbytes(y)) / MIB
        grad = torch.ones_like(y)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        gi, gw, _ = torch.ops.aten.convolution_backward(
            grad, x, w, None, [conv.stride] * 2, [pad] * 2, [1, 1], False, [0, 0], conv.groups, [True, True, False]
        )
        torch.cuda.synchronize()
        out["backward_MiB"] = (torch.cuda.max_memory_allocated() - before - _nbytes(gi, gw)) / MIB
        out["input_MiB"] = _nbytes(x) / MIB
        del y, grad, gi, gw
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write one JSON line per measurement to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device: torch.cuda.is_available() is False")
    device = torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print("| signature | dtype | layout | benchmark | input MiB | forward scratch MiB | backward scratch MiB |")
    print("|---|---|---|---|---|---|---|")
    lines = []
    for benchmark in (False, True):
        torch.backends.cudnn.benchmark = benchmark
        for conv in SIGNATURES:
            for dtype in (torch.float32, torch.bfloat16):
                for channels_last in (False, True):
                    got = measure(conv, dtype, channels_last)
                    layout = "channels_last" if channels_last else "contiguous"
                    print(
                        f"| {conv.name} | {str(dtype)[6:]} | {layout} | {benchmark} | {got['input_MiB']:.1f} | "
                        f"{got['forward_MiB']:.1f} | {got['backward_MiB']:.1f} |"
                    )
                    lines.append(
                        {
                            **asdict(conv),
                            "dtype": str(dtype)[6:],
                            "layout": layout,
                            "benchmark": benchmark,
                            **got,
                            "device": device,
                            "torch": torch.__version__,
                            "cudnn": torch.backends.cudnn.version(),
                        }
                    )
                    torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()
