"""Benchmark: attention generators by sequence length, with mixedad's blockwise attention rule.

G is ``zoo.attention_stack(64, nhead=4, layers=2)``: two layers of [Linear to q, k, v ->
``F.scaled_dot_product_attention(is_causal=True)`` over 4 heads -> Linear out, residual], batch 1,
float32, CPU. For each length T, side by side in one process (peaks exact, times the median of
round-robin repeats):

- ``plain_forward``: G(z) under no_grad, on PyTorch's fused CPU kernel;
- ``mixed_grad``: with the attention rule (fused primal, blockwise tangent);
- ``input_grad+backward``: ``input_grad`` and ``.backward()`` to y;
- ``mixed_grad_math_attention``: without the rule, through the math backend (T x T);
- ``double_backward``: the naive create_graph code (math backend, T x T).

The two T x T baselines stop at ``--max-baseline`` (default 4096): at 8192 each of their
T x T tensors is 1 GiB. Targets, at T = 2048: mixed_grad's peak at most 4x a plain forward's and
its time at most 5x; input_grad with backward at most 6x the plain peak. Writes
benchmarks/results/attention_cpu.{json,md,png}.

    python benchmarks/attention_vs_length.py [--out DIR] [--repeats N] [--quick]
"""
import json
import sys

import torch
from tqdm.auto import tqdm

import mixedad
from mixedad.benchmark import STRATEGIES, interleaved_times, objective, peak, script_arguments
from mixedad.testing import max_relative_error

QUADRATIC = ("mixed_grad_math_attention", "double_backward")


def _input_grad_backward(f, G, z, y, v):
    y = y.detach().requires_grad_()
    (mixedad.input_grad(f, G, z, y) * v).sum().backward()
    return y.grad


def point(G, T, repeats, with_baselines):
    gen = torch.Generator().manual_seed(T)
    z, y, v = (torch.randn(1, T, 64, generator=gen) for _ in range(3))
    names = ["plain_forward", "mixed_grad", "input_grad+backward"] + (list(QUADRATIC) if with_baselines else [])
    fn_of = {name: STRATEGIES.get(name, _input_grad_backward) for name in names}
    fns = {name: (lambda fn=fn: fn(objective, G, z, y, v)) for name, fn in fn_of.items()}
    results, peaks = {}, {}
    for name, fn in fns.items():
        results[name], peaks[name] = peak(fn, "cpu")
    seconds = interleaved_times(fns, "cpu", repeats)
    rows = []
    for name in names:
        row = {"T": T, "strategy": name, "seconds": seconds[name], "peak_bytes": peaks[name],
               "peak_vs_plain": peaks[name] / peaks["plain_forward"],
               "time_vs_plain": seconds[name] / seconds["plain_forward"]}
        if name in ("mixed_grad", "mixed_grad_math_attention") and "double_backward" in results:
            row["max_rel_error"] = max_relative_error(results[name], results["double_backward"])
        rows.append(row)
        print(f"T {T:>5} {name:<26} {seconds[name] * 1e3:9.1f} ms {peaks[name] / 2**20:9.2f} MiB "
              f"peak x{row['peak_vs_plain']:6.2f} time x{row['time_vs_plain']:6.2f}", file=sys.stderr, flush=True)
    return rows


def markdown(rows):
    lines = ["| T | strategy | time | peak | peak / plain forward | time / plain forward | max rel error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        err = f"{r['max_rel_error']:.1e}" if "max_rel_error" in r else ""
        lines.append(f"| {r['T']} | {r['strategy']} | {r['seconds'] * 1e3:.1f} ms | {r['peak_bytes'] / 2**20:.2f} MiB | "
                     f"{r['peak_vs_plain']:.2f} | {r['time_vs_plain']:.2f} | {err} |")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == name]
        axes[0].plot([r["T"] for r in mine], [r["peak_bytes"] / 2**20 for r in mine], marker="o", label=name)
        axes[1].plot([r["T"] for r in mine], [r["seconds"] * 1e3 for r in mine], marker="o", label=name)
    for ax, label in zip(axes, ("peak memory (MiB)", "time (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("2 causal attention layers, d_model 64, 4 heads, batch 1, float32 CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def targets(rows):
    at = {r["strategy"]: r for r in rows if r["T"] == 2048}
    if not at:
        return []
    return [("mixed_grad: peak / plain forward, T = 2048", at["mixed_grad"]["peak_vs_plain"], 4.0),
            ("mixed_grad: time / plain forward, T = 2048", at["mixed_grad"]["time_vs_plain"], 5.0),
            ("input_grad + backward: peak / plain forward, T = 2048", at["input_grad+backward"]["peak_vs_plain"], 6.0)]


def main(argv=None):
    parser = script_arguments(__file__, __doc__, repeats=9, quick="short sequences, to check the pipeline")
    parser.add_argument("--max-baseline", type=int, default=4096)
    args = parser.parse_args(argv)
    lengths = [64, 128] if args.quick else [256, 512, 1024, 2048, 4096, 8192]
    G = mixedad.zoo.attention_stack(64, nhead=4, layers=2)
    rows = []
    for T in tqdm(lengths, desc="attention by sequence length", unit="length", file=sys.stderr):
        rows += point(G, T, args.repeats, T <= args.max_baseline)
    args.out.mkdir(parents=True, exist_ok=True)
    checks = targets(rows)
    (args.out / "attention_cpu.json").write_text(json.dumps({"rows": rows, "targets": checks}, indent=1))
    text = markdown(rows)
    if checks:
        text += "\n\n| target | measured | limit | met |\n|---|---|---|---|\n" + "\n".join(
            f"| {name} | {value:.2f} | {limit:.1f} | {'yes' if value <= limit else 'NO'} |" for name, value, limit in checks)
    (args.out / "attention_cpu.md").write_text(text + "\n")
    plot(rows, args.out / "attention_cpu.png")
    print(text)


if __name__ == "__main__":
    main()
