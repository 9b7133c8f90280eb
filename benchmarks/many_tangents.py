"""Benchmark: many tangents at once, torch.func.vmap over mixed_grad against separate calls.

For each generator, side by side in one process (peaks exact, times the median of round-robin
repeats, float32, CPU):

- ``plain_forward``: G(z) under no_grad;
- ``mixed_grad``: one call, one tangent;
- ``separate_k``: k calls of mixed_grad, one per tangent;
- ``vmap_k``: ``torch.func.vmap(lambda v: mixed_grad(f, G, z, y, v))`` over the k tangents, which
  mixedad pushes through G as one batch on the per-op rules.

Generators: the MLP and the DCGAN of the depth benchmark, and two causal attention layers
(``zoo.attention_stack``) at T = 512. Target: ``vmap_k`` at most 0.8 times ``separate_k``, with
k = 8. Also reported: what each extra tangent costs in a batch, in plain forward passes,
``(vmap_k - mixed_grad) / (k - 1) / plain_forward`` (JAX's linearize: about 1), and the largest
relative difference between ``vmap_k`` and ``separate_k``. Writes
benchmarks/results/many_tangents_cpu.{json,md}.

    python benchmarks/many_tangents.py [--out DIR] [--repeats N] [--tangents K] [--quick]
"""
import json
import platform
import sys

import torch
from tqdm.auto import tqdm

import mixedad
from mixedad.benchmark import build, interleaved_times, objective, peak, script_arguments
from mixedad.testing import max_relative_error

TARGET = 0.8


def problems(quick):
    """(name, G, z, y) per generator."""
    sizes = {"mlp": (16, 256, 64), "dcgan": (2, 32, 8)} if not quick else {"mlp": (2, 8, 4), "dcgan": (0, 4, 2)}
    for name, (depth, width, batch) in sizes.items():
        G, z, y, _ = build(name, depth, width, batch, torch.float32, "cpu")
        yield name, G, z, y
    length, d_model = (512, 64) if not quick else (16, 8)
    G = mixedad.zoo.attention_stack(d_model, nhead=4 if not quick else 2, layers=2)
    gen = torch.Generator().manual_seed(0)
    yield "attention", G, torch.randn(1, length, d_model, generator=gen), torch.randn(1, length, d_model, generator=gen)


def point(name, G, z, y, k, repeats):
    vs = torch.randn(k, *z.shape, generator=torch.Generator().manual_seed(1))
    fns = {
        "plain_forward": lambda: G(z).detach(),
        "mixed_grad": lambda: mixedad.mixed_grad(objective, G, z, y, vs[0]),
        f"separate_{k}": lambda: torch.stack([mixedad.mixed_grad(objective, G, z, y, v) for v in vs]),
        f"vmap_{k}": lambda: torch.func.vmap(lambda v: mixedad.mixed_grad(objective, G, z, y, v))(vs),
    }
    results, peaks = {}, {}
    for key, fn in fns.items():
        results[key], peaks[key] = peak(fn, "cpu")
    seconds = interleaved_times(fns, "cpu", repeats)
    batched, separate = seconds[f"vmap_{k}"], seconds[f"separate_{k}"]
    return {
        "generator": name, "tangents": k, "seconds": seconds, "peak_bytes": peaks,
        "vmap_vs_separate": batched / separate,
        "extra_tangent_in_plain_forwards": (batched - seconds["mixed_grad"]) / (k - 1) / seconds["plain_forward"],
        "max_rel_diff": max_relative_error(results[f"vmap_{k}"], results[f"separate_{k}"]),
    }


def markdown(rows, k):
    lines = [
        f"{k} tangents, float32, CPU (torch {torch.__version__}, {platform.machine()}); medians of round-robin "
        f"repeats, one process.",
        "",
        f"| generator | plain forward | mixed_grad | {k} separate calls | vmap over {k} | vmap / separate "
        f"(target <= {TARGET}) | each extra tangent, in plain forwards | peak: vmap / separate | vmap vs separate, "
        f"max rel diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, p = r["seconds"], r["peak_bytes"]
        lines.append(
            f"| {r['generator']} | {s['plain_forward'] * 1e3:.2f} ms | {s['mixed_grad'] * 1e3:.2f} ms | "
            f"{s[f'separate_{k}'] * 1e3:.2f} ms | {s[f'vmap_{k}'] * 1e3:.2f} ms | {r['vmap_vs_separate']:.2f} | "
            f"{r['extra_tangent_in_plain_forwards']:.2f} | {p[f'vmap_{k}'] / p[f'separate_{k}']:.2f} | "
            f"{r['max_rel_diff']:.1e} |")
    return "\n".join(lines)


def main(argv=None):
    parser = script_arguments(__file__, __doc__, repeats=15, quick="tiny models: a smoke test of the pipeline")
    parser.add_argument("--tangents", type=int, default=8)
    args = parser.parse_args(argv)
    if args.tangents < 2:
        parser.error(f"--tangents must be at least 2, got {args.tangents}")
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    cases = list(problems(args.quick))
    rows = [point(*case, args.tangents, args.repeats)
            for case in tqdm(cases, desc="generators", unit="G", file=sys.stderr)]
    table = markdown(rows, args.tangents)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) for k, v in vars(args).items()}
    (args.out / "many_tangents_cpu.json").write_text(json.dumps({"config": config, "rows": rows}, indent=2))
    (args.out / "many_tangents_cpu.md").write_text(table + "\n")
    missed = [r["generator"] for r in rows if r["vmap_vs_separate"] > TARGET]
    if missed and not args.quick:
        print(f"target missed (vmap / separate > {TARGET}): {missed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
