"""Write the notebooks in notebooks/ from the cell sources below, and optionally execute them.

    python scripts/build_notebooks.py            # write the .ipynb files (no outputs)
    python scripts/build_notebooks.py --execute  # write, then run each in place to store outputs

The sources live here, as plain Python strings, so that a change to a notebook is a readable diff.
`make test` executes every notebook (pytest --nbmake), and each one asserts its own claims.
"""
import argparse
import pathlib
import sys

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def md(text):
    return nbformat.v4.new_markdown_cell(text.strip())


def code(text):
    return nbformat.v4.new_code_cell(text.strip())


VERIFICATION = [
    md(r"""
# 01: verifying mixedad against double backward

mixedad computes the mixed derivative

$$\frac{\partial}{\partial y}\Big\langle v,\ \frac{\partial f(y, G(z))}{\partial z}\Big\rangle
  = \Big(\frac{\partial^2 f}{\partial g\,\partial y}\Big)^{\!\top} J_G(z)\, v$$

by pushing the tangent $v$ forward through $G$ and differentiating only $f$ twice. This
notebook checks it against two independent answers: double backward through $G$ (the naive
`create_graph=True` code) and central finite differences, which use no autograd at all.
"""),
    md("## The forum thread's own example\n\nThe snippet from the thread, with `mixedad.mixed_grad` in place of the hand-written forward-AD recipe."),
    code(r"""
import torch
import mixedad

def G(x):
    return x.sum(dim=1).exp()

def f(y, g_out):
    return ((y.sum(dim=1) + g_out) ** 3).sum()

z = torch.rand((3, 4))
y = torch.rand((3, 4), requires_grad=True)

dfdzdy1 = mixedad.mixed_grad(f, G, z, y)          # v defaults to ones, as in the thread

# Double backward, as in the thread
z2 = z.clone().detach().requires_grad_(True)
y2 = y.clone().detach().requires_grad_(True)
dfdz, = torch.autograd.grad(f(y2, G(z2)), inputs=(z2,), create_graph=True)
dfdzdy2, = torch.autograd.grad(dfdz, inputs=(y2,), grad_outputs=torch.ones_like(dfdz))

print(torch.allclose(dfdzdy1, dfdzdy2))  # True
assert torch.allclose(dfdzdy1, dfdzdy2)
"""),
    md(r"""
## Every generator in the zoo, in float64

For each random-weight generator in `mixedad.zoo` (MLP, DCGAN, ResNet with BatchNorm and with
InstanceNorm, StyleGAN-like with modulated convolutions, transformer decoders built from
`nn.TransformerEncoderLayer` and from `F.scaled_dot_product_attention`, a StyleGAN2-ADA-like
generator built from custom Functions without `jvp`, and a VQ decoder) we compare `mixed_grad`
with double backward and with finite differences, entry by entry, with a random tangent $v$ and a
cubic objective. The VQ decoder's straight-through estimator is a gradient by definition, so
finite differences do not apply to it.
"""),
    code(r"""
from mixedad import zoo
from mixedad.reference import double_backward_mixed_grad, finite_difference_mixed_grad
from mixedad.testing import max_relative_error

def objective(y, g):
    return ((y + g) ** 3).sum() + (torch.sin(y) * g ** 2).sum()

rows = []
for name, build in zoo.MEMBERS.items():
    G = build(dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(zoo.latent_shape(G, 2), generator=gen, dtype=torch.float64)
    with torch.no_grad():
        y = torch.randn(G(z).shape, generator=gen, dtype=torch.float64)
    v = torch.randn(z.shape, generator=gen, dtype=torch.float64)
    ours = mixedad.mixed_grad(objective, G, z, y, v)
    # The VQ decoder's straight-through estimator is a gradient by definition, not the derivative
    # of its (piecewise constant) quantiser: finite differences do not apply to it.
    fd = None if name == "vq_decoder" else max_relative_error(ours, finite_difference_mixed_grad(objective, G, z, y, v))
    rows.append((name, y.numel(), max_relative_error(ours, double_backward_mixed_grad(objective, G, z, y, v)), fd))

print(f"{'generator':<22}{'entries of y':>14}{'vs double backward':>22}{'vs finite differences':>24}")
for name, n, err_db, err_fd in rows:
    print(f"{name:<22}{n:>14}{err_db:>22.1e}{'n/a' if err_fd is None else f'{err_fd:.1e}':>24}")
"""),
    code(r"""
# The claims, asserted: agreement to float64 round-off with double backward, and to the
# finite-difference truncation error (eps = 1e-4, so O(1e-8)) with the autograd-free answer.
assert all(err_db <= 1e-9 for _, _, err_db, _ in rows)
assert all(err_fd is None or err_fd <= 1e-6 for _, _, _, err_fd in rows)
print("all generators verified")
"""),
]

