"""Side-by-side profiling of mixed_grad and its alternatives: what ``python -m mixedad profile`` runs.

For each model and depth, every strategy runs on the same inputs in the same process:

- ``mixed_grad``: :func:`mixedad.mixed_grad`;
- ``double_backward``: :func:`mixedad.reference.double_backward_mixed_grad` (create_graph through G);
- ``func_grad_of_grad``: ``torch.func.grad`` of ``torch.func.grad`` (reverse over reverse);
- ``forward_ad_recipe``: the forum thread's recipe (``torch.autograd.forward_ad`` through a frozen G,
  then ``autograd.grad`` twice through f), without mixedad's fast layer rules;
- ``plain_forward``: ``G(z)`` under ``torch.no_grad()``, the yardstick;
- ``mixed_grad_no_onednn`` (not in the default set): mixed_grad under
  ``torch.backends.mkldnn.flags(enabled=False)``. On the MLP this isolates mixedad's oneDNN
  tangent kernel for float32 ``Linear`` layers (see :mod:`mixedad.op_rules._frozen_layers`): every matrix
  product then runs on the same BLAS as the other strategies. On convolutional models it also
  moves PyTorch's own convolutions off oneDNN, so it is meaningless there;
- ``mixed_grad_no_local_rule`` (not in the default set): mixed_grad without the local double-VJP
  rule and the written formulas of :mod:`mixedad.op_rules`, as mixedad was before them: an op that
  forward mode cannot take (a custom Function without ``jvp``, ``torch.cdist``) sends all of G
  to the whole-G fallback. Its warning is silenced here; the point is its memory;
- ``mixed_grad_math_attention`` (not in the default set): mixed_grad without the attention rule,
  pushing tangents through PyTorch's math SDPA backend, which holds the T x T scores, as mixedad
  did before the rule.

Time is the median over repeats (CUDA events on a GPU), with the strategies timed round-robin
so that each median sees the same machine and Python's garbage collector paused while timing; peak memory is the CUDA allocator's peak or, on CPU,
the exact storage byte count of :mod:`mixedad.profiling`. Ratios are taken within one run,
because absolute times on a shared machine are noise.
"""
import argparse
import contextlib
import gc
import json
import os
import pathlib
import statistics
import sys
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TextIO, Tuple, Union

import torch
from torch.autograd import forward_ad

from mixedad import zoo
from mixedad._version import __version__
from mixedad.mixed import mixed_grad
from mixedad.profiling import cpu_peak_memory, cuda_peak_memory, median_time
from mixedad.reference import double_backward_mixed_grad
from mixedad.testing import max_relative_error

__all__ = ["profile", "markdown", "write", "write_table", "script_arguments", "interleaved_times", "interleaved_ratios", "STRATEGIES",
           "DEFAULT_STRATEGIES", "MODELS"]


def frozen_linear_tangent_kernel() -> Optional[Callable[..., torch.Tensor]]:
    """The kernel the frozen-layer rule uses for a float32 ``F.linear`` tangent on the CPU, or None.

    oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``) where this build has it and it
    computes ``F.linear``; None otherwise (the tangent then takes ``F.linear``). For
    ``benchmarks/linear_kernels.py``, which times it against ``F.linear``.
    """
    from mixedad._hooks.onednn import onednn_linear_op

    return onednn_linear_op()


