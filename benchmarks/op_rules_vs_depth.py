"""Benchmark: peak memory against depth for generators PyTorch's forward mode cannot pass.

The StyleGAN2-ADA-like generator (custom Functions without jvp: bias_act, fma, upfirdn2d) and
the VQ-style decoder (torch.cdist quantiser, GroupNorm), CPU, float32, exact byte counts. Three
ways to the same mixed derivative, side by side in one process:

- ``mixed_grad``: with the per-op rules (the local double-VJP rule, written formulas);
- ``mixed_grad_no_local_rule``: mixedad without them, so all of G takes the whole-G fallback;
- ``double_backward``: the naive create_graph code;

plus ``plain_forward``, the yardstick. Writes benchmarks/results/{stylegan2_ada,vq_decoder}_cpu.*
and prints a markdown table of peak memory by depth.

    python benchmarks/op_rules_vs_depth.py [--out DIR] [--repeats N] [--quick]
"""

from mixedad import benchmark

STRATEGIES = ["mixed_grad", "mixed_grad_no_local_rule", "double_backward", "plain_forward"]
SETTINGS = {"stylegan2_ada": dict(width=32, batch=8), "vq_decoder": dict(width=32, batch=8)}


def table(rows_by_model):
    lines = ["| model | depth | mixed_grad | mixed_grad, local rule off | double backward | plain forward | "
             "mixed_grad / double backward | max rel error |",
             "|---|---|---|---|---|---|---|---|"]
    for model, rows in rows_by_model.items():
        for depth in sorted({r["depth"] for r in rows}):
            at = {r["strategy"]: r for r in rows if r["depth"] == depth}
            mib = lambda s: f"{at[s]['peak_bytes'] / 2**20:.2f} MiB"  # noqa: E731
            lines.append(f"| {model} | {depth} | {mib('mixed_grad')} | {mib('mixed_grad_no_local_rule')} | "
                         f"{mib('double_backward')} | {mib('plain_forward')} | "
                         f"{at['mixed_grad']['peak_vs_double_backward']:.3f} | {at['mixed_grad']['max_rel_error']:.1e} |")
    return "\n".join(lines)


def main(argv=None):
    parser = benchmark.script_arguments(__file__, __doc__, repeats=3, quick="tiny models, to check the pipeline")
    args = parser.parse_args(argv)
    depths = [1, 2] if args.quick else [2, 8, 32]
    rows_by_model = {}
    for model, settings in SETTINGS.items():
        if args.quick:
            settings = dict(width=8, batch=2)
        rows = benchmark.profile(model, depths, strategies=STRATEGIES, repeats=args.repeats, **settings)
        benchmark.write(rows, args.out, f"{model}_cpu", f"{model}: peak memory and time against depth")
        rows_by_model[model] = rows
    text = table(rows_by_model)
    (args.out / "op_rules_memory_cpu.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
