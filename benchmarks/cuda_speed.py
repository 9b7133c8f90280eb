"""Benchmark: mixed_grad's speed on a GPU, side by side, as time over G's plain eager forward.

For each generator, in one process (float32; medians of round-robin ratios, timed with CUDA events):

- ``dcgan`` (eval mode, 4 extra blocks; two sizes): plain forward, two plain forwards, mixed_grad (eager, from a
  key's third call: its tangent program), mixed_grad compiled, double backward, the hand JVP of
  ``benchmarks/tangent_speed.py`` and that hand JVP compiled;
- ``attention`` (``zoo.attention_stack(64, nhead=4, layers=2)``, T = 2048 and 8192): plain forward, double
  backward, and mixed_grad with the attention rule's block of scores at several sizes (``--block-mib``,
  through ``mixedad.op_rules.attention_blocks``; the default is 1.5 MiB, sized for a CPU's cache), each
  with its peak memory (the CUDA allocator's, exact).

On an H200 (torch 2.11) mixed_grad on attention took 38x (T = 2048) and 59x (T = 8192) the plain forward at the
default block size, against double backward's 10x and 9x: 353 causal blocks a layer at T = 8192, each a dozen
kernel launches. This benchmark measures what larger blocks give. Writes ``cuda_speed_<device>.{json,md}`` under
``--out`` (default: ``benchmarks/results/cuda-<GPU name>/``). Without a GPU it says so and exits 0;
``--device cpu --quick`` runs it at a tiny size (a test of the script).

    python benchmarks/cuda_speed.py [--out DIR] [--repeats N] [--block-mib 1.5 16 64] [--device cuda|cpu] [--quick]
"""
import json
import pathlib
import re
import sys
import time

import torch

import mixedad
from mixedad.benchmark import build, interleaved_ratios, objective, peak, script_arguments
from mixedad.reference import double_backward_mixed_grad

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from tangent_speed import hand_jvp  # noqa: E402


def dcgan_row(size, device, repeats):
    depth, width, batch = size
    G, z, y, v = build("dcgan", depth, width, batch, torch.float32, device)
    G.eval().requires_grad_(False)
    plain, hand = torch.no_grad()(G), hand_jvp(G)
    start = time.perf_counter()
    mixedad.mixed_grad(objective, G, z, y, v, compile=True)
    compile_seconds = time.perf_counter() - start
    hand_compiled = torch.compile(hand)
    hand_compiled(z, v)
    fns = {"plain forward": lambda: plain(z), "two plain forwards": lambda: (plain(z), plain(z)),
           "mixed_grad": lambda: mixedad.mixed_grad(objective, G, z, y, v),
           "mixed_grad compiled": lambda: mixedad.mixed_grad(objective, G, z, y, v, compile=True),
           "double backward": lambda: double_backward_mixed_grad(objective, G, z, y, v),
           "hand JVP": lambda: hand(z, v), "hand JVP compiled": lambda: hand_compiled(z, v)}
    ratios, seconds = interleaved_ratios(fns, "plain forward", device, repeats)
    return {"generator": f"dcgan {width} channels, batch {batch}", "plain_ms": seconds["plain forward"] * 1e3,
            "time_vs_plain": ratios, "mixed_grad_compile_seconds": compile_seconds}


def attention_row(tokens, blocks_mib, device, repeats):
    G = mixedad.zoo.attention_stack(64, nhead=4, layers=2, device=device).requires_grad_(False)
    gen = torch.Generator().manual_seed(tokens)
    z, y, v = (torch.randn(1, tokens, 64, generator=gen).to(device) for _ in range(3))
    plain = torch.no_grad()(G)

    def with_blocks(mib):
        def run():
            with mixedad.op_rules.attention_blocks(int(mib * 2**20)):
                return mixedad.mixed_grad(objective, G, z, y, v)
        return run

    fns = {"plain forward": lambda: plain(z),
           "double backward": lambda: double_backward_mixed_grad(objective, G, z, y, v)}
    fns.update({f"mixed_grad, {mib:g} MiB blocks": with_blocks(mib) for mib in blocks_mib})
    ratios, seconds = interleaved_ratios(fns, "plain forward", device, repeats)
    base = peak(fns["plain forward"], device)[1]
    peaks = {name: peak(fn, device)[1] / base for name, fn in fns.items()}
    return {"generator": f"attention T={tokens}", "plain_ms": seconds["plain forward"] * 1e3,
            "time_vs_plain": ratios, "peak_vs_plain": peaks}


def markdown(rows, meta):
    lines = [f"Time over G's plain eager forward; float32, {meta['device']} (torch {meta['torch']}); medians of "
             f"{meta['repeats']} round-robin ratios in one process. Peaks are the allocator's, over the plain forward's."]
    for row in rows:
        lines += ["", f"**{row['generator']}** (plain forward {row['plain_ms']:.2f} ms"
                  + (f", mixed_grad compile=True's first call {row['mixed_grad_compile_seconds']:.1f} s"
                     if "mixed_grad_compile_seconds" in row else "") + ")", "",
                  "| method | time / plain | peak / plain |", "|---|---|---|"]
        for name, ratio in row["time_vs_plain"].items():
            peak_ratio = row.get("peak_vs_plain", {}).get(name)
            lines.append(f"| {name} | {ratio:.2f}x | {'' if peak_ratio is None else f'{peak_ratio:.2f}x'} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = script_arguments(__file__, __doc__, repeats=15, quick="tiny sizes (a test of the script)")
    parser.add_argument("--block-mib", type=float, nargs="+", default=[1.5, 16.0, 64.0, 256.0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/cuda_speed.py: no CUDA device is available here; nothing to measure.")
        return 0
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    out = args.out
    if args.device == "cuda" and "--out" not in (argv if argv is not None else sys.argv):
        out = out / ("cuda-" + re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-"))
    sizes = [(0, 4, 2)] if args.quick else [(4, 64, 128), (4, 128, 256)]
    tokens = [64] if args.quick else [2048, 8192]
    rows = [dcgan_row(size, args.device, args.repeats) for size in sizes]
    rows += [attention_row(t, args.block_mib, args.device, args.repeats) for t in tokens]
    meta = {"device": name, "torch": torch.__version__, "repeats": args.repeats}
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"cuda_speed_{args.device}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    table = markdown(rows, meta)
    stem.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
