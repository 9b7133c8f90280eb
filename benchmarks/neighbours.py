"""Benchmark: the neighbouring memory tools against the naive code, by exact peak memory.

- EagerPenalties: a backbone of tanh layers with a pairwise-similarity penalty after each, whose
  graph (B x B x width) dwarfs the activations. Naive: loss = main + sum(alpha * penalty).
- cached_backward: L = g(f(x_1), ..., f(x_n)) with a deep MLP f and a coupling g. Naive:
  g(torch.stack([f(x) for x in inputs])).backward().

Peaks are exact storage byte counts (mixedad.profiling), so the table is the same on any
machine; gradients are compared with the naive code's in the same run.

    python benchmarks/neighbours.py [--out DIR]
"""
import argparse
import json
import pathlib
import sys

import torch
from torch import nn

from mixedad import EagerPenalties, cached_backward
from mixedad.profiling import StorageCounter
from mixedad.testing import max_relative_error

HERE = pathlib.Path(__file__).resolve().parent


def pairwise_penalty(h):
    d = (h[:, None, :] - h[None, :, :]).pow(2).sum(-1)
    return torch.exp(-d / h.shape[1]).sum(1)


def penalties_step(weights, x, eager):
    for w in weights:
        w.grad = None
    ep, h, terms = EagerPenalties(), x, []
    for w in weights:
        h = torch.tanh(h @ w)
        if eager:
            h = ep.add(h, pairwise_penalty, weight=0.01)
        else:
            terms.append(0.01 * pairwise_penalty(h).sum())
    ((h ** 2).mean() + sum(terms)).backward() if terms else (h ** 2).mean().backward()
    return [w.grad.clone() for w in weights]


def cached_step(net, xs, cached, chunk_size):
    net.zero_grad(set_to_none=True)
    g = lambda Z: torch.logsumexp(Z.pow(2).sum(-1).mean(-1), 0)  # noqa: E731
    if cached:
        cached_backward(net, xs, g, chunk_size=chunk_size)
    else:
        g(torch.stack([net(x) for x in xs])).backward()
    return [p.grad.clone() for p in net.parameters()]


def peak(fn):
    with StorageCounter() as counter:
        result = fn()
    return result, counter.peak


def run(log=print):
    rows = []
    torch.manual_seed(0)
    for depth in (4, 16):
        weights = [(torch.randn(64, 64) / 8).requires_grad_() for _ in range(depth)]
        x = torch.randn(256, 64)
        ours, p_ours = peak(lambda: penalties_step(weights, x, True))
        naive, p_naive = peak(lambda: penalties_step(weights, x, False))
        rows.append({"tool": "EagerPenalties", "setting": f"{depth} layers, batch 256, width 64, a pairwise penalty per layer",
                     "peak_bytes": p_ours, "naive_peak_bytes": p_naive, "ratio": p_ours / p_naive,
                     "max_rel_error": max_relative_error(ours, naive)})
        log(f"EagerPenalties, depth {depth}: {p_ours / 2**20:.2f} MiB vs naive {p_naive / 2**20:.2f} MiB")
    net = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Dropout(0.1)) for _ in range(8)],
                        nn.Linear(128, 4)).train()
    for n, chunk in ((32, 1), (32, 8), (128, 1)):
        xs = [torch.randn(64, 128) for _ in range(n)]
        torch.manual_seed(1)
        ours, p_ours = peak(lambda: cached_step(net, xs, True, chunk))
        torch.manual_seed(1)
        naive, p_naive = peak(lambda: cached_step(net, xs, False, chunk))
        rows.append({"tool": "cached_backward", "setting": f"{n} inputs of batch 64, chunk {chunk}, 8-layer MLP with dropout",
                     "peak_bytes": p_ours, "naive_peak_bytes": p_naive, "ratio": p_ours / p_naive,
                     "max_rel_error": max_relative_error(ours, naive)})
        log(f"cached_backward, {n} inputs, chunk {chunk}: {p_ours / 2**20:.2f} MiB vs naive {p_naive / 2**20:.2f} MiB")
    return rows


def markdown(rows):
    lines = ["| tool | setting | peak | naive peak | ratio | max rel error of gradients |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tool']} | {r['setting']} | {r['peak_bytes'] / 2**20:.2f} MiB | "
                     f"{r['naive_peak_bytes'] / 2**20:.2f} MiB | {r['ratio']:.2f} | {r['max_rel_error']:.1e} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    args = parser.parse_args(argv)
    rows = run(log=lambda m: print(m, flush=True))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "neighbours_cpu.json").write_text(json.dumps(rows, indent=2))
    table = markdown(rows)
    (args.out / "neighbours_cpu.md").write_text(table + "\n")
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