def objective(y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The benchmark's cheap f(y, g) = sum((y + g)^3), as in the design notes."""
    return ((y + g) ** 3).sum()


def _func_grad_of_grad(f, G, z, y, v):
    def contracted(y_):
        return (torch.func.grad(lambda z_: f(y_, G(z_)))(z) * v).sum()

    return torch.func.grad(contracted)(y)


def _forward_ad_recipe(f, G, z, y, v):
    with torch.no_grad(), forward_ad.dual_level():  # the thread's advice: a frozen G
        g, g_tangent = forward_ad.unpack_dual(G(forward_ad.make_dual(z, v)))
    g = g.detach().requires_grad_()
    y = y.detach().requires_grad_()
    df_dg, _ = torch.autograd.grad(f(y, g), (g, y), create_graph=True)
    (result,) = torch.autograd.grad(df_dg, y, grad_outputs=g_tangent)
    return result


def _plain_forward(f, G, z, y, v):
    with torch.no_grad():
        return G(z)


@contextlib.contextmanager
def _onednn_off():
    with warnings.catch_warnings():
        # torch warns about oneDNN TF32 on Intel GPUs whenever the flags are set; irrelevant here.
        warnings.filterwarnings("ignore", "TF32 acceleration on top of oneDNN", UserWarning)
        with torch.backends.mkldnn.flags(enabled=False):
            yield


def _mixed_grad_no_onednn(f, G, z, y, v):
    with _onednn_off():
        return mixed_grad(f, G, z, y, v)


def _mixed_grad_no_local_rule(f, G, z, y, v):
    from mixedad.op_rules import Path, skipping

    with skipping(Path.LOCAL, Path.FORMULA), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "mixedad: ", RuntimeWarning)
        return mixed_grad(f, G, z, y, v)


def _mixed_grad_math_attention(f, G, z, y, v):
    from mixedad.op_rules import Path, skipping

    with skipping(Path.ATTENTION):
        return mixed_grad(f, G, z, y, v)


STRATEGIES: Dict[str, Callable[..., Any]] = {
    "mixed_grad": mixed_grad,
    "double_backward": double_backward_mixed_grad,
    "func_grad_of_grad": _func_grad_of_grad,
    "forward_ad_recipe": _forward_ad_recipe,
    "plain_forward": _plain_forward,
    "mixed_grad_no_onednn": _mixed_grad_no_onednn,
    "mixed_grad_no_local_rule": _mixed_grad_no_local_rule,
    "mixed_grad_math_attention": _mixed_grad_math_attention,
}
#: what ``profile`` runs when no strategies are named
DEFAULT_STRATEGIES: Tuple[str, ...] = ("mixed_grad", "double_backward", "func_grad_of_grad", "forward_ad_recipe",
                                       "plain_forward")

#: model name -> (builder(depth, width, dtype, device), what depth means, batch shape of z)
MODELS: Dict[str, Tuple[Callable[..., torch.nn.Module], str]] = {
    "mlp": (lambda d, w, **kw: zoo.mlp(d, w, **kw), "Linear layers"),
    "dcgan": (lambda d, w, **kw: zoo.dcgan(latent_dim=100, channels=w, image_size=32, extra_blocks=d, **kw),
              "extra 3x3 conv blocks per scale"),
    "resnet": (lambda d, w, **kw: zoo.resnet(latent_dim=100, channels=w, image_size=32, blocks_per_stage=d, **kw),
               "residual blocks per scale"),
    "transformer": (lambda d, w, **kw: zoo.transformer(latent_dim=64, d_model=w, layers=d, tokens=16, **kw),
                    "transformer layers"),
    "stylegan2_ada": (lambda d, w, **kw: zoo.stylegan2_ada(latent_dim=64, w_dim=64, channels=w, image_size=32,
                                                           extra_layers=d, **kw),
                      "extra synthesis layers at 32x32 (custom Functions without jvp)"),
    "vq_decoder": (lambda d, w, **kw: zoo.vq_decoder(latent_dim=64, code_dim=16, codebook_size=256, grid=8,
                                                     channels=w, blocks=d, groups=8, image_size=32, **kw),
                   "residual blocks (cdist quantiser, GroupNorm)"),
}


def build(model: str, depth: int, width: int, batch: int, dtype: torch.dtype, device: Union[str, torch.device],
          seed: int = 0) -> Tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(G, z, y, v) for one benchmark point."""
    G = MODELS[model][0](depth, width, seed=seed, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(zoo.latent_shape(G, batch), generator=gen, dtype=dtype).to(device)
    with torch.no_grad():
        y = torch.randn(G(z).shape, generator=gen, dtype=dtype).to(device)
    v = torch.randn(z.shape, generator=gen, dtype=dtype).to(device)
    return G, z, y, v


def _cuda_median_time(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def peak(fn: Callable[[], Any], device: Union[str, torch.device]) -> Tuple[Any, int]:
    """(result, peak bytes) of ``fn()``: the CUDA allocator's peak, or the exact CPU count."""
    if torch.device(device).type == "cuda":
        return cuda_peak_memory(fn, device=device)
    return cpu_peak_memory(fn)


