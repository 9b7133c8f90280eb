"""What the two reviews of state share (tests/test_review_state.py, tests/test_review_state_more.py).

A review is a table of cases (:class:`Review`: its registry and ``case()`` decorator, the evaluation of one
case, its verdict and the table printer). A case's builder returns a :func:`problem`: G, f, z, y, v and a
sequence of steps, :class:`Call` (a public call of mixedad on one copy, its naive twin on the other),
:class:`Do` (the user, on both copies), :class:`Check` (mixedad's copy only) and :class:`Pair` (both sides
written out by the case). The naive twins are written here and not from ``mixedad.reference``: double
backward, ``torch.autograd.grad(..., create_graph=True)``, one plain forward of G per call (per chunk for
``input_grad``). :func:`effects` and :func:`compare_effects` are what a sequence leaves behind that the
naive copy must match. Each review keeps its own cases, registered in its own :class:`Review`, with the
public calls whose errors count as mixedad's own (``own_error``).
"""
import random
import re
import time
import types
import warnings

import numpy as np
import torch
import torch._dynamo  # noqa: F401  (importing it replaces torch.manual_seed: do that before any snapshot)
from torch import nn
from torch.autograd import forward_ad
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

import mixedad

from tests.seams_common import attributes as _attributes, first_line, rel_error

DT = torch.float64
RTOL = 1e-9
#: A warning no "exact" case may give: a right rule (or jvp) rejected.
DISAGREES = r"disagrees with the backward"
#: Damping for implicit differentiation: the Hessians here are indefinite without it.
DAMPING = 100.0
#: A rejected rule's warning: a RuntimeWarning that names the rule and gives both numbers of the dot-product test.
WRONG_WARNING = (r"^RuntimeWarning: .*{}.*disagree.*=\s*[-+]?(\d[\d.]*(e[-+]?\d+)?|nan|inf)"
                 r".*=\s*[-+]?(\d[\d.]*(e[-+]?\d+)?|nan|inf)")

# torch.compile's first use wraps nn.Module.__init__ and __setstate__ (dynamo's generation tagging); do it
# now, so that the check for patched torch attributes does not blame the first compile=True case.
torch._dynamo.mutation_guard.install_generation_tagging_init()


# ----------------------------------------------------------------------------------------------
# Steps and problems
# ----------------------------------------------------------------------------------------------

class Call:
    """A public call of mixedad (``kind``), run on the mixedad copy; its naive twin on the other."""

    def __init__(self, what, **opts):
        self.kind, self.opts = what, opts


class Do:
    """Something the user does between calls, on both copies alike."""

    def __init__(self, fn):
        self.fn = fn


class Check:
    """A check on the mixedad copy only: ``fn(p)`` returns a list of problems."""

    def __init__(self, fn):
        self.fn = fn


class Pair:
    """A step written out on both sides: ``naive(p)`` and ``ours(p)`` return results to compare."""

    def __init__(self, naive, ours):
        self.naive, self.ours, self.opts, self.kind = naive, ours, {}, "pair"


def problem(G, z, steps, *, y=None, v=None, f=None, gens=(), modules=(), writes_z=False, sources=(), **extra):
    """``sources``: (label, get_state, set_state) of random sources besides the global ones and G's torch.Generators."""
    y = torch.randn(4, dtype=DT) if y is None else y
    v = torch.randn_like(z) if v is None and isinstance(z, torch.Tensor) else v
    return types.SimpleNamespace(G=G, f=f_vec if f is None else f, z=z, y=y, v=v, steps=steps, gens=list(gens),
                                 modules=list(modules), writes_z=writes_z, sources=list(sources), ctx={},
                                 problems=[], counter=[0], cleanups=[], **extra)


# ----------------------------------------------------------------------------------------------
# Small builders: weights, codes, f, G, routes
# ----------------------------------------------------------------------------------------------

def mat(n_in, n_out):
    return torch.randn(n_in, n_out, dtype=DT) / n_in ** 0.5 * 1.5


def lin(n_in, n_out):
    return nn.Linear(n_in, n_out, dtype=DT)


def codes(n=4, d=3):
    return torch.randn(n, d, dtype=DT)


def f_vec(y, g):
    """A per-code sum: y (D,) meets each floating leaf of g along its last dim, non-linearly."""
    total = 0.0
    for leaf in tree_leaves(g):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            continue
        w = y[: leaf.shape[-1]]
        total = total + (torch.sin(leaf * w) + leaf.pow(2) * torch.cos(w) + leaf.pow(3) * w).sum()
    return total


def f_imp(y, g):
    """A fit with a mixed term in y and g, for curvature and implicit differentiation."""
    return ((g - y) ** 2).sum() + 0.1 * (g ** 4).sum() + (torch.sin(g) * y).sum()


def W_like(z):
    return torch.randn(z.shape, dtype=DT)


def ig(chunk=None, **opts):
    """input_grad forward then backward (``compile`` goes to the forward, the rest to the backward)."""
    return [Call("ig_fwd", chunk=chunk, **{k: v for k, v in opts.items() if k in ("compile",)}),
            Call("ig_bwd", **{k: v for k, v in opts.items() if k not in ("compile",)})]


