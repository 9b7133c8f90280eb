"""Benchmark: mixedad against JAX's jit on the DCGAN, side by side in one process (optional: needs JAX).

The same generator as ``tangent_speed.py`` (4 extra conv blocks per scale, 32 channels, batch 32,
float32, eval and train mode), written once more in JAX from the torch module's own weights
(``jax.lax.conv_general_dilated``; a transposed convolution as the convolution of the input dilated
by the stride with the flipped kernel). Each ratio is time over G's plain eager forward in PyTorch,
the median over round-robin repeats of the ratio within one round:

- ``mixed_grad`` and ``mixed_grad compiled``: mixedad, as in ``tangent_speed.py``;
- ``JAX jit forward``: ``jax.jit(G)``;
- ``JAX jit jvp``: ``jax.jit`` of ``jax.jvp(G, (z,), (v,))``, the tangent alone (what the issue that asked
  for ``compile=True`` compared with: 1.96x);
- ``JAX jit mixed``: ``jax.jit`` of the whole mixed derivative, :math:`\\partial_y \\langle \\nabla_g f(y, g),
  \\dot g\\rangle` with ``(g, ġ) = jvp(G, z, v)``: what ``mixed_grad`` computes.

JAX runs in the layout that is faster on this machine (NCHW or NHWC, both timed on the first
round; the table says which). Its numbers are checked against mixedad's: the relative difference
(2-norm) of G(z) from PyTorch's, and the larger of the mixed derivative's from ``mixed_grad``'s and
``mixed_grad(compile=True)``'s later calls (the routes timed), are reported beside the times. Without JAX
(``pip install jax``) the script says so and exits 0; nothing in mixedad needs it.

Writes benchmarks/results/jax_compare_cpu.{json,md}.

    python benchmarks/jax_compare.py [--out DIR] [--repeats N] [--quick]
"""
import platform
import sys
import time

import numpy as np
import torch
from torch import nn

import mixedad
from mixedad.benchmark import build, interleaved_ratios, objective, script_arguments, write_table


