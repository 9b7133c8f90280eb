"""Benchmark: z-space curvature products and implicit gradients against the torchopt-style anchor, by depth.

The anchor is what torchopt's and JAXopt's implicit differentiation do in PyTorch: the gradient
in z built once with ``create_graph=True``, then ``torch.autograd.grad(gradient, z, u,
retain_graph=True)`` per product, its graph alive through the solve. Side by side in one
process, float32, CPU, for an MLP (width 512, batch 64) and the DCGAN (16 channels, batch 4,
depth = extra blocks), at each depth:

- peak memory (exact byte counts) of building the operator and taking one product:
  ``anchor`` against ``mixedad.z_curvature`` with kind "ggn" and "hessian" (and the Hessian with
  ``keep_graph=True``, the opt-in that trades memory for speed);
- time of one product (the operator or graph built beforehand), medians of round-robin repeats;
- ``implicit_grad`` with 5 conjugate-gradient iterations (a fixed-iteration solver on both
  sides), against the anchor's solve (graph, CG, mixed term): peak and time.

Targets (issue 21), at depth 32: GGN product peak <= 0.25x the anchor's (<= 0.45x at depth 8),
Hessian <= 0.40x, growth from depth 8 to 32 <= 2.2; implicit_grad <= 0.40x the anchor solve
(<= 0.25x with the GGN); time within 2.5x (GGN), 3.5x (Hessian) of the anchor's product and
6.5x of its solve. Writes benchmarks/results/curvature_cpu.{json,md}.

    python benchmarks/curvature_vs_depth.py [--out DIR] [--repeats N] [--quick]
"""
import json
import platform
import sys
import warnings

import torch
from tqdm.auto import tqdm

import mixedad
from mixedad.benchmark import build, interleaved_times, peak, script_arguments

ITERATIONS = 5


def objective(y, g):
    """A non-quadratic f, so that G's own curvature enters the Hessian."""
    return ((g - y) ** 2).sum() + (torch.tanh(g) * y).sum()


def fixed_cg(matvec, b, iterations=ITERATIONS):
    """Conjugate gradients for a fixed number of iterations (the same solver on both sides)."""
    x, r = torch.zeros_like(b), b.clone()
    p, rr = r.clone(), (r * r).sum()
    for _ in range(iterations):
        ap = matvec(p)
        alpha = rr / (p * ap).sum()
        x, r = x + alpha * p, r - alpha * ap
        rr_next = (r * r).sum()
        p, rr = r + (rr_next / rr) * p, rr_next
    return x


class Anchor:
    """The torchopt-style baseline: the gradient's graph built once, one backward per product."""

    def __init__(self, G, z, y):
        self.z, self.y = z.detach().requires_grad_(), y.detach().requires_grad_()
        (self.gradient,) = torch.autograd.grad(objective(self.y, G(self.z)), self.z, create_graph=True)

    def matvec(self, u):
        return torch.autograd.grad(self.gradient, self.z, u, retain_graph=True)[0] + u  # damping 1

    def implicit(self, w):
        x = fixed_cg(self.matvec, w)
        return -torch.autograd.grad(self.gradient, self.y, x, retain_graph=True)[0]


