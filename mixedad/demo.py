"""The demo behind ``make demo`` / ``python -m mixedad demo``.

Builds a deep random-weight generator, runs :func:`mixedad.mixed_grad` and the
double-backward reference on the same inputs, and prints their agreement, peak memory and
time side by side.
"""
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, TextIO, Tuple, Union

import torch

import mixedad
from mixedad import zoo
from mixedad.profiling import peak_memory, median_time
from mixedad.reference import double_backward_mixed_grad, finite_difference_mixed_directional
from mixedad.testing import max_relative_error

__all__ = ["run_demo", "build_problem", "objective", "format_table"]


def objective(y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The demo's cheap objective, f(y, g) = sum((y + g)^3) + sum(sin(y) g)."""
    return ((y + g) ** 3).sum() + (torch.sin(y) * g).sum()


def build_problem(model: str, depth: int, width: int, batch: int, dtype: torch.dtype,
                  device: Union[str, torch.device],
                  seed: int = 0) -> Tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A zoo generator and inputs (G, z, y, v) for the demo and its tests."""
    if model == "mlp":
        G = zoo.mlp(depth, width, seed=seed, dtype=dtype, device=device)
    elif model == "dcgan":
        G = zoo.dcgan(latent_dim=width, channels=8, extra_blocks=depth, seed=seed, dtype=dtype, device=device)
    else:
        raise ValueError(f"demo: expected model 'mlp' or 'dcgan', got {model!r}.")
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(zoo.latent_shape(G, batch), generator=gen, dtype=dtype).to(device)
    with torch.no_grad():
        g_shape = G(z).shape
    y = torch.randn(g_shape, generator=gen, dtype=dtype).to(device)
    v = torch.randn(z.shape, generator=gen, dtype=dtype).to(device)
    return G, z, y, v


def _log(msg, out):
    print(msg, file=out, flush=True)


def run_demo(*, model: str = "mlp", depth: int = 64, width: int = 512, batch: int = 256,
             dtype: torch.dtype = torch.float64, device: Union[str, torch.device] = "cpu", repeats: int = 3,
             out: Optional[TextIO] = None) -> List[Dict[str, Any]]:
    """Run the comparison and print the table (to ``out``, standard output by default). Returns the rows."""
    out = sys.stdout if out is None else out  # looked up per call: stdout may be redirected after import
    started = time.perf_counter()
    _log(f"mixedad {mixedad.__version__} demo: mixed_grad vs double backward through a frozen "
         f"{model} generator (depth {depth}, width {width}, batch {batch}, {dtype}, {device})", out)
    G, z, y, v = build_problem(model, depth, width, batch, dtype, device)
    n_params = sum(p.numel() for p in G.parameters())
    _log(f"[1/3] built G with {n_params:,} random-weight parameters "
         f"({time.perf_counter() - started:.1f}s)", out)

    methods = {"mixedad.mixed_grad": mixedad.mixed_grad, "double backward (reference)": double_backward_mixed_grad}
    args = (objective, G, z, y, v)
    results, peaks, times = {}, {}, {}
    for name, fn in methods.items():
        results[name], peaks[name] = peak_memory(fn, *args)
    _log(f"[2/3] ran both and measured peak memory ({time.perf_counter() - started:.1f}s)", out)
    for name, fn in methods.items():
        times[name] = median_time(lambda: fn(*args), repeats=repeats, warmup=1)
    _log(f"[3/3] timed both, median of {repeats} ({time.perf_counter() - started:.1f}s)", out)

    # An autograd-free check: <w, result> against one mixed second difference of f(y, G(z)).
    # Finite differences need float64 and a smooth G (the DCGAN's ReLU kinks break them).
    fd = None
    if dtype == torch.float64 and model == "mlp":
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=dtype).to(device)
        fd = finite_difference_mixed_directional(objective, G, z, y, v, w=w)

    ref_name = "double backward (reference)"
    rows = []
    for name in methods:
        rows.append({
            "method": name,
            "max_rel_error": max_relative_error(results[name], results[ref_name]),
            "fd_rel_error": None if fd is None else abs((w * results[name]).sum().item() - fd) / abs(fd),
            "peak_bytes": peaks[name],
            "seconds": times[name],
            "peak_ratio": peaks[name] / peaks[ref_name],
            "time_ratio": times[name] / times[ref_name],
        })
    _log("", out)
    _log(format_table(rows), out)
    _log("", out)
    _log("max rel error: against double backward. fd check: relative error of <w, result> against a "
         "central finite difference of f(y, G(z)) with no autograd (float64 tanh MLP only), for a random w. "
         "ratios: method / double backward.", out)
    return rows


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table of the demo's rows."""
    lines = [
        "| method | max rel error | fd check | peak memory | time | peak ratio | time ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fd = "n/a" if r["fd_rel_error"] is None else f"{r['fd_rel_error']:.1e}"
        lines.append(
            f"| {r['method']} | {r['max_rel_error']:.1e} | {fd} | {r['peak_bytes'] / 2**20:.2f} MiB | "
            f"{r['seconds'] * 1e3:.1f} ms | {r['peak_ratio']:.3f} | {r['time_ratio']:.2f} |"
        )
    return "\n".join(lines)
