"""CUDA profiling: mixed_grad against the alternatives on a GPU, with JSON, PNG and traces.

    python scripts/profile_cuda.py [--out benchmarks/results/cuda-<GPU name>] [--repeats N]

Runs ``python -m mixedad profile --device cuda --trace`` for the MLP and the DCGAN-style
generator, timing with CUDA events and reading the caching allocator's peak. Then it checks the
memory planner: for a few generators it compares ``mixedad.profiling.plan`` (a run on meta tensors)
with ``torch.cuda.max_memory_allocated`` for each method and prints the ratio. Where no CUDA
device exists it says so and exits with status 0, so it can sit in any pipeline.
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
    compare_plans()
    return 0


def compare_plans():
    """The plan on meta against the CUDA allocator's peak, method by method: the ratio measured / planned."""
    import mixedad
    from mixedad.profiling import PLAN_METHODS, cuda_peak_memory, plan

    f = lambda y, g: ((g - y) ** 2).sum()  # noqa: E731
    cases = {
        "mlp depth 32, width 1024, batch 512": (mixedad.zoo.mlp(32, 1024), (512, 1024)),
        "dcgan 128 channels, 128^2, batch 32": (mixedad.zoo.dcgan(latent_dim=128, channels=128, image_size=128),
                                                (32, 128)),
        "attention 8 layers, 1024 wide, 4096 tokens": (mixedad.zoo.attention_stack(1024, nhead=16, layers=8),
                                                       (1, 4096, 1024)),
    }
    print("\nplan on meta against torch.cuda.max_memory_allocated:")
    for name, (G, shape) in cases.items():
        G = G.cuda()
        z = torch.randn(shape, device="cuda")
        with torch.no_grad():
            y = torch.randn_like(G(z))
        planned = plan(f, G, z, y, device="cuda")
        for method, peak in planned.peaks.items():
            _, measured = cuda_peak_memory(PLAN_METHODS[method], f, G, (z,), y)
            print(f"  {name:45s} {method:16s} planned {peak / 2**20:9.1f} MiB  measured {measured / 2**20:9.1f} MiB"
                  f"  ratio {measured / peak:.3f}")


if __name__ == "__main__":
    sys.exit(main())
