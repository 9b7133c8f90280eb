"""Benchmark: mixed_grad against double backward, torch.func and the forward-AD recipe, by depth.

Runs ``python -m mixedad profile`` on CPU for the MLP (depths 4 to 64, width 512, batch 256) and
the DCGAN-style generator (32x32, 0 to 4 extra conv blocks per scale, batch 32) and writes
benchmarks/results/{mlp,dcgan}_cpu.{json,md,png}. Then it checks the performance targets:

- mixed_grad's time at most 2.2x a plain no_grad forward of G, on the MLP (depth 64) and the
  DCGAN (4 extra blocks);
- at most 0.6x double backward's time on the MLP;
- peak memory at most 2.5x a plain forward's peak on the DCGAN, and flat in depth.

The MLP also runs ``mixed_grad_no_onednn``: mixed_grad with its oneDNN tangent kernel for float32
Linear layers switched off, so that the table shows what the kernel choice buys and what the
algorithm alone gives (every matrix product on the same BLAS as the baselines). Those rows are
reported for information, without a limit.

    python benchmarks/mixed_grad_vs_depth.py [--out DIR] [--repeats N] [--quick]

``--quick`` runs tiny models, to check the pipeline end to end in seconds (its ratios mean nothing).
"""
import json
import sys

from mixedad.benchmark import DEFAULT_STRATEGIES, script_arguments
from mixedad.cli import main as mixedad_main



def targets(out):
    mlp = json.loads((out / "mlp_cpu.json").read_text())["rows"]
    dcgan = json.loads((out / "dcgan_cpu.json").read_text())["rows"]

    def row(rows, depth, strategy="mixed_grad"):
        return next(r for r in rows if r["depth"] == depth and r["strategy"] == strategy)

    deep_mlp, deep_dcgan = row(mlp, max(r["depth"] for r in mlp)), row(dcgan, max(r["depth"] for r in dcgan))
    same_blas = row(mlp, deep_mlp["depth"], "mixed_grad_no_onednn")
    dcgan_peaks = [r["peak_bytes"] for r in dcgan if r["strategy"] == "mixed_grad"]
    plain_peaks = [r["peak_bytes"] for r in dcgan if r["strategy"] == "plain_forward"]
    return [
        ("MLP: time / plain forward", deep_mlp["time_vs_plain_forward"], 2.2),
        ("MLP: time / double backward", deep_mlp["time_vs_double_backward"], 0.6),
        ("DCGAN: time / plain forward", deep_dcgan["time_vs_plain_forward"], 2.2),
        ("DCGAN: peak / plain forward", deep_dcgan["peak_vs_plain_forward"], 2.5),
        ("DCGAN: mixed_grad peak, deepest / shallowest", dcgan_peaks[-1] / dcgan_peaks[0],
         1.1 * plain_peaks[-1] / plain_peaks[0]),
        ("MLP, oneDNN tangent off (same BLAS as the baselines): time / plain forward",
         same_blas["time_vs_plain_forward"], None),
        ("MLP, oneDNN tangent off (same BLAS as the baselines): time / double backward",
         same_blas["time_vs_double_backward"], None),
    ]


def main(argv=None):
    parser = script_arguments(__file__, __doc__, repeats=15, quick="tiny models: a smoke test of the pipeline")
    args = parser.parse_args(argv)
    common = ["--out", str(args.out), "--repeats", str(args.repeats)]
    mlp = ["--depths", "4", "8", "16", "32", "64"]
    dcgan = ["--depths", "0", "1", "2", "4"]
    if args.quick:
        mlp = ["--depths", "1", "2", "--width", "8", "--batch", "4"]
        dcgan = ["--depths", "0", "1", "--width", "4", "--batch", "2"]
    mlp_strategies = ["--strategies", *DEFAULT_STRATEGIES, "mixed_grad_no_onednn"]
    mixedad_main(["profile", "--model", "mlp", *mlp, *mlp_strategies, *common])
    mixedad_main(["profile", "--model", "dcgan", *dcgan, *common])
    lines = ["| target | measured | limit | met |", "|---|---|---|---|"]
    for name, value, limit in targets(args.out):
        if limit is None:
            lines.append(f"| {name} | {value:.2f} | (information) | |")
        else:
            lines.append(f"| {name} | {value:.2f} | {limit:.2f} | {'yes' if value <= limit else 'NO'} |")
    summary = "\n".join(lines)
    (args.out / "targets_cpu.md").write_text(summary + "\n")
    print("\n" + summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