MEMORY = [
    md(r"""
# 02: memory and time against depth

Double backward keeps G's activations and its backward graph alive, so its memory grows
linearly with G's depth. mixedad pushes a tangent forward through G and keeps one layer's
activations at a time, so its memory stays flat. Here both run side by side on MLPs of depth 2 to
64, together with a plain `no_grad` forward of G as the yardstick. Memory is the exact storage
byte count of `mixedad.profiling`, which is deterministic. Time is the median over repeats on
whatever machine runs this, so read it as ratios.
"""),
    code(r"""
import torch
from mixedad import benchmark

torch.manual_seed(0)
depths = [2, 4, 8, 16, 32, 64]
rows = benchmark.profile("mlp", depths, width=128, batch=64, repeats=3,
                         strategies=["mixed_grad", "double_backward", "plain_forward"])
print(benchmark.markdown(rows))
"""),
    code(r"""
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for name in ["mixed_grad", "double_backward", "plain_forward"]:
    mine = [r for r in rows if r["strategy"] == name]
    axes[0].plot(depths, [r["peak_bytes"] / 2**20 for r in mine], "o-", label=name)
    axes[1].plot(depths, [r["seconds"] * 1e3 for r in mine], "o-", label=name)
axes[0].set(xlabel="depth (Linear layers)", ylabel="peak memory (MiB)", yscale="log")
axes[1].set(xlabel="depth (Linear layers)", ylabel="median time (ms)", yscale="log")
axes[0].legend()
for ax in axes:
    ax.grid(alpha=0.3)
plt.tight_layout()
plt.show()
"""),
    code(r"""
peak = {name: [r["peak_bytes"] for r in rows if r["strategy"] == name] for name in ["mixed_grad", "double_backward"]}
# mixed_grad: flat in depth (within 10% from depth 2 to 64).
assert max(peak["mixed_grad"]) <= 1.10 * min(peak["mixed_grad"]), peak["mixed_grad"]
# double backward: grows with depth, and at depth 64 needs more than 10x mixed_grad's memory.
assert peak["double_backward"][-1] > 10 * peak["double_backward"][0]
assert peak["double_backward"][-1] > 10 * peak["mixed_grad"][-1]
# Both compute the same numbers.
assert all(r["max_rel_error"] < 1e-4 for r in rows if "max_rel_error" in r)
print(f"depth 64: mixed_grad {peak['mixed_grad'][-1] / 2**20:.2f} MiB, "
      f"double backward {peak['double_backward'][-1] / 2**20:.2f} MiB")
"""),
]