def ours_solve(G, z, y, w, kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # z is not a minimiser here: the cost is measured
        return mixedad.implicit_grad(objective, G, z, y, w, kind=kind, damping=1.0, solve=fixed_cg)


def point(model, depth, width, batch, repeats):
    G, z, y, u = build(model, depth, width, batch, torch.float32, "cpu")
    G.requires_grad_(False)  # a frozen generator, for the anchor too
    operators = {kind: lambda kind=kind, keep=False: mixedad.z_curvature(objective, G, z, y, kind=kind, damping=1.0,
                                                                         keep_graph=keep)
                 for kind in ("ggn", "hessian")}
    builds = {
        "anchor": lambda: Anchor(G, z, y).matvec(u),
        "ggn": lambda: operators["ggn"]() @ u,
        "hessian": lambda: operators["hessian"]() @ u,
        "hessian_keep_graph": lambda: operators["hessian"](keep=True) @ u,
        "anchor_solve": lambda: Anchor(G, z, y).implicit(u),
        "implicit_ggn": lambda: ours_solve(G, z, y, u, "ggn"),
        "implicit_hessian": lambda: ours_solve(G, z, y, u, "hessian"),
    }
    results, peaks = {}, {}
    for name, fn in builds.items():
        results[name], peaks[name] = peak(fn, "cpu")
    anchor, ggn, hessian = Anchor(G, z, y), operators["ggn"](), operators["hessian"]()
    kept = operators["hessian"](keep=True)
    seconds = interleaved_times({
        "anchor": lambda: anchor.matvec(u), "ggn": lambda: ggn @ u, "hessian": lambda: hessian @ u,
        "hessian_keep_graph": lambda: kept @ u, "anchor_solve": builds["anchor_solve"],
        "implicit_ggn": builds["implicit_ggn"], "implicit_hessian": builds["implicit_hessian"]}, "cpu", repeats)
    error = float((results["hessian"] - results["anchor"]).norm() / results["anchor"].norm())
    solve_error = float((results["implicit_hessian"] - results["anchor_solve"]).norm() / results["anchor_solve"].norm())
    return {"model": model, "depth": depth, "peak_bytes": peaks, "seconds": seconds,
            "hessian_rel_error": error, "implicit_rel_error": solve_error}


def ratios(row):
    p, s = row["peak_bytes"], row["seconds"]
    return {
        "ggn_peak": p["ggn"] / p["anchor"], "hessian_peak": p["hessian"] / p["anchor"],
        "keep_graph_peak": p["hessian_keep_graph"] / p["anchor"],
        "implicit_hessian_peak": p["implicit_hessian"] / p["anchor_solve"],
        "implicit_ggn_peak": p["implicit_ggn"] / p["anchor_solve"],
        "ggn_time": s["ggn"] / s["anchor"], "hessian_time": s["hessian"] / s["anchor"],
        "keep_graph_time": s["hessian_keep_graph"] / s["anchor"],
        "implicit_time": s["implicit_hessian"] / s["anchor_solve"],
    }


def markdown(rows):
    lines = [
        f"float32, CPU (torch {torch.__version__}, {platform.machine()}); damping 1; {ITERATIONS} CG iterations; "
        f"peaks exact, times medians of round-robin repeats in one process.",
        "",
        "| model | depth | anchor product peak | GGN / anchor | Hessian / anchor | Hessian keep_graph / anchor | "
        "anchor solve peak | implicit (Hessian) / anchor | implicit (GGN) / anchor | time: GGN / anchor | "
        "Hessian / anchor | keep_graph / anchor | implicit / anchor solve | Hessian rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        r, p = ratios(row), row["peak_bytes"]
        lines.append(
            f"| {row['model']} | {row['depth']} | {p['anchor'] / 2**20:.2f} MiB | {r['ggn_peak']:.3f} | "
            f"{r['hessian_peak']:.3f} | {r['keep_graph_peak']:.3f} | {p['anchor_solve'] / 2**20:.2f} MiB | "
            f"{r['implicit_hessian_peak']:.3f} | {r['implicit_ggn_peak']:.3f} | {r['ggn_time']:.2f} | "
            f"{r['hessian_time']:.2f} | {r['keep_graph_time']:.2f} | {r['implicit_time']:.2f} | "
            f"{row['hessian_rel_error']:.1e} |")
    return "\n".join(lines)


def targets(rows):
    """(what, measured, bound) for every target of the issue that these rows measure."""
    checks = []
    for model in sorted({r["model"] for r in rows}):
        at = {r["depth"]: r for r in rows if r["model"] == model}
        if 8 in at and 32 in at:
            shallow, deep = ratios(at[8]), ratios(at[32])
            checks += [
                (f"{model}: GGN peak / anchor, depth 8", shallow["ggn_peak"], 0.45),
                (f"{model}: GGN peak / anchor, depth 32", deep["ggn_peak"], 0.25),
                (f"{model}: Hessian peak / anchor, depth 32", deep["hessian_peak"], 0.40),
                (f"{model}: implicit (Hessian) peak / anchor solve, depth 32", deep["implicit_hessian_peak"], 0.40),
                (f"{model}: implicit (GGN) peak / anchor solve, depth 32", deep["implicit_ggn_peak"], 0.25),
            ]
            for kind in ("ggn", "hessian"):
                growth = at[32]["peak_bytes"][kind] / at[8]["peak_bytes"][kind]
                checks.append((f"{model}: {kind} peak growth, depth 8 to 32", growth, 2.2))
        for depth, row in sorted(at.items()):
            r = ratios(row)
            checks += [(f"{model}: GGN time / anchor, depth {depth}", r["ggn_time"], 2.5),
                       (f"{model}: Hessian time / anchor, depth {depth}", r["hessian_time"], 3.5),
                       (f"{model}: implicit time / anchor solve, depth {depth}", r["implicit_time"], 6.5)]
    return checks


def main(argv=None):
    parser = script_arguments(__file__, __doc__, repeats=5, quick="tiny models at depths 8 and 32")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    if args.quick:
        cases = [("mlp", d, 16, 4) for d in (8, 32)] + [("dcgan", d, 4, 2) for d in (8, 32)]
    else:
        cases = [("mlp", d, 512, 64) for d in (8, 32, 64)] + [("dcgan", d, 16, 4) for d in (8, 32, 64)]
    rows = [point(*case, args.repeats) for case in tqdm(cases, desc="models and depths", unit="point", file=sys.stderr)]
    table = markdown(rows)
    checks = targets(rows)
    lines = ["| target | measured | bound | met |", "|---|---|---|---|"]
    lines += [f"| {what} | {value:.3f} | {bound} | {'yes' if value <= bound else 'NO'} |" for what, value, bound in checks]
    report = table + "\n\n" + "\n".join(lines)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) for k, v in vars(args).items()}
    (args.out / "curvature_cpu.json").write_text(json.dumps({"config": config, "rows": rows}, indent=2))
    (args.out / "curvature_cpu.md").write_text(report + "\n")
    missed = [what for what, value, bound in checks if value > bound]
    if missed and not args.quick:
        print(f"targets missed: {missed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
