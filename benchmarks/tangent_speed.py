"""Benchmark: the speed of the tangent, side by side, as time over G's plain eager forward.

For each generator, in one process (float32, CPU; each ratio is the median over round-robin repeats
of the ratio within one round, so that a shared machine's slow spells cancel):

- ``plain_forward``: G(z) under no_grad (the unit);
- ``two plain forwards``: G(z) twice, the floor of any tangent pass that computes the primal and a
  tangent of the same cost;
- ``two compiled forwards`` (with ``--compile``, where G has a tangent program): ``torch.compile(G)(z)``
  twice, the compiler's kernels for the primal and a tangent of the same cost computed apart (the
  reference for a compiled pass where G's time is its convolutions, as the DCGAN's);
- ``mixed_grad``: mixedad's default, eager (from a key's third call: G's tangent program run
  without the compiler, where G has one; the per-op pass elsewhere);
- ``mixed_grad per-op``: mixedad's per-op pass alone (what the default runs on a first call, and for a
  G without a program);
- ``mixed_grad compiled``: ``mixed_grad(..., compile=True)`` after its first call (G's tangent
  program under ``torch.compile``; the first call's compile time, which includes the check against
  the eager pass, is reported on its own); a G without a tangent program runs eager there (attention);
- ``torch.func.jvp``: the tangent of G alone by torch.func (PyTorch's forward-AD formulas; attention
  on the math backend, since the fused kernels have none);
- ``hand JVP``: a hand-written tangent pass (two convolutions a layer, the batch-norm scale
  applied to the tangent, ReLU's mask), the floor eager code reaches; ``hand JVP compiled``
  is the same function under ``torch.compile`` (with ``--compile``; its compile time is reported
  on its own).

Generators:

- ``dcgan``: the DCGAN of the depth benchmark (4 extra conv blocks per scale, 32 channels,
  batch 32), in eval mode and in train mode (BatchNorm over the batch's statistics; torch.func
  refuses the in-place update of running statistics there, and the hand JVP is eval-only);
- ``mlp``: the MLP of the depth benchmark (depth 64, width 512, batch 256);
- ``attention``: two causal attention layers (``zoo.attention_stack(64, nhead=4, layers=2)``) at
  T = 2048, with the peak memory of each (exact bytes) over the plain forward's.

Targets (issue 22): the DCGAN at most 2.05x in eval and train mode, and at most 1.6x compiled;
attention at most 3.5x, its peak at most 3x. Writes benchmarks/results/tangent_speed_cpu.{json,md}; the docs include the
table from there, and (unless ``--out`` points elsewhere) the README's speed table, between its
``tangent-speed`` markers, is rewritten from it.

    python benchmarks/tangent_speed.py [--out DIR] [--repeats N] [--compile] [--quick]
"""
import json
import pathlib
import platform
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

import mixedad
from mixedad.benchmark import build, interleaved_ratios, objective, peak, script_arguments

TARGETS = {("dcgan (eval)", "time"): 2.05, ("dcgan (train)", "time"): 2.05, ("dcgan (eval)", "compiled"): 1.6,
           ("dcgan (train)", "compiled"): 1.6, ("attention", "time"): 3.5, ("attention", "peak"): 3.0}


def hand_jvp(G):
    """A hand-written tangent pass through an nn.Sequential of convolutions, eval BatchNorm, ReLU and tanh."""

    def tangent(x, t):
        for m in G:
            if isinstance(m, nn.ConvTranspose2d):
                x, t = m(x), F.conv_transpose2d(t, m.weight, None, m.stride, m.padding, m.output_padding, m.groups,
                                                m.dilation)
            elif isinstance(m, nn.Conv2d):
                x, t = m(x), F.conv2d(t, m.weight, None, m.stride, m.padding, m.dilation, m.groups)
            elif isinstance(m, nn.BatchNorm2d):
                x, t = m(x), t * (m.weight * torch.rsqrt(m.running_var + m.eps)).view(1, -1, 1, 1)
            elif isinstance(m, nn.ReLU):
                x = torch.relu(x)
                t = t * (x > 0)
            elif isinstance(m, nn.Tanh):
                x = torch.tanh(x)
                t = t * (1 - x * x)
            elif isinstance(m, nn.Unflatten):  # the zoo's latent-to-map reshape: linear, shape only
                x, t = m(x), m(t)
            else:
                raise TypeError(f"hand JVP: no tangent for {type(m).__name__}")
        return x, t

    return torch.no_grad()(tangent)