def no_grad_do(fn):
    def run(p):
        with torch.no_grad():
            fn(p)

    return Do(run)


def forget():
    return Do(lambda p: mixedad.op_rules.forget_failures())


def seq_tanh():
    return nn.Sequential(lin(3, 6), nn.Tanh(), lin(6, 4))


def tanh_G():
    W1, W2 = mat(3, 6), mat(6, 4)
    return lambda q: torch.tanh(q @ W1) @ W2


def seq_mlp(norm=None, dropout=False):
    """Linear, batch norm (``norm``: "bn_eval" with random statistics, or "bn_train"), tanh, dropout, Linear."""
    layers = [lin(3, 6)]
    if norm in ("bn_eval", "bn_train"):
        layers.append(nn.BatchNorm1d(6, dtype=DT))
    layers.append(nn.Tanh())
    if dropout:
        layers.append(nn.Dropout(0.3))
    layers.append(lin(6, 4))
    G = nn.Sequential(*layers)
    if norm == "bn_eval":
        with torch.no_grad():
            G[1].running_mean.normal_()
            G[1].running_var.uniform_(0.5, 2.0)
        G.eval()
    return G


def igamma_tail(W3):
    """torch.igamma in x: no forward-AD formula and not in NO_FORMULA, so mixedad's pass restarts on it (a
    second run of G); its backward can be differentiated, so double backward answers."""

    def tail(h):
        return torch.igamma(torch.full_like(h, 1.5), h ** 2 + 0.5) @ W3

    return tail


#: Routes both reviews try G with, by name; each review adds its own, among them its own "vmap" and "curv_ggn"
#: (the vmap's randomness and the GGN operator's products differ between the reviews: see each ROUTES).
SHARED_ROUTES = {
    "mg": lambda z: [Call("mg")],
    "five": lambda z: [Call("mg") for _ in range(5)],
    "ig": lambda z: ig(None, W=W_like(z)),
    "ig_chunk": lambda z: ig(2, W=W_like(z)),
    "mj": lambda z: [Call("mj", chunk_size=5)],
    "curv": lambda z: [Call("curv", kind="hessian"), Call("matvec", u=W_like(z)), Call("matvec", u=W_like(z))],
    "implicit": lambda z: [Call("implicit", w=W_like(z), damping=DAMPING)],
    "argmin": lambda z: [Call("argmin_fwd", damping=DAMPING), Call("argmin_bwd", W=W_like(z))],
}


# ----------------------------------------------------------------------------------------------
# Users' rules
# ----------------------------------------------------------------------------------------------

def counted(p, fn):
    """``fn`` as a rule whose calls are counted in ``p.counter``."""

    def rule(op):
        p.counter[0] += 1
        return fn(op)

    rule.__qualname__ = fn.__qualname__
    rule.__name__ = fn.__name__
    return rule


def register_step(op, make_rule, arguments=None):
    """A step that registers ``make_rule(p)`` (counted) for ``op``; unregistered when the sequence ends."""

    def run(p):
        rule = counted(p, make_rule(p))
        mixedad.op_rules.register(op, arguments=arguments)(rule)
        p.cleanups.append(lambda: mixedad.op_rules.unregister(op))

    return Do(run)


def unregister_step(op):
    return Do(lambda p: mixedad.op_rules.unregister(op))


def used(flag=True):
    """Options for a Call: the registered rule must (or must not) be called during it."""
    return {"rule_used": flag}


def named(fn, name):
    fn.__qualname__ = fn.__name__ = name
    return fn


def first_tangent(op):
    name = next(k for k, t in op.tangents.items() if t is not None)
    return op.primals[name], op.tangents[name]


def tanh_rule(scale=1.0, name=None, post=lambda t: t):
    """For tanh (or a Function of one argument, whatever its name): right at scale 1; ``post`` alters the tangent."""

    def tanh_tangent(op):
        x, dx = first_tangent(op)
        return op.primal(), post(scale * (1 - torch.tanh(x) ** 2) * dx)

    return named(tanh_tangent, name or ("right_tanh_tangent" if scale == 1 else "wrong_tanh_tangent"))


def mul_rule(b_scale=1.0, name=None):
    """d(a*b) = da b + a db; the b term scaled by ``b_scale`` (wrong unless 1)."""

    def mul_tangent(op):
        a, b = op.primals["input"], op.primals["other"]
        da, db = op.tangents["input"], op.tangents["other"]
        t = 0
        if da is not None:
            t = t + da * b
        if db is not None:
            t = t + b_scale * a * db
        return op.primal(), t

    return named(mul_tangent, name or ("right_mul_tangent" if b_scale == 1 else "mul_tangent_wrong_in_b"))


TANH_ARGS = ("input",)
MUL_ARGS = ("input", "other")


# ----------------------------------------------------------------------------------------------
# The calls: mixedad's and their naive twins
# ----------------------------------------------------------------------------------------------

def _zs(z):
    return list(z) if isinstance(z, (tuple, list)) else [z]


