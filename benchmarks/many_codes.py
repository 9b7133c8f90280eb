"""Benchmark: g(input_grad(f, G, z, y), x).backward() over many latent codes.

The forum thread's pipeline (seeds/003): dfdz_i = ∂f(y, G(z_i))/∂z_i for N latent codes, an
outer objective t = g(dfdz_1..N, x) that couples them, and dt/dy. mixedad.input_grad with a
chunk size against the naive create_graph code, measured side by side in one run:

- peak memory: exact storage byte counts (mixedad.profiling), deterministic;
- time: median of repeats, on a shared machine, so read ratios only.

The naive code is run at N = 64, 128, ... while its peak stays within --budget-mib; the first N
past the budget is measured and reported as over it, and larger N are not run.

    python benchmarks/many_codes.py [--n 1024] [--chunk-size 64] [--depth 16] [--width 512]
"""
import argparse
import json
import pathlib
import platform
import sys
import time

import torch
from tqdm.auto import tqdm

import mixedad
from mixedad.profiling import median_time, peak_memory
from mixedad.reference import double_backward_input_grad
from mixedad.testing import max_relative_error


def make_problem(n, depth, width, measurements, seed=0):
    G = mixedad.zoo.mlp(depth, width, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, width, generator=gen)
    y = {  # the learned measurement side: a matrix and an offset
        "A": (torch.randn(width, measurements, generator=gen) / width ** 0.5).requires_grad_(),
        "b": torch.randn(measurements, generator=gen).requires_grad_(),
    }
    x = torch.randn(width, 8, generator=gen).requires_grad_()
    return G, z, y, x


def f(y, g):
    """Measurement misfit of a batch of generated signals g."""
    return ((torch.tanh(g @ y["A"]) - y["b"]) ** 2).sum()


def outer(dfdz, x):
    """A nonlinear objective coupling all codes' input gradients and x."""
    return torch.log1p((dfdz @ x) ** 2).sum()


def step(make_dfdz, problem):
    G, z, y, x = problem
    for t in (*y.values(), x):
        t.grad = None
    outer(make_dfdz(f, G, z, y), x).backward()
    return {"A": y["A"].grad.clone(), "b": y["b"].grad.clone()}


def measure(name, make_dfdz, n, chunk_size, args, log):
    problem = make_problem(n, args.depth, args.width, args.measurements)
    grads, peak = peak_memory(step, make_dfdz, problem)
    seconds = median_time(lambda: step(make_dfdz, problem), repeats=args.repeats, warmup=0)
    log(f"  {name:<28} N={n:<5} chunk={chunk_size or 'all':<4} peak {peak / 2**20:8.2f} MiB  time {seconds:7.3f} s")
    return {"method": name, "N": n, "chunk_size": chunk_size, "peak_bytes": peak, "seconds": seconds}, grads


def run(args, log=print):
    started = time.perf_counter()
    budget = args.budget_mib * 2**20
    log(f"many latent codes: MLP generator depth {args.depth}, width {args.width}, float32, CPU; "
        f"chunk size {args.chunk_size}; naive budget {args.budget_mib} MiB")
    rows, grads = [], {}
    ours_ns = sorted({64, args.n // 4, args.n} - {0})
    for n in tqdm(ours_ns, desc="input_grad by number of codes", unit="N", file=sys.stderr):
        row, grads[("ours", n)] = measure(
            "mixedad.input_grad", lambda *a: mixedad.input_grad(*a, chunk_size=args.chunk_size), n,
            args.chunk_size, args, log)
        rows.append(row)
    n = 64
    while n <= args.n:
        row, grads[("naive", n)] = measure("naive create_graph", double_backward_input_grad, n, None, args, log)
        row["within_budget"] = row["peak_bytes"] <= budget
        rows.append(row)
        if not row["within_budget"]:
            log(f"  naive create_graph exceeds the {args.budget_mib} MiB budget at N={n}; stopping")
            break
        n *= 2
    base = next(r for r in rows if r["method"] == "mixedad.input_grad" and r["N"] == 64)
    for r in rows:
        r["peak_vs_ours_N64"] = r["peak_bytes"] / base["peak_bytes"]
        r["time_vs_ours_N64"] = r["seconds"] / base["seconds"]
        key = ("naive", r["N"]) if r["method"] == "mixedad.input_grad" else ("ours", r["N"])
        other = grads.get(key)
        r["y_grad_rel_err"] = None if other is None else max_relative_error(
            grads[("ours", r["N"])], grads[("naive", r["N"])])
    log(f"done in {time.perf_counter() - started:.1f} s")
    return rows


def markdown(rows, args):
    lines = [
        f"N latent codes, generator depth {args.depth}, width {args.width}, float32, CPU "
        f"(torch {torch.__version__}, {platform.machine()}); naive budget {args.budget_mib} MiB.",
        "",
        "| method | N | chunk | peak memory | peak / ours at N=64 | time | time / ours at N=64 | y.grad rel err vs naive |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        over = " (over budget)" if r.get("within_budget") is False else ""
        err = "" if r["y_grad_rel_err"] is None else f"{r['y_grad_rel_err']:.1e}"
        lines.append(
            f"| {r['method']} | {r['N']} | {r['chunk_size'] or 'all'} | {r['peak_bytes'] / 2**20:.2f} MiB{over} | "
            f"{r['peak_vs_ours_N64']:.2f} | {r['seconds']:.3f} s | {r['time_vs_ours_N64']:.2f} | {err} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024, help="largest number of latent codes")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--measurements", type=int, default=64)
    parser.add_argument("--budget-mib", type=float, default=32.0,
                        help="memory budget for the naive code, standing in for the memory a GPU has left")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    rows = run(args, log=tqdm.write)  # log lines above the progress bar
    table = markdown(rows, args)
    print("\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()}
    (args.out / "many_codes_cpu.json").write_text(json.dumps({"config": config, "rows": rows}, indent=2))
    (args.out / "many_codes_cpu.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