def problems(quick):
    """(name, G, z, y, v, with_jvp, with_hand) per generator."""
    dcgan = (0, 4, 2) if quick else (4, 32, 32)
    for mode in ("eval", "train"):
        G, z, y, v = build("dcgan", *dcgan, torch.float32, "cpu")
        G.train(mode == "train").requires_grad_(False)
        yield f"dcgan ({mode})", G, z, y, v, mode == "eval", mode == "eval"
    G, z, y, v = build("mlp", *((2, 8, 4) if quick else (64, 512, 256)), torch.float32, "cpu")
    yield "mlp", G.requires_grad_(False), z, y, v, True, False
    T = 64 if quick else 2048
    G = mixedad.zoo.attention_stack(64, nhead=4, layers=2).requires_grad_(False)
    gen = torch.Generator().manual_seed(T)
    z, y, v = (torch.randn(1, T, 64, generator=gen) for _ in range(3))
    yield "attention", G, z, y, v, True, False


def point(name, G, z, y, v, with_jvp, with_hand, repeats, also_compiled):
    def two_forwards():
        with torch.no_grad():
            G(z)
            return G(z)

    def per_op():
        with mixedad.programs.per_op_pass():
            return mixedad.mixed_grad(objective, G, z, y, v)

    fns = {"plain_forward": lambda: torch.no_grad()(G)(z), "two plain forwards": two_forwards,
           "mixed_grad": lambda: mixedad.mixed_grad(objective, G, z, y, v), "mixed_grad per-op": per_op}
    for _ in range(2):  # the default's program: written and checked on the second call
        fns["mixed_grad"]()
    compiled_seconds = None
    if name != "attention":  # no tangent program (attention has no rule): it would run eager
        start = time.perf_counter()
        mixedad.mixed_grad(objective, G, z, y, v, compile=True)
        compiled_seconds = time.perf_counter() - start
        [entry] = mixedad.programs.compiled_tangents(G)[-1:]
        if entry.status != "compiled":
            raise RuntimeError(f"{name}: compile=True ran eager: {entry.reason}")
        fns["mixed_grad compiled"] = lambda: mixedad.mixed_grad(objective, G, z, y, v, compile=True)
        if also_compiled:
            compiled_G = torch.no_grad()(torch.compile(G))

            def two_compiled_forwards():
                compiled_G(z)
                return compiled_G(z)

            fns["two compiled forwards"] = two_compiled_forwards
    if with_jvp:
        def func_jvp():
            with mixedad.reference.differentiable_attention():  # the fused kernels have no forward AD
                return torch.func.jvp(G, (z,), (v,))

        fns["torch.func.jvp"] = func_jvp
    compile_seconds = None
    if with_hand:
        hand = hand_jvp(G)
        fns["hand JVP"] = lambda: hand(z, v)
        if also_compiled:
            compiled = torch.compile(hand)
            start = time.perf_counter()
            compiled(z, v)
            compile_seconds = time.perf_counter() - start
            fns["hand JVP compiled"] = lambda: compiled(z, v)
    peaks = {key: peak(fn, "cpu")[1] for key, fn in fns.items()} if name == "attention" else {}
    ratios, seconds = interleaved_ratios(fns, "plain_forward", "cpu", repeats)
    row = {"generator": name, "seconds": seconds, "time_vs_plain": ratios, "compile_seconds": compile_seconds,
           "mixed_grad_compile_seconds": compiled_seconds}
    if peaks:
        row["peak_bytes"] = peaks
        row["peak_vs_plain"] = {k: p / peaks["plain_forward"] for k, p in peaks.items()}
    return row


