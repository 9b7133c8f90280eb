"""CUDA profiling: mixed_grad against the alternatives on a GPU, with JSON, PNG and traces.

    python scripts/profile_cuda.py [--out benchmarks/results/cuda-<GPU name>] [--repeats N]

Runs ``python -m mixedad profile --device cuda --trace`` for the MLP and the DCGAN-style
generator, timing with CUDA events and reading the caching allocator's peak. Where no CUDA device
exists it says so and exits with status 0, so it can sit in any pipeline.
"""
import argparse
import pathlib
import re
import sys

import torch

from mixedad.cli import main as mixedad_main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("scripts/profile_cuda.py: no CUDA device is available here; nothing to profile.")
        return 0
    gpu = torch.cuda.get_device_name(0)
    out = args.out or ROOT / "benchmarks" / "results" / ("cuda-" + re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-"))
    common = ["--device", "cuda", "--dtype", args.dtype, "--repeats", str(args.repeats), "--out", str(out), "--trace"]
    print(f"profiling on {gpu}, writing to {out}")
    mixedad_main(["profile", "--model", "mlp", "--depths", "4", "8", "16", "32", "64", "--batch", "1024", *common])
    mixedad_main(["profile", "--model", "dcgan", "--depths", "0", "1", "2", "4", "8", "--width", "64", "--batch", "128", *common])
    return 0


if __name__ == "__main__":
    sys.exit(main())
