"""Benchmark: predicted GPU memory of real generators at real sizes, from plans on meta tensors.

For each generator (built on meta with random weights, nothing downloaded), ``mixedad.profiling.plan_model``
predicts the peak of a plain forward, of ``mixed_grad`` and of double backward (the naive create_graph
code) with CUDA's kernel choices emulated, and says on which cards (24, 40, 80 GiB) each fits. It
also times each plan (plans must take seconds). Writes benchmarks/results/plan_headline.{json,md}.

    python benchmarks/plan_headline.py [--out DIR] [--quick]
"""
import importlib.util
import json
import platform
import sys
import time

import torch
from tqdm.auto import tqdm

import mixedad
from mixedad.benchmark import script_arguments

#: (model, batch, resolution, dtype): the sizes people ask about.
CASES = [
    ("gpt2-medium", 1, 4096, torch.float16),
    ("gpt2-medium", 8, 1024, torch.float16),
    ("stylegan2", 16, 1024, torch.float32),
    ("stylegan2", 4, 1024, torch.float16),
    ("sd-vae", 2, 1024, torch.float16),
    ("sd-vae", 8, 1024, torch.float16),
    ("vq_decoder", 8, 512, torch.float16),
    ("dcgan", 64, 256, torch.float32),
]
QUICK = [("dcgan", 2, 64, torch.float32), ("stylegan2", 1, 64, torch.float16), ("gpt2-medium", 1, 128, torch.float16)]
NEEDS = {"gpt2-medium": "transformers", "sd-vae": "diffusers"}


def run(cases):
    rows = []
    for name, batch, resolution, dtype in tqdm(cases, desc="plans", unit="plan", file=sys.stderr):
        needs = NEEDS.get(name)
        if needs is not None and importlib.util.find_spec(needs) is None:
            rows.append({"model": name, "batch": batch, "resolution": resolution, "dtype": str(dtype),
                         "skipped": f"needs {needs}"})
            continue
        start = time.perf_counter()
        result, what = mixedad.profiling.plan_model(name, batch=batch, resolution=resolution, dtype=dtype)
        rows.append({"model": name, "what": what, "batch": batch, "resolution": resolution, "dtype": str(dtype),
                     "peak_bytes": result.peaks, "seconds": time.perf_counter() - start})
    return rows


def markdown(rows):
    def cell(nbytes):
        fits = [c for c in (24, 40, 80) if nbytes <= c * 2**30]
        return f"{nbytes / 2**30:.2f} GiB ({'fits ' + str(fits[0]) + ' GiB' if fits else 'over 80 GiB'})"

    lines = [f"Predicted peaks on CUDA (exact live bytes, plans on meta tensors; torch {torch.__version__}, "
             f"{platform.machine()}).", "",
             "| generator | batch | dtype | plain forward | mixed_grad | double backward | plan time |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['model']} at {row['resolution']} | {row['batch']} | {row['dtype'][6:]} | "
                         f"(not planned here: {row['skipped']}) | | | |")
            continue
        p = row["peak_bytes"]
        lines.append(f"| {row['what']} | {row['batch']} | {row['dtype'][6:]} | {cell(p['forward'])} | "
                     f"{cell(p['mixed_grad'])} | {cell(p['double_backward'])} | {row['seconds']:.1f} s |")
    return "\n".join(lines)


def main(argv=None):
    parser = script_arguments(__file__, __doc__, repeats=1, quick="small sizes, to check the pipeline")
    args = parser.parse_args(argv)
    rows = run(QUICK if args.quick else CASES)
    table = markdown(rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan_headline.json").write_text(json.dumps({"rows": rows}, indent=2))
    (args.out / "plan_headline.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