def jax_generator(G, layout):
    """``(params, apply)``: G (an nn.Sequential of Unflatten, (transposed) 2-d convolutions, BatchNorm2d, ReLU and
    Tanh) as a JAX function ``apply(params, z)``, in ``layout`` ("NCHW" or "NHWC"), with G's weights and modes."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def array(t):
        return None if t is None else jnp.asarray(t.detach().numpy())

    channel_axis = 1 if layout == "NCHW" else 3
    numbers = (layout, "OIHW", layout)
    params, steps = [], []
    for m in G:
        if isinstance(m, nn.Unflatten):
            steps.append(("unflatten", tuple(m.unflattened_size)))
            params.append(None)
        elif isinstance(m, nn.ConvTranspose2d):
            if m.groups != 1 or m.dilation != (1, 1) or m.padding_mode != "zeros":
                raise TypeError("jax_compare: transposed convolutions of one group, no dilation, zero padding")
            kernel = torch.flip(m.weight, (2, 3)).transpose(0, 1)  # (Cout, Cin, kh, kw), flipped
            padding = [(k - 1 - p, k - 1 - p + o) for k, p, o in zip(m.kernel_size, m.padding, m.output_padding)]
            steps.append(("conv", dict(window_strides=(1, 1), padding=padding, lhs_dilation=m.stride)))
            params.append((array(kernel), array(m.bias)))
        elif isinstance(m, nn.Conv2d):
            if m.groups != 1 or m.dilation != (1, 1) or isinstance(m.padding, str) or m.padding_mode != "zeros":
                raise TypeError("jax_compare: convolutions of one group, no dilation, numeric zero padding")
            steps.append(("conv", dict(window_strides=m.stride, padding=[(p, p) for p in m.padding])))
            params.append((array(m.weight), array(m.bias)))
        elif isinstance(m, nn.BatchNorm2d):
            steps.append(("batch_norm", m.training or m.running_var is None))  # the batch's own statistics
            params.append(tuple(array(t) for t in (m.weight, m.bias, m.running_mean, m.running_var)) + (m.eps,))
        elif isinstance(m, nn.ReLU):
            steps.append(("relu", None))
            params.append(None)
        elif isinstance(m, nn.Tanh):
            steps.append(("tanh", None))
            params.append(None)
        else:
            raise TypeError(f"jax_compare: no JAX layer for {type(m).__name__}")

    def channel(x):  # a per-channel vector, broadcast against activations in this layout
        shape = [1, 1, 1, 1]
        shape[channel_axis] = -1
        return x.reshape(shape)

    def apply(params, z):
        x = z
        for (kind, spec), p in zip(steps, params):
            if kind == "unflatten":
                x = x.reshape(x.shape[0], *spec)
                if layout == "NHWC":
                    x = x.transpose(0, 2, 3, 1)
            elif kind == "conv":
                weight, bias = p
                x = lax.conv_general_dilated(x, weight, dimension_numbers=numbers, **spec)
                if bias is not None:
                    x = x + channel(bias)
            elif kind == "batch_norm":
                weight, bias, mean, var, eps = p
                if spec:  # the batch's own statistics
                    axes = tuple(a for a in range(4) if a != channel_axis)
                    mean, var = x.mean(axes), x.var(axes)
                x = (x - channel(mean)) / channel(jnp.sqrt(var + eps))
                if weight is not None:
                    x = x * channel(weight)
                if bias is not None:
                    x = x + channel(bias)
            elif kind == "relu":
                x = jax.nn.relu(x)  # tangent 0 at 0, as torch's
            else:
                x = jnp.tanh(x)
        return x.transpose(0, 3, 1, 2) if layout == "NHWC" else x

    return params, apply


def jax_functions(G, z, y, v, layout):
    """name -> a function of no arguments that runs one jitted JAX computation to the end (block_until_ready)."""
    import jax
    import jax.numpy as jnp

    params, apply = jax_generator(G, layout)
    zj, yj, vj = (jnp.asarray(t.numpy()) for t in (z, y, v))

    def f(y_, g):
        return jnp.sum((y_ + g) ** 3)  # mixedad.benchmark.objective

    forward = jax.jit(apply)
    tangent = jax.jit(lambda p, z_, v_: jax.jvp(lambda x: apply(p, x), (z_,), (v_,)))

    def mixed(p, z_, y_, v_):
        g, g_dot = jax.jvp(lambda x: apply(p, x), (z_,), (v_,))
        return jax.grad(lambda yy: jnp.vdot(jax.grad(f, argnums=1)(yy, g), g_dot))(y_)

    mixed = jax.jit(mixed)
    return {"JAX jit forward": lambda: forward(params, zj).block_until_ready(),
            "JAX jit jvp": lambda: jax.block_until_ready(tangent(params, zj, vj)),
            "JAX jit mixed": lambda: mixed(params, zj, yj, vj).block_until_ready()}


def _relative(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def point(name, G, z, y, v, repeats):
    """One generator's row: times over the plain eager forward, compile times, JAX's layout and differences."""
    fns = {"plain_forward": lambda: torch.no_grad()(G)(z),
           "mixed_grad": lambda: mixedad.mixed_grad(objective, G, z, y, v)}
    for _ in range(2):  # the default's program: written and checked on the second call
        fns["mixed_grad"]()
    start = time.perf_counter()
    mixedad.mixed_grad(objective, G, z, y, v, compile=True)
    compile_seconds = time.perf_counter() - start
    fns["mixed_grad compiled"] = lambda: mixedad.mixed_grad(objective, G, z, y, v, compile=True)
    candidates = {}
    for layout in ("NCHW", "NHWC"):
        jax_fns = jax_functions(G, z, y, v, layout)
        start = time.perf_counter()
        for fn in jax_fns.values():
            fn()  # compiles
        candidates[layout] = (jax_fns, time.perf_counter() - start)
    seconds = interleaved_ratios({"plain_forward": fns["plain_forward"],
                                  **{layout: c[0]["JAX jit jvp"] for layout, c in candidates.items()}},
                                 "plain_forward", "cpu", max(3, repeats // 4))[1]
    layout = min(candidates, key=lambda k: seconds[k])
    jax_fns, jax_compile_seconds = candidates[layout]
    ratios, times = interleaved_ratios({**fns, **jax_fns}, "plain_forward", "cpu", repeats)
    with torch.no_grad():
        g = G(z)
    import jax.numpy as jnp
    params, apply = jax_generator(G, layout)
    g_jax = apply(params, jnp.asarray(z.numpy()))
    mixed_jax = jax_fns["JAX jit mixed"]()
    timed = [fns["mixed_grad"](), fns["mixed_grad compiled"]()]  # the routes timed (program; compiled program)
    return {"generator": name, "time_vs_plain": ratios, "seconds": times, "jax_layout": layout,
            "mixed_grad_compile_seconds": compile_seconds, "jax_compile_seconds": jax_compile_seconds,
            "difference": {"G(z)": _relative(g_jax, g.numpy()),
                           "mixed": max(_relative(mixed_jax, t.numpy()) for t in timed)}}


COLUMNS = ["mixed_grad", "mixed_grad compiled", "JAX jit forward", "JAX jit jvp", "JAX jit mixed"]


def markdown(rows, meta):
    lines = [f"Time over G's plain eager forward in PyTorch; {meta}.", "",
             "| generator | plain forward | " + " | ".join(COLUMNS) + " | JAX layout | JAX vs mixedad: G(z), mixed |",
             "|---|---|" + "---|" * len(COLUMNS) + "---|---|"]
    for row in rows:
        cells = [f"{row['time_vs_plain'][c]:.2f}x" for c in COLUMNS]
        diff = row["difference"]
        lines.append(f"| {row['generator']} | {row['seconds']['plain_forward'] * 1e3:.1f} ms | " + " | ".join(cells)
                     + f" | {row['jax_layout']} | {diff['G(z)']:.1e}, {diff['mixed']:.1e} |")
    lines += ["", "First calls: mixed_grad(compile=True) " + ", ".join(
        f"{r['generator']} {r['mixed_grad_compile_seconds']:.1f} s" for r in rows) + "; JAX's three jitted "
        "functions " + ", ".join(f"{r['generator']} {r['jax_compile_seconds']:.1f} s" for r in rows) + "."]
    return "\n".join(lines)


def main(argv=None):
    parser = script_arguments(__file__, __doc__, repeats=31, quick="tiny models: a smoke test of the pipeline")
    args = parser.parse_args(argv)
    try:
        import jax
    except ImportError:
        print("jax_compare: JAX is not installed (pip install jax); nothing to compare.")
        return 0
    jax.config.update("jax_default_matmul_precision", "highest")
    torch.manual_seed(0)
    meta = (f"float32, CPU (torch {torch.__version__}, JAX {jax.__version__}, {platform.machine()}, "
            f"{torch.get_num_threads()} torch threads); median of {args.repeats} round-robin ratios in one process")
    rows = []
    for mode in ("eval", "train"):
        G, z, y, v = build("dcgan", *((0, 4, 2) if args.quick else (4, 32, 32)), torch.float32, "cpu")
        G.train(mode == "train").requires_grad_(False)
        rows.append(point(f"dcgan ({mode})", G, z, y, v, args.repeats))
        print(f"jax_compare: dcgan ({mode}) done", file=sys.stderr, flush=True)
    write_table(args.out, "jax_compare_cpu", meta, rows, markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