PIPELINE = [
    md(r"""
# 03: the thread's whole pipeline: learning a measurement matrix through a generative prior

The forum thread's problem: input gradients $\partial f / \partial z_i$ for many latent codes,
an outer objective $t = g(\partial f/\partial z_1, \ldots, \partial f/\partial z_N, x)$ that
couples them, and $dt/dy$. Here it appears as compressed sensing with a generative prior:

* a frozen generator $G$ (random weights from `mixedad.zoo`) is the prior: images are $x_i = G(z^\star_i)$;
* a measurement matrix $A$ (our $y$) observes $A x_i$;
* recovery takes one gradient step on the measurement misfit from a rough estimate $z^0_i$:
  $z^1_i = z^0_i - \eta\, \partial f/\partial z$ with $f(A, g) = \lVert A (g - x_i) \rVert^2$;
* the outer objective is the soft worst case over all codes of the latent error,
  $t = \tau \log \sum_i \exp(\lVert z^1_i - z^\star_i \rVert^2 / \tau)$. It couples every code,
  so the naive code must keep every code's double-backward graph through $G$ alive at once;
* we learn $A$ by gradient descent on $t$.

`mixedad.input_grad` gives $\partial f/\partial z$ as a tensor that autograd differentiates with
respect to $A$ without keeping $G$'s graph. $G$ receives the target images as a second input
(`G(z, x)` returns `(G(z), x)`), so that $f$ sees each chunk's targets.
"""),
    code(r"""
import torch
import mixedad
from mixedad import zoo
from mixedad.profiling import peak_memory
from mixedad.reference import double_backward_input_grad
from mixedad.testing import max_relative_error

LATENT, MEASUREMENTS, ETA, TAU = 16, 48, 0.05, 0.5
PIXELS = 3 * 16 * 16

def prior(dtype=torch.float32):
    return zoo.dcgan(latent_dim=LATENT, channels=16, image_size=16, extra_blocks=3, dtype=dtype)

def with_target(G):
    return lambda z, x: (G(z), x)

def misfit(y, gx):
    g, x = gx
    return (((g - x).flatten(1) @ y["A"].T) ** 2).sum()

def problem(G, n, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    z_true = torch.randn(n, LATENT, generator=gen, dtype=dtype)
    with torch.no_grad():
        x = G(z_true)
    z0 = z_true + 0.3 * torch.randn(n, LATENT, generator=gen, dtype=dtype)
    return z_true, x, z0

def outer_loss(input_grad, G, y, z_true, x, z0, chunk_size):
    dfdz, _ = input_grad(misfit, with_target(G), (z0, x), y, chunk_size=chunk_size)
    z1 = z0 - ETA * dfdz
    errors = ((z1 - z_true) ** 2).sum(1)
    return TAU * torch.logsumexp(errors / TAU, dim=0)

def gradient_in_A(input_grad, G, n, dtype, chunk_size, A0):
    y = {"A": A0.clone().requires_grad_()}
    z_true, x, z0 = problem(G, n, dtype)
    outer_loss(input_grad, G, y, z_true, x, z0, chunk_size).backward()
    return y["A"].grad

A0 = torch.randn(MEASUREMENTS, PIXELS, generator=torch.Generator().manual_seed(2)) / PIXELS ** 0.5
"""),
    md("## Verification against the naive code, at small N, in float64"),
    code(r"""
G64 = prior(torch.float64)
ours = gradient_in_A(mixedad.input_grad, G64, 8, torch.float64, 3, A0.double())
naive = gradient_in_A(double_backward_input_grad, G64, 8, torch.float64, 3, A0.double())
err = max_relative_error(ours, naive)
print(f"dt/dA: max relative error against the naive create_graph code: {err:.1e}")
assert err <= 1e-9 and naive.abs().max() > 1e-6
"""),
    md(r"""
## Large N under a memory budget

A budget of 64 MiB stands in for the GPU memory left over for this step. With N = 1024 codes
(chunks of 64), mixedad's whole step (forward and backward) stays within it. The naive code's
step does not: it keeps a double-backward graph through $G$ for every code. Both peaks are exact
byte counts, so this cell gives the same numbers on every machine.
"""),
    code(r"""
BUDGET = 64 * 2**20
N = 1024
G = prior()
_, peak_ours = peak_memory(gradient_in_A, mixedad.input_grad, G, N, torch.float32, 64, A0)
assert all(p.grad is None for p in G.parameters())  # mixedad never writes into the prior
_, peak_naive = peak_memory(gradient_in_A, double_backward_input_grad, G, N, torch.float32, 64, A0)
print(f"N = {N}: mixedad.input_grad {peak_ours / 2**20:.1f} MiB, naive create_graph {peak_naive / 2**20:.1f} MiB, "
      f"budget {BUDGET / 2**20:.0f} MiB")
assert peak_ours <= BUDGET < peak_naive
touched = sum(p.grad is not None for p in G.parameters())
print(f"the naive code also wrote .grad into {touched} of the prior's {len(list(G.parameters()))} parameters")
G.zero_grad(set_to_none=True)
"""),
    md("## Learning the measurement matrix"),
    code(r"""
torch.manual_seed(0)
y = {"A": A0.clone().requires_grad_()}
optimizer = torch.optim.Adam(y.values(), lr=0.002)
z_true, x, z0 = problem(G, 256, torch.float32, seed=3)
history = []
for step in range(25):
    optimizer.zero_grad()
    t = outer_loss(mixedad.input_grad, G, y, z_true, x, z0, chunk_size=64)
    t.backward()
    optimizer.step()
    history.append(t.item())
    if step % 5 == 0 or step == 24:
        print(f"step {step:>2}: soft worst-case latent error {t.item():.3f}")
assert history[-1] < 0.85 * history[0]
assert all(p.grad is None for p in G.parameters())  # the prior stayed frozen
"""),
]