def leaf_copies(y):
    return tree_map(lambda t: t.detach().clone().requires_grad_(), y)


def _grads(outputs, inputs, grad_outputs=None, retain_graph=None):
    """torch.autograd.grad with zeros for inputs that do not take part."""
    outputs = list(outputs)
    live = [i for i, o in enumerate(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not live:
        return [torch.zeros_like(x) for x in inputs]
    grads = torch.autograd.grad([outputs[i] for i in live], inputs,
                                None if grad_outputs is None else [grad_outputs[i] for i in live],
                                retain_graph=retain_graph, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]


def naive_forward(p, G=None, z=None, chunk=None):
    """(z's leaves requiring grad, G's output): one plain forward (per chunk), with a graph.

    G is ``p.truth_G`` where the case gives one (the function reverse mode means, where G itself cannot be
    differentiated twice), else ``p.G``. Where G writes its input, G receives a non-leaf copy (double backward
    cannot write a leaf, so naive code clones it), and the caller's z is left as it was: mixedad writes nothing
    the caller passed.
    """
    G = getattr(p, "truth_G", p.G) if G is None else G
    z = p.z if z is None else z
    tuple_z = isinstance(z, (tuple, list))
    zs = _zs(z)
    leaves = [t.detach().clone().requires_grad_() for t in zs]
    if chunk is not None:
        out = []
        for i in range(0, zs[0].shape[0], chunk):
            qs = [(t[i:i + chunk].clone() if p.writes_z else t[i:i + chunk]) for t in leaves]
            out.append(G(*qs) if tuple_z else G(qs[0]))
        return leaves, out
    inputs = [t.clone() for t in leaves] if p.writes_z else leaves
    out = G(*inputs) if tuple_z else G(inputs[0])
    return leaves, out


def _opts(p, o):
    return (o.get("G", p.G), o.get("z", p.z), o.get("y", p.y), o.get("f", p.f))


def _naive_dfdz(p, o, allow_unused=False):
    """(y's leaves, their spec, dL/dz per leaf of z with its graph, z's leaves) from one plain forward: the start
    of mixed_grad's naive twin and its kin. A G the call passes is used as it is; else :func:`naive_forward`'s."""
    G, z, y, f = _opts(p, o)
    yl = leaf_copies(y)
    leaves, spec = tree_flatten(yl)
    zl, out = naive_forward(p, G if "G" in o else None, z)
    return leaves, spec, torch.autograd.grad(f(yl, out), zl, create_graph=True, allow_unused=allow_unused), zl


def naive_mg(p, **o):
    with torch.enable_grad():
        leaves, spec, gz, zl = _naive_dfdz(p, o, allow_unused=True)
        gz = [torch.zeros_like(t) if g is None else g for g, t in zip(gz, zl)]
        grads = _grads(gz, leaves, _zs(o.get("v", p.v)))
    return tree_unflatten([g.detach() for g in grads], spec)


def mixedad_mg(p, **o):
    G, z, y, f = _opts(p, o)
    if o.get("per_op"):
        with mixedad.programs.per_op_pass():
            return mixedad.mixed_grad(f, G, z, y, o.get("v", p.v))
    return mixedad.mixed_grad(f, G, z, y, o.get("v", p.v), compile=o.get("compile", False))


def naive_vmap(p, V, **o):
    """One row per tangent; V is a tensor, or a tuple of them for a tuple z."""
    with torch.enable_grad():
        leaves, spec, gz, _ = _naive_dfdz(p, o)
        Vs = list(V) if isinstance(V, tuple) else [V]
        rows = [_grads(gz, leaves, [Vi[k] for Vi in Vs], retain_graph=True) for k in range(Vs[0].shape[0])]
    return tree_unflatten([torch.stack([r[i] for r in rows]).detach() for i in range(len(leaves))], spec)


def mixedad_vmap(p, V, **o):
    G, z, y, f = _opts(p, o)
    return torch.func.vmap(lambda v: mixedad.mixed_grad(f, G, z, y, v, compile=o.get("compile", False)),
                           randomness=o.get("randomness", "error"))(V)


def naive_mj(p, **o):
    z = o.get("z", p.z)
    with torch.enable_grad():
        leaves, spec, (gz,), _ = _naive_dfdz(p, o)
        rows = []
        for i in range(z.numel()):
            e = torch.zeros(z.numel(), dtype=z.dtype)
            e[i] = 1
            rows.append(_grads([gz], leaves, [e.reshape(z.shape)], retain_graph=True))
    return tree_unflatten([torch.stack([r[j] for r in rows]).reshape(*z.shape, *leaf.shape).detach()
                           for j, leaf in enumerate(leaves)], spec)


def mixedad_mj(p, **o):
    G, z, y, f = _opts(p, o)
    return mixedad.mixed_jacobian(f, G, z, y, chunk_size=o.get("chunk_size"), compile=o.get("compile", False))


def outer_loss(dfdz, W):
    if isinstance(dfdz, (tuple, list)):
        return sum(outer_loss(d, w) for d, w in zip(dfdz, W))
    return (W * dfdz).sum() + 0.5 * (dfdz ** 2).sum()


def naive_ig_fwd(p, chunk=None, **o):
    """dL/dz, a tensor (a list of them for a tuple z), as input_grad returns it."""
    with torch.enable_grad():
        yl = leaf_copies(p.y)
        zl, outs = naive_forward(p, chunk=chunk)
        total = p.f(yl, outs) if chunk is None else sum(p.f(yl, out) for out in outs)
        gz = torch.autograd.grad(total, zl, create_graph=True)
    tuple_z = isinstance(p.z, (tuple, list))
    p.ctx["yl"], p.ctx["dfdz"] = tree_leaves(yl), gz if tuple_z else gz[0]
    return [g.detach() for g in gz] if tuple_z else gz[0].detach()


def mixedad_ig_fwd(p, chunk=None, **o):
    yl = leaf_copies(p.y)
    dfdz = mixedad.input_grad(p.f, p.G, p.z, yl, chunk_size=chunk, compile=o.get("compile", False))
    p.ctx["yl"], p.ctx["dfdz"] = tree_leaves(yl), dfdz
    return [d.detach() for d in dfdz] if isinstance(p.z, (tuple, list)) else dfdz.detach()


def ig_bwd(p, W, retain=False, also=(), **o):
    """input_grad's backward: the gradient in y's leaves (and in ``also``) of :func:`outer_loss`."""
    with torch.enable_grad():
        loss = outer_loss(p.ctx["dfdz"], W)
        return [g.detach() for g in _grads([loss], [*p.ctx["yl"], *also], retain_graph=retain)]


def _ig_other(naive):
    """A whole input_grad of its own (forward and backward), leaving the case's saved one alone."""

    def run(p, chunk=None, W=None, **o):
        saved = dict(p.ctx)
        try:
            (naive_ig_fwd if naive else mixedad_ig_fwd)(p, chunk=chunk)
            return ig_bwd(p, W)
        finally:
            p.ctx.clear()
            p.ctx.update(saved)

    return run


def _operator_state(p):
    return (global_random(), [g.get_state() for g in _generators(p)],
            [b.detach().clone() for m in _modules(p) for b in m.buffers(recurse=False)],
            [(m, dict(vars(m))) for m in _modules(p)], [get() for _, get, _ in p.sources])


def _restore_operator_state(p, state):
    """What an operator (and implicit_argmin's saved pass) leaves: G as the caller had it (docs/semantics.md)."""
    randoms, generators, buffers, attributes, sources = state
    set_global_random(randoms)
    for (_, _, put), saved in zip(p.sources, sources):
        put(saved)
    for g, s in zip(_generators(p), generators):
        g.set_state(s)
    for b, saved in zip([b for m in _modules(p) for b in m.buffers(recurse=False)], buffers):
        b.data.copy_(saved)  # no version bump: the naive graph kept saves buffers (batch norm's statistics)
    for m, saved in attributes:
        m.__dict__.update({k: v for k, v in saved.items() if isinstance(v, (bool, int, float, str))})


# z_curvature: the naive operator is one forward of G with its graph kept, then double-backward products from
# it. As docs/semantics.md ("Limits") says, an operator and its products leave G's buffers and every random
# source as they were (an operator is not a forward pass of G: each product replays the state it was built
# from), so the naive twin puts them back once it has built its graph (any draw of f's included).
def naive_curv(p, kind="hessian", damping=0.0, **o):
    before = _operator_state(p)
    with torch.enable_grad():
        zl, out = naive_forward(p)
        y = tree_map(lambda t: t.detach(), p.y)
        p.ctx["curv"] = (kind, damping, zl)
        if kind == "hessian":
            (gz,) = torch.autograd.grad(p.f(y, out), zl, create_graph=True)
            p.ctx["gz"] = gz
        else:
            o_det = out.detach().requires_grad_()
            (gf,) = torch.autograd.grad(p.f(y, o_det), o_det, create_graph=True)
            p.ctx["ggn"] = (out, o_det, gf)
    _restore_operator_state(p, before)
    return None


def mixedad_curv(p, kind="hessian", damping=0.0, keep_graph=False, **o):
    p.ctx["op"] = mixedad.z_curvature(p.f, p.G, p.z, p.y, kind=kind, damping=damping, keep_graph=keep_graph)
    return None


def _naive_product(p, u):
    kind, damping, (zl,) = p.ctx["curv"]
    with torch.enable_grad():
        if kind == "hessian":
            (hu,) = _grads([p.ctx["gz"]], [zl], [u], retain_graph=True)
        else:
            out, o_det, gf = p.ctx["ggn"]
            w = torch.zeros_like(out, requires_grad=True)
            (vjp,) = torch.autograd.grad(out, zl, w, create_graph=True)
            (ju,) = torch.autograd.grad(vjp, w, u, retain_graph=True)
            (hju,) = _grads([gf], [o_det], [ju], retain_graph=True)
            (hu,) = _grads([out], [zl], [hju], retain_graph=True)
    return (hu + damping * u).detach()


def _unit_rows(n, dtype, row):
    """torch.stack of ``row(e_i)`` for the unit vectors e_i of size n."""
    rows = []
    for i in range(n):
        e = torch.zeros(n, dtype=dtype)
        e[i] = 1
        rows.append(row(e))
    return torch.stack(rows)


def naive_dense(p, **o):
    zl = p.ctx["curv"][2][0]
    return _unit_rows(zl.numel(), zl.dtype, lambda e: _naive_product(p, e.reshape(zl.shape)).reshape(-1))


def _naive_damped_hessian(p, y_tree, damping, z=None):
    """(H + damping I, dL/dz with its graph, z's leaf): L's Hessian in z, dense, by double backward."""
    (zl,), out = naive_forward(p, z=z)
    (gz,) = torch.autograd.grad(p.f(y_tree, out), zl, create_graph=True)
    n = zl.numel()
    H = _unit_rows(n, zl.dtype,
                   lambda e: _grads([gz], [zl], [e.reshape(zl.shape)], retain_graph=True)[0].reshape(-1))
    return H + damping * torch.eye(n, dtype=zl.dtype), gz, zl


def naive_implicit_grad(p, w, damping, **o):
    """-(d2L/dz dy)^T (H + damping I)^-1 w, by double backward and a dense solve, from one forward of G."""
    with torch.enable_grad():
        yl = leaf_copies(p.y)
        leaves, spec = tree_flatten(yl)
        H, gz, zl = _naive_damped_hessian(p, yl, damping)
        s = torch.linalg.solve(H, w.reshape(-1)).reshape(zl.shape)
        grads = _grads([gz], leaves, [-s])
    return tree_unflatten([g.detach() for g in grads], spec)


def mixedad_implicit(p, w, damping, **o):
    return mixedad.implicit_grad(p.f, p.G, p.z, p.y, w, damping=damping, tol=1e-13, maxiter=200)


def naive_argmin_fwd(p, damping, **o):
    p.ctx["argmin_z"] = p.z.detach().clone()
    yl = leaf_copies(p.y)
    p.ctx["yl"] = tree_leaves(yl)  # what a Do between forward and backward writes, as on mixedad's copy
    # implicit_argmin's backward runs from G's state at the call and leaves G as it found it (docs/api.md): so does
    # its twin, whose derivative is computed here, where the forward is, for any W.
    before = _operator_state(p)
    with torch.enable_grad():
        y_work = leaf_copies(p.y)
        leaves, _ = tree_flatten(y_work)
        H, gz, _ = _naive_damped_hessian(p, y_work, damping)
        p.ctx["argmin_naive"] = (H, gz, leaves)
    _restore_operator_state(p, before)
    return p.ctx["argmin_z"]


def naive_argmin_bwd(p, W, **o):
    H, gz, leaves = p.ctx["argmin_naive"]
    with torch.enable_grad():
        s = torch.linalg.solve(H, W.reshape(-1)).reshape(gz.shape)
        return [g.detach() for g in _grads([gz], leaves, [-s], retain_graph=True)]


def mixedad_argmin_fwd(p, damping, **o):
    yl = leaf_copies(p.y)
    p.ctx["yl"] = tree_leaves(yl)
    out = mixedad.implicit_argmin(p.f, p.G, p.z, yl, damping=damping, tol=1e-13, maxiter=200)
    p.ctx["argmin_out"] = out
    return out.detach()


def mixedad_argmin_bwd(p, W, **o):
    with torch.enable_grad():
        return [g.detach() for g in _grads([(W * p.ctx["argmin_out"]).sum()], p.ctx["yl"])]


def _cached_call(p, run):
    """[L, then each parameter's grad] of ``run()`` (which returns L and fills the grads), from and to no grads."""
    for q in p.G.parameters():
        q.grad = None
    L = run()
    out = [L] + [q.grad.clone() for q in p.G.parameters()]
    for q in p.G.parameters():
        q.grad = None
    return out


def _naive_cached_loss(p):
    with torch.enable_grad():
        L = p.g_of(torch.stack([p.G(x) for x in p.inputs]))
        L.backward()
    return L.detach()


def naive_cached(p, chunk_size=1, **o):
    return _cached_call(p, lambda: _naive_cached_loss(p))


def mixedad_cached(p, chunk_size=1, **o):
    return _cached_call(p, lambda: mixedad.cached_backward(p.G, p.inputs, p.g_of, chunk_size=chunk_size))


def mixedad_report(p, **o):
    p.ctx["report"] = mixedad.tangent_report(p.G, p.z)
    return None


def mixedad_plan(p, **o):
    mixedad.profiling.plan(p.f, p.G, p.z, p.y, methods=("mixed_grad",), device="cpu")
    return None


def _nothing(p, **o):
    """The naive twin of a call that returns nothing to compare (a report, a plan)."""
    return None


#: Each Call kind: (its naive twin, mixedad's call).
CALLS = {
    "mg": (naive_mg, mixedad_mg),
    "vmap": (naive_vmap, mixedad_vmap),
    "mj": (naive_mj, mixedad_mj),
    "ig_fwd": (naive_ig_fwd, mixedad_ig_fwd),
    "ig_bwd": (ig_bwd, ig_bwd),
    "ig_other": (_ig_other(True), _ig_other(False)),
    "curv": (naive_curv, mixedad_curv),
    "matvec": (lambda p, u, **o: _naive_product(p, u), lambda p, u, **o: p.ctx["op"] @ u),
    "matmat": (lambda p, U, **o: torch.stack([_naive_product(p, u) for u in U]),
               lambda p, U, **o: p.ctx["op"].matmat(U)),
    "dense": (naive_dense, lambda p, **o: p.ctx["op"].dense()),
    "implicit": (naive_implicit_grad, mixedad_implicit),
    "argmin_fwd": (naive_argmin_fwd, mixedad_argmin_fwd),
    "argmin_bwd": (naive_argmin_bwd, mixedad_argmin_bwd),
    "cached": (naive_cached, mixedad_cached),
    "report": (_nothing, mixedad_report),
    "plan": (_nothing, mixedad_plan),
}


# ----------------------------------------------------------------------------------------------
# What a sequence leaves behind
# ----------------------------------------------------------------------------------------------

def seed_all(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def global_random():
    return {"torch CPU RNG": torch.get_rng_state(), "Python random": random.getstate(),
            "NumPy global RNG": np.random.get_state()}


def set_global_random(state):
    torch.set_rng_state(state["torch CPU RNG"])
    random.setstate(state["Python random"])
    np.random.set_state(state["NumPy global RNG"])


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _modules(p):
    mods = list(p.modules)
    if isinstance(p.G, nn.Module):
        mods.append(p.G)
    out, seen = [], set()
    for m in mods:
        for sub in m.modules():
            if id(sub) not in seen:
                seen.add(id(sub))
                out.append(sub)
    return out


def _generators(p):
    """G's torch.Generators: ``p.gens``, and those ``p.G_gens(p)`` finds now (a generator G was given since)."""
    found = list(p.gens)
    if hasattr(p, "G_gens"):
        found += [g for g in p.G_gens(p) if all(g is not h for h in found)]
    return found


def effects(p):
    """What the sequence leaves behind that the naive copy must match."""
    mods = _modules(p)
    state = dict(global_random())
    state["generators"] = [g.get_state() for g in _generators(p)]
    state["sources"] = [(label, get()) for label, get, _ in p.sources]
    state["buffers"] = [(n, b.detach().clone()) for m in mods for n, b in m.named_buffers(recurse=False)]
    state["parameters"] = [(n, q.detach().clone()) for m in mods for n, q in m.named_parameters(recurse=False)]
    state["training flags"] = [m.training for m in mods]
    state["attributes"] = [(type(m).__name__, {k: v for k, v in vars(m).items() if not k.startswith("_")
                                               and isinstance(v, (bool, int, float, str))}) for m in mods]
    state["z"] = [t.detach().clone() for t in _zs(p.z)]
    state["inputs"] = [t.detach().clone() for t in getattr(p, "inputs", [])]
    return state


def _close_tensors(a, b, tol=1e-12):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not a.is_floating_point():
        return False
    scale = max(b.abs().max().item(), 1e-300)
    return (a - b).abs().max().item() <= tol * scale


def compare_effects(expected, now):
    leaks = []
    for key in ("torch CPU RNG", "Python random", "NumPy global RNG"):
        if not _same(expected[key], now[key]):
            leaks.append(f"{key} differs from the naive code's")
    if len(expected["generators"]) != len(now["generators"]):
        leaks.append("another number of G's generators than the naive code's")
    for i, (a, b) in enumerate(zip(expected["generators"], now["generators"])):
        if not torch.equal(a, b):
            leaks.append(f"G's generator #{i} differs from the naive code's")
    for (label, a), (_, b) in zip(expected["sources"], now["sources"]):
        if not _same(a, b):
            leaks.append(f"{label} differs from the naive code's")
    for key in ("buffers", "parameters"):
        names = [n for n, _ in expected[key]]
        if names != [n for n, _ in now[key]]:
            leaks.append(f"{key}: other names than the naive code's")
            continue
        bad = [n for (n, a), (_, b) in zip(expected[key], now[key]) if not _close_tensors(b, a)]
        if bad:
            leaks.append(f"{key} {', '.join(sorted(set(bad)))} differ from the naive code's")
    if expected["attributes"] != now["attributes"]:
        leaks.append("plain module attributes differ from the naive code's")
    if expected["training flags"] != now["training flags"]:
        leaks.append("module training flags differ from the naive code's")
    if not all(_close_tensors(b, a, 0.0) for a, b in zip(expected["z"], now["z"])):
        leaks.append("z differs from what the naive code leaves (G's plain forwards)")
    if not all(_close_tensors(b, a, 0.0) for a, b in zip(expected["inputs"], now["inputs"])):
        leaks.append("cached_backward's inputs differ from what the naive code leaves")
    return leaks


def _context():
    return {
        "TorchFunctionMode stack": torch._C._len_torch_function_stack(),
        "TorchDispatchMode stack": torch._C._len_torch_dispatch_stack(),
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "forward-AD level": forward_ad._current_level,
        "forward grad mode": torch._C._is_fwd_grad_enabled(),
        "functorch level": torch._C._functorch.maybe_current_level(),
    }


def _caller_tensors(p):
    """The caller's tensors of the mixedad copy that nothing may write: y, v, and what the steps pass."""
    found = [("y", t) for t in tree_leaves(p.y) if isinstance(t, torch.Tensor)]
    found += [("v", t) for t in tree_leaves(p.v) if isinstance(t, torch.Tensor)]
    if not (p.writes_z or getattr(p, "user_writes_z", False)):
        found += [("z", t) for t in _zs(p.z)]
    for step in p.steps:
        if isinstance(step, Call):
            for key, value in step.opts.items():
                if key in ("G", "f"):
                    continue
                for t in tree_leaves(value):
                    if isinstance(t, torch.Tensor) and not (p.writes_z and key == "z"):
                        found.append((f"{step.kind}'s {key}", t))
    return found


# ----------------------------------------------------------------------------------------------
# The harness: two copies, the same random states, compare results and what is left behind
# ----------------------------------------------------------------------------------------------

def execute(p, naive, out):
    """Run p's steps on this copy: naive twins or mixedad's calls. Results go to ``out`` as they come."""
    try:
        for step in p.steps:
            if isinstance(step, Do):
                step.fn(p)
            elif isinstance(step, Check):
                if not naive:
                    p.problems += step.fn(p)
            elif isinstance(step, Pair):
                out.append((step.naive if naive else step.ours)(p))
            else:
                fn = CALLS[step.kind][0 if naive else 1]
                opts = {k: v for k, v in step.opts.items() if k != "rule_used"}
                before = p.counter[0]
                result = fn(p, **opts)
                if not naive and "rule_used" in step.opts:
                    calls = p.counter[0] - before
                    if step.opts["rule_used"] and calls == 0:
                        p.problems.append(f"call #{len(out) + 1} ({step.kind}): the registered rule was not called")
                    if not step.opts["rule_used"] and calls:
                        p.problems.append(f"call #{len(out) + 1} ({step.kind}): a rule that must not run was "
                                          f"called {calls} times")
                out.append(result)
    finally:
        for cleanup in reversed(p.cleanups):
            cleanup()
        p.cleanups.clear()


def build(c):
    seed_all(0)
    return c.build()


def _error(actual, expected):
    if actual is None and expected is None:
        return 0.0
    if isinstance(actual, torch.Tensor) != isinstance(expected, torch.Tensor):
        return float("inf")
    flat_a, spec_a = tree_flatten(actual)
    flat_e, spec_e = tree_flatten(expected)
    if spec_a != spec_e:
        return float("inf")  # another structure than the naive code's
    return rel_error(actual, expected)


def _run_ours(c, ours):
    """Run mixedad's copy: (results, error, leaks, warnings as ``Category: message``, inputs before)."""
    caller = [(label, t, t.detach().clone()) for label, t in _caller_tensors(ours)]
    inputs_before = effects(ours)["inputs"]
    attrs_before, context_before = _attributes(), _context()
    results, error = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            execute(ours, False, results)
        except Exception as e:  # noqa: BLE001  (classified by the verdict)
            error = e
    leaks = []
    context_after = _context()
    for key, value in context_before.items():
        if context_after[key] != value:
            leaks.append(f"{key} {value} -> {context_after[key]}")
    if forward_ad._current_level != -1:
        leaks.append(f"forward_ad._current_level == {forward_ad._current_level}")
    attrs_after = _attributes()
    changed = sorted(k for k in attrs_before if attrs_after.get(k) != attrs_before[k])
    if changed:
        leaks.append(f"torch attributes patched: {', '.join(changed)}")
    for label, t, saved in caller:
        if not _close_tensors(t.detach(), saved, 0.0):
            leaks.append(f"the caller's {label} was written")
    messages = [f"{w.category.__name__}: {w.message}".replace("\n", " ") for w in caught]
    return results, error, leaks, messages, inputs_before


class Review:
    """A table of cases and how they are judged.

    ``own_error``: the regex an error's message matches where the error is mixedad's own (a refusal, not a
    crash): it opens with a public call, and each review names the calls its cases make.
    """

    def __init__(self, own_error):
        self.cases = []
        self.own_error = own_error

    def case(self, area, expect="exact", match=None, rtol=RTOL, name=None, not_match=None):
        """Register a builder. ``expect``: "exact", "refused", "warns", or alternatives joined by "|".

        ``match`` is the regex a refusal's message (for "refused") or a warning (for "warns", written
        ``Category: message``) must match; a warning that also matches ``not_match`` does not count.
        """

        def register(build):
            self.cases.append(types.SimpleNamespace(area=area, name=name or build.__name__, build=build,
                                                    expect=expect, match=match, rtol=rtol, not_match=not_match))
            return build

        return register

    def evaluate(self, c):
        """Run one case (torch on one thread: the sizes are tiny). Returns (verdict, detail, leaks, warnings, error)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._evaluate(c)
        finally:
            torch.set_num_threads(threads)

    def _evaluate(self, c):
        from mixedad import _entry

        _entry._warned.clear()
        naive, ours = build(c), build(c)
        seed_all(1)
        start = global_random()

        expected, truth_error = [], None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                execute(naive, True, expected)
            except Exception as error:  # noqa: BLE001  (the naive code may refuse a step too)
                truth_error = error
        expected_effects = effects(naive)

        set_global_random(start)
        results, error, leaks, messages, inputs_before = _run_ours(c, ours)
        if truth_error is None or error is not None:
            if error is not None:  # a refusal writes none of cached_backward's inputs, whatever the naive code wrote
                expected_effects = {**expected_effects, "inputs": inputs_before}
            leaks += compare_effects(expected_effects, effects(ours))
        leaks += ours.problems
        return self._verdict(c, results, error, expected, truth_error, leaks, messages)

    def _verdict(self, c, results, error, expected, truth_error, leaks, messages):
        short = [m[:160] for m in messages if "mixedad" in m or "disagrees" in m or "tangent" in m]
        if error is not None and truth_error is not None and len(results) > len(expected):
            return "answered", (f"call #{len(expected) + 1} answered where the naive code raises "
                                f"({first_line(truth_error)}); then: {first_line(error)}"), leaks, short, None
        if error is not None:
            text = str(error).strip()
            name = "refused" if self.own_error.match(text) else "crash"
            detail = first_line(error)
            if truth_error is not None:
                detail += f" (the naive code raises too: {first_line(truth_error)})"
            for i, (a, e) in enumerate(zip(results, expected)):
                err = _error(a, e)
                if err >= c.rtol:
                    detail += f"; and call #{i + 1} before it was off by {err:.2e}"
            return name, detail, leaks, short, text
        if truth_error is not None and len(expected) < len(results):
            return "answered", f"the naive code raises ({first_line(truth_error)})", leaks, short, None
        errors = [_error(a, e) for a, e in zip(results, expected)]
        bad = [(i, err) for i, err in enumerate(errors) if not err < c.rtol]
        worst = max([err for err in errors if err == err], default=0.0)
        if bad:
            where = ", ".join(f"#{i + 1}: {err:.2e}" for i, err in bad)
            return "wrong", f"rel err at call {where} (of {len(results)} calls; rtol {c.rtol:.0e})", leaks, short, None
        if any(re.search(DISAGREES, m) for m in messages) and "warns" not in c.expect:
            return "exact", f"rel err {worst:.1e}, but a rule or jvp was rejected", leaks + [
                "a right rule or jvp was rejected: " + next(m for m in messages if re.search(DISAGREES, m))[:200]], \
                short, None
        if "warns" in c.expect.split("|"):
            if any(re.search(c.match, m, re.S) and not (c.not_match and re.search(c.not_match, m, re.S))
                   for m in messages):
                return "warns", f"rel err {worst:.1e}", leaks, short, None
            if "exact" in c.expect.split("|"):
                return "exact", f"rel err {worst:.1e}", leaks, short, None
            return "exact (no warning)", f"rel err {worst:.1e}; no warning matches {c.match!r}", leaks, short, None
        return "exact", f"rel err {worst:.1e}", leaks, short, None

    def print_table(self):
        """``python -m tests.test_review_state`` (or ``tests.test_review_state_more``): the verdicts now, one row a
        case, then the counts."""
        counts, by_area = {}, {}
        print("| area | case | expected | got | ok | relative error / detail |")
        print("|---|---|---|---|---|---|")
        t0 = time.perf_counter()
        for c in self.cases:
            t = time.perf_counter()
            verdict, detail, leaks, messages, text = self.evaluate(c)
            label = verdict
            if verdict == "refused" and c.match and not re.search(c.match, text or "", re.S):
                label = "refused (unmatched)"
                detail += f" [{(text or '')[:300]}]"
            if leaks:
                label += " + leak"
                detail += " | LEAK: " + "; ".join(leaks)
            good = ok(c, verdict, leaks, text)
            counts[good] = counts.get(good, 0) + 1
            by_area.setdefault(c.area, [0, 0])[0 if good else 1] += 1
            print(f"| {c.area} | {c.name} | {c.expect.replace('|', ' or ')} | {label} | {'ok' if good else 'FAIL'} | "
                  f"{detail.replace('|', '/')} ({time.perf_counter() - t:.2f} s) |", flush=True)
        print()
        print(f"{len(self.cases)} cases, {counts.get(True, 0)} ok, {counts.get(False, 0)} failing, "
              f"{time.perf_counter() - t0:.1f} s")
        for area, (good, bad) in by_area.items():
            print(f"  {area}: {good + bad} cases, {bad} failing")


def ok(c, verdict, leaks, text):
    if verdict not in c.expect.split("|"):
        return False
    if verdict == "refused" and c.match and not re.search(c.match, text or "", re.S):
        return False
    return not leaks

