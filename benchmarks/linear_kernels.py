"""Benchmark: why mixedad's float32 Linear tangent runs on oneDNN on the CPU.

Times one frozen Linear layer's matrix product, y = x W^T, at the MLP benchmark's shape (batch
256, width 512, float32) with the two CPU kernels PyTorch has:

- ``F.linear``: eager PyTorch, which calls the BLAS (MKL on x86 builds);
- ``oneDNN``: ``torch.ops.mkldnn._linear_pointwise``, the kernel mixedad's frozen-layer rule
  uses for the tangent (PyTorch's own CPU compiler uses it too).

The two are timed round-robin in one process, so the ratio holds on a shared machine, and their
results are compared. Writes ``linear_kernels_cpu.{json,md}``.

    python benchmarks/linear_kernels.py [--batch B] [--width W] [--repeats N] [--out DIR]
"""
import argparse
import json
import pathlib
import platform
import sys

import torch
import torch.nn.functional as F

from mixedad.benchmark import frozen_linear_tangent_kernel as _onednn_linear_op
from mixedad.benchmark import interleaved_times
from mixedad.testing import max_relative_error

HERE = pathlib.Path(__file__).resolve().parent


def cpu_name():
    """The CPU model as the OS reports it (Linux: /proc/cpuinfo), else what platform knows."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    args = parser.parse_args(argv)
    op = _onednn_linear_op()
    if op is None:
        print("This PyTorch build has no usable oneDNN linear kernel; mixedad uses F.linear throughout.")
        return 0
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.width, generator=gen)
    w = torch.randn(args.width, args.width, generator=gen) / args.width ** 0.5
    fns = {"F.linear (BLAS)": lambda: F.linear(x, w), "oneDNN": lambda: op(x, w, None, "none", [], "")}
    with torch.no_grad():
        seconds = interleaved_times(fns, "cpu", args.repeats)
        error = max_relative_error(fns["oneDNN"](), fns["F.linear (BLAS)"]())
    title = (f"one {args.batch}x{args.width}x{args.width} float32 matrix product, {platform.machine()} CPU "
             f"({cpu_name()}), torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"median of {args.repeats}")
    lines = [title, "", "| kernel | time | time / F.linear | max rel difference |", "|---|---|---|---|"]
    base = seconds["F.linear (BLAS)"]
    for name, s in seconds.items():
        lines.append(f"| {name} | {s * 1e3:.3f} ms | {s / base:.2f} | {0.0 if name.startswith('F.') else error:.1e} |")
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "linear_kernels_cpu.md").write_text(table + "\n")
    (args.out / "linear_kernels_cpu.json").write_text(json.dumps(
        {"title": title, "seconds": seconds, "max_rel_difference": error}, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