def write(name, cells):
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    path = NOTEBOOKS / name
    nbformat.write(nb, path)
    return path


IMPLICIT = [
    md(r"""
# 04: learning through an inversion with implicit differentiation

Inverting a frozen generator is an optimisation: from measurements $b = A x + \varepsilon$ of a
signal $x = G(z)$,

$$z^*(\theta) = \arg\min_z\ \lVert A\,G(z) - b\rVert^2 + e^{\theta}\,\lVert z\rVert^2 .$$

To learn the regularisation weight $\theta$ from examples, we need $d\ell(z^*(\theta))/d\theta$ for
a loss $\ell$ on the reconstruction. Unrolling the inner optimiser keeps every step's graph
through $G$; implicit differentiation needs only the point $z^*$:

$$\frac{d\ell}{d\theta} = -\Big(\frac{\partial^2 L}{\partial z\,\partial\theta}\Big)^{\!\top}
  H_{zz}^{-1}\,\nabla_z \ell, \qquad L = f(y, G(z)).$$

`mixedad.implicit_argmin` returns $z^*$ attached to the autograd graph of $y = (b, \theta)$: the
mixed term is `mixed_grad` (flat in $G$'s depth) and the solve is conjugate gradients on
`mixedad.z_curvature`, one segment of $G$ at a time.
"""),
    code(r"""
import torch
import mixedad
from mixedad import zoo

torch.manual_seed(0)
F64 = torch.float64
G = zoo.mlp(4, 16, seed=0, dtype=F64)                 # a frozen generator with random weights
A = torch.randn(8, 16, dtype=F64) / 4                 # 8 measurements of a 16-dimensional signal
z_true = torch.randn(6, 16, dtype=F64)
with torch.no_grad():
    x_true = G(z_true)
    b = x_true @ A.T + 0.05 * torch.randn(6, 8, dtype=F64)

def prior_G(z):
    return G(z), z                                    # f sees the signal and the code

def f(y, g):
    signal, z = g
    return ((signal @ A.T - y["b"]) ** 2).sum() + y["log_alpha"].exp() * (z ** 2).sum()

def argmin(y, z0):
    # The inner solver: any optimiser, no graph kept. L-BFGS to a tight tolerance.
    z = z0.clone().requires_grad_()
    opt = torch.optim.LBFGS([z], max_iter=200, tolerance_grad=1e-10, tolerance_change=1e-14,
                            line_search_fn="strong_wolfe")
    def closure():
        opt.zero_grad()
        loss = f({k: v.detach() for k, v in y.items()}, prior_G(z))
        loss.backward()
        return loss
    for _ in range(3):
        opt.step(closure)
    return z.detach()
"""),
    md("## Learning the regularisation weight\n\nGradient steps on $\\theta$; each step solves the inner problem (warm-started) and differentiates through its solution with `implicit_argmin`."),
    code(r"""
theta = torch.tensor(2.0, dtype=F64, requires_grad=True)   # too strong a prior to start with
outer = torch.optim.Adam([theta], lr=0.2)
z_star = torch.zeros(6, 16, dtype=F64)
curve = []
for step in range(25):
    y = {"b": b, "log_alpha": theta}
    z_star = argmin(y, z_star)
    z = mixedad.implicit_argmin(f, prior_G, z_star, y, tol=1e-10)
    loss = ((G(z) - x_true) ** 2).mean()                 # reconstruction error of the inversion
    outer.zero_grad()
    loss.backward()
    outer.step()
    curve.append((theta.item(), loss.item()))
print(f"theta: 2.00 -> {curve[-1][0]:.2f}; reconstruction error {curve[0][1]:.4f} -> {curve[-1][1]:.4f}")
"""),
    code(r"""
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
axes[0].plot([c[1] for c in curve], "o-")
axes[0].set(xlabel="outer step", ylabel="reconstruction error", title="learning curve")
axes[1].plot([c[0] for c in curve], "o-")
axes[1].set(xlabel="outer step", ylabel="theta = log(regularisation weight)")
for ax in axes:
    ax.grid(alpha=0.3)
plt.tight_layout()
plt.show()
assert curve[-1][1] < 0.8 * curve[0][1], curve  # learning the weight improved the reconstructions
"""),
    md(r"""
## One gradient against unrolled differentiation

Started at $z^*$, plain gradient descent on $z$ stays at $z^*$, and the derivative of its $K$-th
iterate in $\theta$ tends to the implicit one as $K$ grows (the error falls like
$(1 - \eta\lambda_{\min})^K$). Unrolling 400 steps with `create_graph=True` gives the reference.
"""),
    code(r"""
y = {"b": b, "log_alpha": torch.tensor(0.5, dtype=F64)}
z_star = argmin(y, torch.zeros(6, 16, dtype=F64))
w = torch.randn(6, 16, dtype=F64)

implicit = mixedad.implicit_grad(f, prior_G, z_star, y, w, tol=1e-12)["log_alpha"]

log_alpha = y["log_alpha"].clone().requires_grad_()
z = z_star.clone()
H = torch.autograd.functional.hessian(lambda q: f(y, prior_G(q)), z_star).reshape(96, 96)
step = 1.0 / torch.linalg.eigvalsh(H).max()             # a stable step for the unrolled descent
for _ in range(400):
    z = z.requires_grad_() if not z.requires_grad else z
    loss = f({"b": b, "log_alpha": log_alpha}, prior_G(z))
    (grad_z,) = torch.autograd.grad(loss, z, create_graph=True)
    z = z - step * grad_z
(unrolled,) = torch.autograd.grad((z * w).sum(), log_alpha)
print(f"implicit {implicit.item():.8f}, unrolled (400 steps) {unrolled.item():.8f}")
assert torch.allclose(implicit, unrolled, rtol=1e-5), (implicit, unrolled)
"""),
    md(r"""
## Memory: implicit against unrolled, as depth grows

The peak memory (exact byte counts, float32) of one hypergradient $d\ell/d\theta$: unrolling 10
steps of the inner descent keeps $10 \times$ the graph of $G$; `implicit_argmin` keeps the
segment boundaries of $G$ and one segment's graph at a time.
"""),
    code(r"""
from mixedad.profiling import peak_memory

def problem(depth):
    Gd = zoo.mlp(depth, 64, seed=0)
    Ad = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)) / 8
    zs = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        bd = Gd(zs) @ Ad.T
    def fd(y, g):
        signal, z = g
        return ((signal @ Ad.T - y["b"]) ** 2).sum() + y["log_alpha"].exp() * (z ** 2).sum()
    return Gd, fd, bd

def unrolled(Gd, fd, bd, z0, steps=10, lr=0.01):
    log_alpha = torch.tensor(0.0, requires_grad=True)
    z = z0.clone().requires_grad_()
    for _ in range(steps):
        (grad_z,) = torch.autograd.grad(fd({"b": bd, "log_alpha": log_alpha}, (Gd(z), z)), z, create_graph=True)
        z = z - lr * grad_z
    (Gd(z) ** 2).sum().backward()
    return log_alpha.grad

def implicit(Gd, fd, bd, z_star):
    log_alpha = torch.tensor(0.0, requires_grad=True)
    z = mixedad.implicit_argmin(fd, lambda q: (Gd(q), q), z_star, {"b": bd, "log_alpha": log_alpha},
                                damping=1e-3, tol=1e-4)
    (Gd(z) ** 2).sum().backward()
    return log_alpha.grad

depths, peaks = [4, 8, 16, 32], {"unrolled (10 steps)": [], "implicit_argmin": []}
for depth in depths:
    Gd, fd, bd = problem(depth)
    z_star = torch.zeros(16, 64)
    opt = torch.optim.LBFGS([z_star.requires_grad_()], max_iter=200, tolerance_grad=1e-9, tolerance_change=1e-12,
                            line_search_fn="strong_wolfe")
    def closure():
        opt.zero_grad()
        loss = fd({"b": bd, "log_alpha": torch.tensor(0.0)}, (Gd(z_star), z_star))
        loss.backward()
        return loss
    for _ in range(5):
        opt.step(closure)
    z_star = z_star.detach()
    peaks["unrolled (10 steps)"].append(peak_memory(unrolled, Gd, fd, bd, z_star)[1])
    peaks["implicit_argmin"].append(peak_memory(implicit, Gd, fd, bd, z_star)[1])
for name, values in peaks.items():
    print(f"{name:>20}: " + ", ".join(f"depth {d}: {v / 2**20:.2f} MiB" for d, v in zip(depths, values)))
"""),
    code(r"""
fig, ax = plt.subplots(figsize=(5.5, 3.6))
for name, values in peaks.items():
    ax.plot(depths, [v / 2**20 for v in values], "o-", label=name)
ax.set(xlabel="depth of G (Linear layers)", ylabel="peak memory of one hypergradient (MiB)", xscale="log", yscale="log")
ax.legend()
ax.grid(alpha=0.3)
plt.tight_layout()
plt.show()
unrolled_peaks, implicit_peaks = peaks["unrolled (10 steps)"], peaks["implicit_argmin"]
assert implicit_peaks[-1] < 0.25 * unrolled_peaks[-1], peaks           # far below unrolling at depth 32
assert implicit_peaks[-1] / implicit_peaks[0] < 0.75 * unrolled_peaks[-1] / unrolled_peaks[0], peaks  # grows slower
"""),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--execute", action="store_true", help="run each notebook and store its outputs")
    args = parser.parse_args(argv)
    paths = [write("01_verification.ipynb", VERIFICATION), write("02_memory_vs_depth.ipynb", MEMORY),
             write("03_seed_pipeline.ipynb", PIPELINE), write("04_implicit_inversion.ipynb", IMPLICIT)]
    for path in paths:
        if args.execute:
            from nbclient import NotebookClient

            nb = nbformat.read(path, as_version=4)
            NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
            nbformat.write(nb, path)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