def _round_robin(fns, device, repeats):
    """Seconds of each of ``fns`` per round, timed round-robin so all see the same machine."""
    timer = (lambda fn: _cuda_median_time(fn, 1)) if torch.device(device).type == "cuda" else \
        (lambda fn: median_time(fn, repeats=1, warmup=0))
    for fn in fns.values():
        for _ in range(2):  # warm-up: mixedad's default writes G's tangent program and checks it on a second call
            fn()
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            for name, fn in fns.items():
                samples[name].append(timer(fn))
    finally:
        if collecting:
            gc.enable()
    return samples


def interleaved_times(fns: Mapping[str, Callable[[], Any]], device: Union[str, torch.device],
                      repeats: int) -> Dict[str, float]:
    r"""Median seconds of each of ``fns`` (a dict), timed round-robin so all see the same machine.

    .. math::

        t_s = \operatorname{median}_i t_s^{(i)}

    with round :math:`i` calling every function once, after one warm-up call each, the garbage
    collector paused.

    Example:
        >>> from mixedad.benchmark import interleaved_times
        >>> times = interleaved_times({"a": lambda: sum(range(100)), "b": lambda: None}, "cpu", repeats=3)
        >>> sorted(times), all(t >= 0 for t in times.values())
        (['a', 'b'], True)
    """
    samples = _round_robin(fns, device, repeats)
    return {name: statistics.median(times) for name, times in samples.items()}


def interleaved_ratios(fns: Mapping[str, Callable[[], Any]], base: str, device: Union[str, torch.device],
                       repeats: int) -> Tuple[Dict[str, float], Dict[str, float]]:
    r"""Median time of each of ``fns`` over ``fns[base]``'s, ratio by ratio, round-robin.

    .. math::

        r_s = \operatorname{median}_i \frac{t_s^{(i)}}{t_{\mathrm{base}}^{(i)}}

    Each ratio is taken within one round, so a machine that slows down for a while (shared
    cores) slows numerator and denominator alike. Returns ``(ratios, median seconds)``.

    Example:
        >>> from mixedad.benchmark import interleaved_ratios
        >>> ratios, seconds = interleaved_ratios({"base": lambda: None, "x": lambda: sum(range(100))}, "base",
        ...                                      "cpu", repeats=3)
        >>> ratios["base"], sorted(seconds)
        (1.0, ['base', 'x'])
    """
    if base not in fns:
        raise ValueError(f"interleaved_ratios: expected base among {sorted(fns)}, got {base!r}.")
    samples = _round_robin(fns, device, repeats)
    ratios = {name: statistics.median(t / b for t, b in zip(times, samples[base])) for name, times in samples.items()}
    return ratios, {name: statistics.median(times) for name, times in samples.items()}