COLUMNS = ["two plain forwards", "mixed_grad", "mixed_grad per-op", "two compiled forwards", "mixed_grad compiled",
           "torch.func.jvp", "hand JVP", "hand JVP compiled"]


def markdown(rows, meta):
    lines = [f"Time over G's plain eager forward; {meta}.", "",
             "| generator | plain forward | " + " | ".join(COLUMNS) + " | mixed_grad peak / plain |",
             "|---|---|" + "---|" * len(COLUMNS) + "---|"]
    for row in rows:
        cells = [f"{row['time_vs_plain'][c]:.2f}x" if c in row["time_vs_plain"] else "" for c in COLUMNS]
        peak_ratio = f"{row['peak_vs_plain']['mixed_grad']:.2f}x" if "peak_vs_plain" in row else ""
        lines.append(f"| {row['generator']} | {row['seconds']['plain_forward'] * 1e3:.1f} ms | " + " | ".join(cells)
                     + f" | {peak_ratio} |")
    compiled = [r for r in rows if r.get("mixed_grad_compile_seconds") is not None]
    if compiled:
        lines += ["", "First call of mixed_grad(compile=True) (compiling, and the check against the eager pass): "
                  + ", ".join(f"{r['generator']} {r['mixed_grad_compile_seconds']:.1f} s" for r in compiled) + "."]
    compiled = [r for r in rows if r["compile_seconds"] is not None]
    if compiled:
        lines += ["", "Compile time of the hand JVP (first call): "
                  + ", ".join(f"{r['generator']} {r['compile_seconds']:.1f} s" for r in compiled) + "."]
    lines += ["", "| target | measured | bound | met |", "|---|---|---|---|"]
    by_name = {r["generator"]: r for r in rows}
    for (name, kind), bound in TARGETS.items():
        row = by_name[name]
        value = {"time": lambda: row["time_vs_plain"]["mixed_grad"],
                 "compiled": lambda: row["time_vs_plain"]["mixed_grad compiled"],
                 "peak": lambda: row["peak_vs_plain"]["mixed_grad"]}[kind]()
        what = {"time": "mixed_grad time", "compiled": "mixed_grad compiled time", "peak": "mixed_grad peak"}[kind]
        lines.append(f"| {name}: {what} / plain forward | {value:.2f} | {bound} | "
                     f"{'yes' if value <= bound else 'NO'} |")
    return "\n".join(lines)


def main(argv=None):
    parser = script_arguments(__file__, __doc__, repeats=31, quick="tiny models: a smoke test of the pipeline")
    parser.add_argument("--compile", action="store_true", help="also time the hand JVP and G's own forward under torch.compile")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    meta = (f"float32, CPU (torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads); "
            f"median of {args.repeats} round-robin ratios in one process")
    rows = []
    todo = list(problems(args.quick))
    for name, G, z, y, v, with_jvp, with_hand in tqdm(todo, desc="tangent speed", unit="generator", file=sys.stderr):
        rows.append(point(name, G, z, y, v, with_jvp, with_hand, args.repeats, args.compile))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tangent_speed_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    table = markdown(rows, meta)
    (args.out / "tangent_speed_cpu.md").write_text(table + "\n")
    print(table)
    if args.out.resolve() == RESULTS:
        readme = README.read_text()
        README.write_text(readme_with_table(readme, table))
    return 0


RESULTS = pathlib.Path(__file__).resolve().parent / "results"
README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
MARKERS = ("<!-- tangent-speed:start -->", "<!-- tangent-speed:end -->")


def readme_table(table):
    """The README's speed table: the results' first table (time over a plain forward), as the docs show it."""
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| generator"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join([lines[0], "", *lines[start:end]])


def readme_with_table(readme, table):
    """``readme`` with the block between :data:`MARKERS` replaced by :func:`readme_table` of ``table``."""
    begin, end = readme.index(MARKERS[0]) + len(MARKERS[0]), readme.index(MARKERS[1])
    return readme[:begin] + "\n" + readme_table(table) + "\n" + readme[end:]


if __name__ == "__main__":
    sys.exit(main())
