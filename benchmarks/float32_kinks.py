"""Benchmark: how far float32 routes lie apart where ReLU inputs fall within round-off of zero.

On the speed benchmark's eval DCGAN (``tangent_speed.py``: 4 extra conv blocks per scale, 32
channels, batch 32), for random draws of z, y and v, ``mixed_grad`` of the benchmark's cubic f by
each float32 route, compared (relative 2-norm difference) with the float32 per-op pass and with the
per-op pass on a float64 copy of G:

- ``per-op pass``: inside ``mixedad.programs.per_op_pass()`` (G's primal as a plain forward computes it, so
  every ReLU kink on double backward's side);
- ``default``: ``mixed_grad`` from its third call, G's tangent program (written and checked on the
  first draw; G's own calls for the primal, the batch norms' scale folded into the tangent's
  convolutions);
- ``compile=True``: the compiled program (compiled and checked on the first draw).

Counts of draws more than 1e-3 apart, the largest and the median difference. The docs'
"float32 and ReLU kinks" section includes the table this writes
(benchmarks/results/float32_kinks_cpu.{json,md}).

    python benchmarks/float32_kinks.py [--out DIR] [--repeats DRAWS] [--quick]
"""
import copy
import statistics
import sys

import torch
from tqdm.auto import tqdm

import mixedad
from mixedad.benchmark import build, objective, script_arguments, write_table

ROUTES = ("per-op pass", "default", "compile=True")


def _relative(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def differences(G, shape, draws, seed=7):
    """route -> {"per-op": [difference per draw], "float64": [...]}: each float32 route's mixed_grad against the
    float32 per-op pass's and the float64 per-op pass's, over ``draws`` draws of (z, y, v)."""
    G64 = copy.deepcopy(G).double()
    gen = torch.Generator().manual_seed(seed)
    z_shape, y_shape = shape
    rows = {route: {"per-op": [], "float64": []} for route in ROUTES}
    for i in tqdm(range(draws + 1), desc="float32 kinks", unit="draw", file=sys.stderr):
        z, v = torch.randn(z_shape, generator=gen), torch.randn(z_shape, generator=gen)
        y = torch.randn(y_shape, generator=gen)
        with mixedad.programs.per_op_pass():
            per_op = mixedad.mixed_grad(objective, G, z, y, v)
            exact = mixedad.mixed_grad(objective, G64, z.double(), y.double(), v.double())
        default = mixedad.mixed_grad(objective, G, z, y, v)
        compiled = mixedad.mixed_grad(objective, G, z, y, v, compile=True)
        if i == 0:  # the first draw writes and checks the programs (the default's on its second call)
            default = mixedad.mixed_grad(objective, G, z, y, v)
            continue
        for route, value in zip(ROUTES, (per_op, default, compiled)):
            rows[route]["per-op"].append(_relative(value, per_op))
            rows[route]["float64"].append(_relative(value, exact))
    return rows


def _cells(row):
    """A route's cells: draws more than 1e-3 from the per-op pass and from float64, the largest and the median."""
    far = lambda key: sum(d > 1e-3 for d in row[key])  # noqa: E731
    return [far("per-op"), far("float64"), f"{max(row['float64']):.1e}", f"{statistics.median(row['float64']):.1e}"]


def markdown(rows, meta):
    header = ["float32 route", "draws more than 1e-3 from the per-op pass", "draws more than 1e-3 from float64",
              "largest from float64", "median from float64"]
    table = [header, ["---"] * len(header), *([route, *_cells(row)] for route, row in rows.items())]
    return (f"mixed_grad of the benchmark's eval DCGAN in float32, against the float32 per-op pass and float64; "
            f"{meta}.\n\n" + "\n".join("| " + " | ".join(map(str, cells)) + " |" for cells in table))


def main(argv=None):
    parser = script_arguments(__file__, __doc__, repeats=30, quick="a tiny model and 3 draws: a smoke test")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    G, z, y, v = build("dcgan", *((0, 4, 2) if args.quick else (4, 32, 32)), torch.float32, "cpu")
    G.eval().requires_grad_(False)
    draws = 3 if args.quick else args.repeats
    rows = differences(G, (z.shape, y.shape), draws)
    meta = f"{draws} draws of z, y and v, torch {torch.__version__}, CPU"
    write_table(args.out, "float32_kinks_cpu", meta, rows, markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