def profile(model: str, depths: Sequence[int], *, width: int, batch: int, dtype: torch.dtype = torch.float32,
            device: Union[str, torch.device] = "cpu", strategies: Optional[Sequence[str]] = None,
            repeats: int = 5, trace_dir: Union[str, os.PathLike[str], None] = None,
            stream: Optional[TextIO] = None) -> List[Dict[str, Any]]:
    r"""Run every strategy at every depth, side by side; returns one row dict per (depth, strategy).

    .. math::

        \mathrm{time\_vs\_}b = \frac{\mathrm{median\ time}(s)}{\mathrm{median\ time}(b)}, \qquad
        \mathrm{peak\_vs\_}b = \frac{\mathrm{peak}(s)}{\mathrm{peak}(b)}, \qquad
        b \in \{\mathrm{plain\_forward}, \mathrm{double\_backward}\}

    Each row also holds ``max_rel_error`` against double backward. Progress goes to ``stream``,
    stderr by default: a tqdm bar (rate and time left) where tqdm is installed (``pip install
    mixedad[bench]``), else a line per run.

    Example:
        >>> import io
        >>> from mixedad import benchmark
        >>> rows = benchmark.profile("mlp", [2], width=4, batch=2, repeats=1, stream=io.StringIO(),
        ...                          strategies=["mixed_grad", "double_backward"])
        >>> [r["strategy"] for r in rows], rows[0]["max_rel_error"] < 1e-5
        (['mixed_grad', 'double_backward'], True)
    """
    if model not in MODELS:
        raise ValueError(f"profile: expected model in {sorted(MODELS)}, got {model!r}.")
    strategies = list(DEFAULT_STRATEGIES if strategies is None else strategies)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"profile: expected strategies from {sorted(STRATEGIES)}, got {unknown}.")
    progress = _progress(len(depths) * len(strategies), sys.stderr if stream is None else stream, f"profile {model}")
    rows = []
    for depth in depths:
        G, z, y, v = build(model, depth, width, batch, dtype, device)
        fns = {name: (lambda name=name: STRATEGIES[name](objective, G, z, y, v)) for name in strategies}
        results, peaks = {}, {}
        for name, fn in fns.items():
            results[name], peaks[name] = peak(fn, device)
            if trace_dir is not None and depth == max(depths):
                _trace(fn, device, pathlib.Path(trace_dir) / f"trace_{model}_{name}_{torch.device(device).type}.json")
        seconds = interleaved_times(fns, device, repeats)
        point = []
        for name in strategies:
            point.append({"model": model, "depth": depth, "strategy": name, "seconds": seconds[name],
                          "peak_bytes": peaks[name], "width": width, "batch": batch, "dtype": str(dtype),
                          "device": str(device)})
            progress.set_postfix_str(f"depth {depth} {name}: {seconds[name] * 1e3:.2f} ms, "
                                     f"{peaks[name] / 2**20:.2f} MiB")
            progress.update(1)
        _ratios(point, results)
        rows += point
    progress.close()
    return rows


def _progress(total, stream, desc):
    """A progress bar of ``total`` runs on ``stream``: tqdm's console bar where tqdm is installed (tqdm.auto would
    want ipywidgets inside notebooks), else :class:`_Lines`."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Lines(total, stream, desc)
    return tqdm(total=total, file=stream, desc=desc, unit="run", leave=True)


class _Lines:
    """The part of tqdm's interface :func:`profile` uses, written as one line per finished run."""

    def __init__(self, total, stream, desc):
        self.total, self.stream, self.desc, self.done, self.postfix = total, stream, desc, 0, ""

    def set_postfix_str(self, text):
        self.postfix = text

    def update(self, n=1):
        self.done += n
        print(f"{self.desc}: {self.done}/{self.total} {self.postfix}", file=self.stream, flush=True)

    def close(self):
        pass


def _ratios(point, results):
    by = {r["strategy"]: r for r in point}
    for r in point:
        for base in ("plain_forward", "double_backward"):
            if base in by:
                r[f"time_vs_{base}"] = r["seconds"] / by[base]["seconds"]
                r[f"peak_vs_{base}"] = r["peak_bytes"] / max(by[base]["peak_bytes"], 1)
        if "double_backward" in results and r["strategy"] != "plain_forward":
            r["max_rel_error"] = max_relative_error(results[r["strategy"]], results["double_backward"])


def _trace(fn, device, path):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))


def markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    r"""A markdown table of :func:`profile`'s rows, one line per row with its ratios.

    .. math::

        \text{one line per (model, depth, strategy)}

    Example:
        >>> from mixedad import benchmark
        >>> benchmark.markdown([]).splitlines()[0].startswith("| model | depth | strategy |")
        True
    """
    lines = ["| model | depth | strategy | time | peak memory | time / plain forward | peak / plain forward "
             "| time / double backward | peak / double backward | max rel error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def ratio(key):
            return f"{r[key]:.2f}" if key in r else ""
        err = f"{r['max_rel_error']:.1e}" if "max_rel_error" in r else ""
        lines.append(f"| {r['model']} | {r['depth']} | {r['strategy']} | {r['seconds'] * 1e3:.1f} ms | "
                     f"{r['peak_bytes'] / 2**20:.2f} MiB | {ratio('time_vs_plain_forward')} | "
                     f"{ratio('peak_vs_plain_forward')} | {ratio('time_vs_double_backward')} | "
                     f"{ratio('peak_vs_double_backward')} | {err} |")
    return "\n".join(lines)


def plot(rows: Sequence[Mapping[str, Any]], path: pathlib.Path, title: str) -> None:
    """Peak memory and time against depth, one line per strategy, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(r["strategy"] for r in rows):
        mine = sorted((r for r in rows if r["strategy"] == name), key=lambda r: r["depth"])
        depths = [r["depth"] for r in mine]
        style = dict(marker="o", linewidth=2.5 if name == "mixed_grad" else 1.2, label=name)
        axes[0].plot(depths, [r["peak_bytes"] / 2**20 for r in mine], **style)
        axes[1].plot(depths, [r["seconds"] * 1e3 for r in mine], **style)
    for ax, label in zip(axes, ["peak memory (MiB)", "median time (ms)"]):
        ax.set_xlabel(f"depth ({MODELS[rows[0]['model']][1]})")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rows: Sequence[Mapping[str, Any]], out_dir: Union[str, os.PathLike[str]], stem: str,
          title: str) -> List[pathlib.Path]:
    r"""Write ``stem``.json, .md and .png into out_dir; returns the three paths.

    .. math::

        \mathrm{rows} \mapsto (\texttt{stem.json}, \texttt{stem.md}, \texttt{stem.png})

    Example:
        >>> import io, tempfile
        >>> from mixedad import benchmark
        >>> rows = benchmark.profile("mlp", [1, 2], width=4, batch=2, repeats=1, stream=io.StringIO())
        >>> [p.suffix for p in benchmark.write(rows, tempfile.mkdtemp(), "mlp_cpu", "demo")]
        ['.json', '.md', '.png']
    """
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "mixedad": __version__, "threads": torch.get_num_threads()}
    paths = [out_dir / f"{stem}.{ext}" for ext in ("json", "md", "png")]
    paths[0].write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    paths[1].write_text(f"{title}\n\n{markdown(rows)}\n")
    plot(rows, paths[2], title)
    return paths


def write_table(out_dir: Union[str, os.PathLike[str]], stem: str, meta: Any, rows: Any, table: str) -> List[pathlib.Path]:
    r"""Write a benchmark script's results: ``stem``.json (``meta`` and ``rows``) and ``stem``.md (``table``), into
    out_dir (made if missing); print the table and return the two paths.

    .. math::

        (\mathrm{meta}, \mathrm{rows}, \mathrm{table}) \mapsto (\texttt{stem.json}, \texttt{stem.md})

    Example:
        >>> import tempfile
        >>> from mixedad.benchmark import write_table
        >>> paths = write_table(tempfile.mkdtemp(), "demo_cpu", "1 run", [{"x": 1}], "| x |\n|---|\n| 1 |")
        | x |
        |---|
        | 1 |
        >>> [p.name for p in paths]
        ['demo_cpu.json', 'demo_cpu.md']
    """
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    paths[0].write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    paths[1].write_text(table + "\n")
    print(table)
    return paths


def script_arguments(script: str, doc: Optional[str], *, repeats: int, quick: str) -> argparse.ArgumentParser:
    r"""The arguments every benchmark script takes: ``--out``, ``--repeats`` and ``--quick``.

    .. math::

        \mathtt{--out} = \mathrm{dirname}(\mathtt{script}) / \mathtt{results} \quad\text{by default}

    The script adds its own arguments to the parser returned.

    Args:
        script: the script's ``__file__``.
        doc: its module docstring; its first line describes the parser.
        repeats: the default number of timed repeats.
        quick: what ``--quick`` does, for ``--help``.

    Example:
        >>> from mixedad.benchmark import script_arguments
        >>> args = script_arguments("benchmarks/x.py", "A benchmark.", repeats=3, quick="tiny").parse_args(["--quick"])
        >>> args.repeats, args.quick, args.out.name
        (3, True, 'results')
    """
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0] if doc else None)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(script).resolve().parent / "results")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--quick", action="store_true", help=quick)
    return parser
