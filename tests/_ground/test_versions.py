"""Saved passes used after G or their inputs changed: mixedad's error, or double backward's answer.

Every object that keeps a pass (input_grad's backward, a z_curvature operator's methods, implicit_argmin's
backward, cached_backward's second pass) is crossed with every kind of change to what that pass reads again
without a copy: each raises StateChangedError before computing. What mixedad's snapshots replay (train-mode
buffers, small eval-mode buffers, module modes) and mixedad's own restores (a second backward, chunks, train-mode
BatchNorm, spectral norm, an operator used many times) never raise, and the result is then naive double
backward's from the state at build time, in float64.
"""
import functools

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

import mixedad
from mixedad import StateChangedError
from mixedad._ground.state import SMALL_BUFFER_BYTES
from mixedad._ground.versions import input_labels
from mixedad.testing import assert_close

F64 = torch.float64
W = 24  # Mix's W x W float64 buffer is larger than SMALL_BUFFER_BYTES: snapshots watch it without copying


class Mix(nn.Module):
    """x @ M, with M a buffer of an eval-mode module too large for a snapshot to copy."""

    def __init__(self, width, gen):
        super().__init__()
        self.register_buffer("M", torch.eye(width, dtype=F64) + 0.1 * torch.randn(width, width, generator=gen, dtype=F64))

    def forward(self, x):
        return x @ self.M


def make(kind, width=W, seed=0, conditioned=False):
    """G in float64, built alike for the same arguments.

    "eval": Mix's large buffer and an eval BatchNorm's small ones; "batchnorm": BatchNorm in train mode;
    "spectral": spectral norm in train mode (its u and v step on every forward), parametrized or ("spectral
    hooks") hook-based. ``conditioned``: every Linear
    near the identity, so that G's Jacobian is well conditioned (implicit differentiation solves with it).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "eval":
            G = nn.Sequential(nn.Linear(width, width), nn.Tanh(), Mix(width, gen), nn.Linear(width, width),
                              nn.BatchNorm1d(width), nn.Tanh(), nn.Linear(width, width)).to(F64).eval()
            with torch.no_grad():
                G[4].running_mean.normal_(generator=gen)
                G[4].running_var.uniform_(0.5, 2.0, generator=gen)
        elif kind == "batchnorm":
            G = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Tanh(),
                              nn.Linear(width, width)).to(F64).train()
        elif kind == "spectral":
            G = nn.Sequential(spectral_norm(nn.Linear(width, width).to(F64)), nn.Tanh(),
                              nn.Linear(width, width).to(F64)).train()
        elif kind == "spectral hooks":  # the older spectral norm: a forward pre-hook sets a plain weight attribute
            G = nn.Sequential(nn.utils.spectral_norm(nn.Linear(width, width).to(F64)), nn.Tanh(),
                              nn.Linear(width, width).to(F64)).train()
        else:
            raise ValueError(kind)
    for layer in G.modules() if conditioned else ():
        if isinstance(layer, nn.Linear):
            weight = (layer.parametrizations.weight.original if hasattr(layer, "parametrizations")
                      else getattr(layer, "weight_orig", layer.weight))
            with torch.no_grad():
                weight.copy_(torch.eye(width, dtype=F64) + 0.1 * torch.randn(width, width, generator=gen, dtype=F64))
    return G


def closure(G):
    """G as a function closing over its module: the modules are found as it runs (or, before, in its closure)."""
    return lambda z: G(z)


def f(y, g):
    """A sum over latent codes (chunks allowed) whose Hessian in g depends on g and on both leaves of y."""
    return ((g - y["b"]) ** 2 * y["a"].exp()).sum() + 0.3 * (torch.tanh(g) ** 3 * y["a"]).sum()


def outer(dfdz):
    return (dfdz ** 2).sum() + dfdz.sin().sum()


def data(n=4, width=W, seed=1):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, width, generator=gen, dtype=F64)
    y = {k: torch.randn(width, generator=gen, dtype=F64, requires_grad=True) for k in ("a", "b")}
    u = torch.randn(n, width, generator=gen, dtype=F64)
    return z, y, u


def clone(y):
    return {k: v.detach().clone().requires_grad_() for k, v in y.items()}


def test_the_large_buffer_is_one_snapshots_do_not_copy():
    assert W * W * 8 > SMALL_BUFFER_BYTES


# -- every kind of change, against every object: mixedad's error -----------------------------------------------

def _parameter_under_no_grad(G, z, y):
    with torch.no_grad():
        G[0].weight.add_(1e-3)


def _sgd_step(G, z, y):
    for p in G.parameters():
        p.grad = torch.ones_like(p)
    torch.optim.SGD(G.parameters(), lr=1e-3).step()


def _adam_step(G, z, y):
    for p in G.parameters():
        p.grad = torch.ones_like(p)
    torch.optim.Adam(G.parameters(), lr=1e-3, foreach=True).step()


def _load_state_dict(G, z, y):
    G.load_state_dict({k: v + 1e-3 if k == "0.weight" else v for k, v in G.state_dict().items()})


def _buffer_in_place(G, z, y):
    G[2].M.mul_(1.001)


def _eval_buffer_in_place(G, z, y):  # a buffer snapshots copy: double backward saves it, and refuses the change
    with torch.no_grad():
        G[4].running_mean.add_(0.5)


def _parameter_replaced(G, z, y):
    G[0].weight = nn.Parameter(G[0].weight.detach() * 1.001)


def _layer_replaced(G, z, y):
    G[0] = nn.Linear(W, W).to(F64)


def _z_in_place(G, z, y):
    z.add_(1e-3)


def _y_in_place(G, z, y):
    with torch.no_grad():
        y["a"].add_(1e-3)


PARAMETER = r"the parameter 0\.weight of {G} was modified in place"
#: (change, what the message says of it); {G} and {z} are the object's names for G and z.
CHANGES = [
    (_parameter_under_no_grad, PARAMETER),
    (_sgd_step, PARAMETER),
    (_adam_step, PARAMETER),
    (_load_state_dict, PARAMETER),
    (_buffer_in_place, r"the buffer 2\.M of {G} was modified in place"),
    (_parameter_replaced, r"the parameter 0\.weight of {G} was replaced by another tensor"),
    (_layer_replaced, r"the parameter 0\.weight of {G} was replaced by another tensor"),
    (_z_in_place, r"{z} was modified in place"),
    (_y_in_place, r"y's leaf 0 \(y\['a'\]\) was modified in place"),
]


def _input_grad(chunk_size):
    def build(G, z, y, u):
        dfdz = mixedad.input_grad(f, G, z, y, chunk_size=chunk_size)
        return lambda: torch.autograd.grad(outer(dfdz), list(y.values()))

    return build


def _operator(use, kind="hessian", keep_graph=False):
    def build(G, z, y, u):
        op = mixedad.z_curvature(f, G, z, y, kind=kind, damping=50.0, keep_graph=keep_graph)
        return lambda: use(op, u)

    return build


def _implicit_argmin(G, z, y, u):
    z_hat = mixedad.implicit_argmin(f, G, z, y)
    return lambda: torch.autograd.grad((z_hat * u).sum(), list(y.values()))


INPUT_GRAD = (r"input_grad\(f, G, z, y\): ", "z", "Call input_grad again after the change")
OPERATOR = (r"z_curvature\(f, G, z, y\): ", "z", "Build a new operator with z_curvature after the change")
IMPLICIT = (r"implicit_argmin\(f, G, z_star, y\): ", "z_star", "Call implicit_argmin again after the change")
PROBES = functools.partial(torch.Generator().manual_seed, 0)
#: (name, build(G, z, y, u) -> use(), (how the message opens, z's name, the fix))
OBJECTS = [
    ("input_grad", _input_grad(None), INPUT_GRAD),
    ("input_grad chunks", _input_grad(2), INPUT_GRAD),
    ("matvec", _operator(lambda op, u: op.matvec(u)), OPERATOR),
    ("matvec ggn", _operator(lambda op, u: op.matvec(u), kind="ggn"), OPERATOR),
    ("@", _operator(lambda op, u: op @ u), OPERATOR),
    ("@ keep_graph", _operator(lambda op, u: op @ u, keep_graph=True), OPERATOR),
    ("@ ggn keep_graph", _operator(lambda op, u: op @ u, kind="ggn", keep_graph=True), OPERATOR),
    ("matmat", _operator(lambda op, u: op.matmat(u[None])), OPERATOR),
    ("dense", _operator(lambda op, u: op.dense()), OPERATOR),
    ("diagonal", _operator(lambda op, u: op.diagonal(samples=2, generator=PROBES())), OPERATOR),
    ("trace", _operator(lambda op, u: op.trace(samples=2, generator=PROBES())), OPERATOR),
    ("solve", _operator(lambda op, u: op.solve(u)), OPERATOR),
    ("f_gradient ggn", _operator(lambda op, u: op.f_gradient(), kind="ggn"), OPERATOR),
    ("implicit_argmin", _implicit_argmin, IMPLICIT),
]


@pytest.mark.parametrize("change, says", CHANGES, ids=[c.__name__.strip("_") for c, _ in CHANGES])
@pytest.mark.parametrize("name, build, message", OBJECTS, ids=[o[0] for o in OBJECTS])
def test_a_change_to_what_a_saved_pass_reads_again_raises(name, build, message, change, says):
    G = make("eval")
    z, y, u = data()
    use = build(G, z, y, u)
    change(G, z, y)
    opens, z_name, fix = message
    with pytest.raises(StateChangedError, match=opens + says.format(G="G", z=z_name) + ".*" + fix):
        use()


@pytest.mark.parametrize("name, build, message", OBJECTS, ids=[o[0] for o in OBJECTS])
def test_a_copied_buffer_the_saved_pass_read_is_checked_too(name, build, message):
    """Eval batch norm's running mean: snapshots copy it, and the saved pass read it (double backward saves it and
    refuses a change; implicit_argmin runs G once, undone, to know what its backward reads)."""
    G = make("eval")
    z, y, u = data()
    use = build(G, z, y, u)
    _eval_buffer_in_place(G, z, y)
    opens, _, fix = message
    with pytest.raises(StateChangedError, match=opens + r"the buffer 4\.running_mean of G was modified in place.*" + fix):
        use()


def _torch_layers(seed=0):
    """G of torch.nn's own layers only, in eval mode: mixedad does not watch it run (it reads nothing else)."""
    gen = torch.Generator().manual_seed(seed)
    G = nn.Sequential(nn.Linear(W, W), nn.BatchNorm1d(W), nn.Tanh(), nn.Linear(W, W)).double().eval()
    with torch.no_grad():
        for p in G.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64) / 4)
        G[1].running_mean.copy_(torch.randn(W, generator=gen, dtype=F64) / 4)
    return G


@pytest.mark.parametrize("name, build, message", OBJECTS[:-1], ids=[o[0] for o in OBJECTS[:-1]])  # all but implicit
def test_a_g_of_torch_layers_is_checked_for_what_its_eval_forward_reads(name, build, message):
    """Eval batch norm's running mean is read (a change raises); its num_batches_tracked is not (a change does not)."""
    G = _torch_layers()
    z, y, u = data()
    opens, _, fix = message
    use = build(G, z, y, u)
    with torch.no_grad():
        G[1].num_batches_tracked.add_(1)
    use()
    with torch.no_grad():
        G[1].running_mean.add_(0.5)
    with pytest.raises(StateChangedError, match=opens + r"the buffer 1\.running_mean of G was modified in place.*" + fix):
        use()


@pytest.mark.parametrize("name, build, message", [o for o in OBJECTS if o[0] in ("input_grad chunks", "matvec",
                                                                                 "implicit_argmin")],
                         ids=["input_grad chunks", "matvec", "implicit_argmin"])
def test_a_g_that_is_not_a_module_is_checked_through_the_modules_it_calls(name, build, message):
    G = make("eval")
    z, y, u = data()
    use = build(closure(G), z, y, u)
    _parameter_under_no_grad(G, z, y)
    opens, _, fix = message
    with pytest.raises(StateChangedError, match=opens + PARAMETER.format(G="the Sequential that G calls") + ".*" + fix):
        use()


class _Scaled(nn.Module):
    """tanh(x) times a class attribute, which the saved pass reads again as the class has it then."""

    scale = 1.5

    def forward(self, x):
        return torch.tanh(x) * self.scale


@pytest.mark.parametrize("name, build, message", [o for o in OBJECTS if o[0] in ("input_grad", "matvec",
                                                                                 "implicit_argmin")],
                         ids=["input_grad", "matvec", "implicit_argmin"])
def test_a_changed_class_attribute_of_gs_modules_raises(name, build, message):
    Scaled = type("Scaled", (_Scaled,), {})  # a class of this test's own, changed below
    G = nn.Sequential(make("eval"), Scaled())
    z, y, u = data()
    use = build(G, z, y, u)
    Scaled.scale = 2.0
    opens, _, fix = message
    with pytest.raises(StateChangedError, match=opens + r"the class Scaled of G's modules was changed \(a class "
                                                        r"attribute, or a global its forward names\).*" + fix):
        use()


# g runs between cached_backward's passes: a g that changes what pass 2 recomputes from.
def _g_writes(write):
    def g(net, xs, Z):
        with torch.no_grad():
            write(net, xs)
        return Z.pow(2).sum()

    return g


CACHED_CHANGES = [
    (_g_writes(lambda net, xs: net[0].weight.add_(1e-3)), r"the parameter 0\.weight of f was modified in place"),
    (_g_writes(lambda net, xs: setattr(net[0], "weight", nn.Parameter(net[0].weight * 2))),
     r"the parameter 0\.weight of f was replaced by another tensor"),
    (_g_writes(lambda net, xs: net[2].M.mul_(1.001)), r"the buffer 2\.M of f was modified in place"),
    (_g_writes(lambda net, xs: xs[1].add_(1e-3)), r"inputs\[1\] was modified in place"),
]


@pytest.mark.parametrize("g, says", CACHED_CHANGES, ids=["parameter", "replaced", "buffer", "input"])
def test_cached_backward_refuses_a_g_that_changes_what_pass_2_reads(g, says):
    net = make("eval")
    xs = [x.clone() for x in data(n=6)[0].reshape(3, 2, W)]  # three inputs of two rows each, apart
    with pytest.raises(StateChangedError, match=r"cached_backward\(f, inputs, g\): " + says + ".*must not change f's"):
        mixedad.cached_backward(net, xs, lambda Z: g(net, xs, Z))


# -- what is replayed, and mixedad's own restores: double backward's answer ---------------------------------------

def naive_input_grad(f, G, z, y, chunk_size):
    """∂/∂y of outer(∂f(y, G(z))/∂z) by double backward, chunk by chunk as input_grad's naive code."""
    step = chunk_size or len(z)
    parts = []
    for start in range(0, len(z), step):
        zc = z[start:start + step].detach().requires_grad_()
        parts.append(torch.autograd.grad(f(y, G(zc)), zc, create_graph=True)[0])
    return torch.autograd.grad(outer(torch.cat(parts)), list(y.values()))


GS = ["eval", "batchnorm", "spectral", "spectral hooks", "closure"]


def _g(kind):
    return closure(make("eval")) if kind == "closure" else make(kind)


@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("kind", GS)
def test_input_grad_twice_backward_chunks_and_train_mode_are_double_backward(kind, chunk_size):
    """A second backward (retain_graph=True) replays every chunk again from the snapshots it restored itself."""
    G, reference = _g(kind), _g(kind)
    z, y, _ = data(n=6)  # chunks of three: a train-mode BatchNorm normalises over more than two codes
    y_ref = clone(y)
    dfdz = mixedad.input_grad(f, G, z, y, chunk_size=chunk_size)
    loss = outer(dfdz)
    first = torch.autograd.grad(loss, list(y.values()), retain_graph=True)
    second = torch.autograd.grad(loss, list(y.values()))
    expected = naive_input_grad(f, reference, z, y_ref, chunk_size)
    assert_close(first, expected, rtol=1e-9)
    assert_close(second, expected, rtol=1e-9)
    if isinstance(G, nn.Module):  # buffers stepped once per chunk, as by the naive code
        assert_close(dict(G.named_buffers()), dict(reference.named_buffers()), rtol=1e-12)


def _train_mode(G):
    G.train()


REPLAYED = [_train_mode]


@pytest.mark.parametrize("change", REPLAYED, ids=["train mode"])
def test_input_grad_replays_what_its_snapshots_copied(change):
    """A change of mode is not read: the backward replays the mode it saw, and the change stays."""
    G, reference = make("eval"), make("eval")
    z, y, _ = data()
    y_ref = clone(y)
    dfdz = mixedad.input_grad(f, G, z, y, chunk_size=2)
    change(G)
    after = {k: v.clone() for k, v in G.state_dict().items()}
    assert_close(torch.autograd.grad(outer(dfdz), list(y.values())), naive_input_grad(f, reference, z, y_ref, 2),
                 rtol=1e-9)
    assert all(torch.equal(v, after[k]) for k, v in G.state_dict().items()) and G.training == (change is _train_mode)


def naive_hessian(f, G, z, y):
    """∇²_z f(y, G(z)) by double backward, one row at a time."""
    y = {k: v.detach() for k, v in y.items()}
    zw = z.detach().requires_grad_()
    (gradient,) = torch.autograd.grad(f(y, G(zw)), zw, create_graph=True)
    rows = [torch.autograd.grad(gradient.reshape(-1)[i], zw, retain_graph=True)[0].reshape(-1)
            for i in range(z.numel())]
    return torch.stack(rows)


OPERATOR_CASES = [(kind, None) for kind in GS] + [("eval", change) for change in REPLAYED]


@pytest.mark.parametrize("kind, change", OPERATOR_CASES, ids=GS + ["eval, train mode"])
def test_an_operator_used_many_times_is_double_backward(kind, change):
    """Every method, again and again: each replays the construction's state and leaves the caller's."""
    G, reference = _g(kind), _g(kind)
    z, y, u = data(n=2)
    H = naive_hessian(f, reference, z, y)
    damping = 1.0 - min(0.0, float(torch.linalg.eigvalsh(H).min()))  # positive definite: CG can solve
    A = H + damping * torch.eye(z.numel(), dtype=F64)
    op = mixedad.z_curvature(f, G, z, y, kind="hessian", damping=damping)
    if change is not None:
        change(G)
    before = {k: v.clone() for k, v in G.state_dict().items()} if isinstance(G, nn.Module) else {}
    Au = (A @ u.reshape(-1)).reshape(u.shape)
    for _ in range(3):
        assert_close(op @ u, Au, rtol=1e-9)
    assert_close(op.matvec(u), Au, rtol=1e-9)
    assert_close(op.matmat(torch.stack([u, 2 * u])), torch.stack([Au, 2 * Au]), rtol=1e-9)
    assert_close(op.dense(), A, rtol=1e-9)
    assert_close(op.diagonal(), A.diagonal().reshape(z.shape), rtol=1e-9)
    assert_close(op.trace(), A.trace(), rtol=1e-9)
    assert_close(op.solve(u, tol=1e-13), torch.linalg.solve(A, u.reshape(-1)).reshape(u.shape), rtol=1e-9)
    assert all(torch.equal(v, before[k]) for k, v in G.state_dict().items()) if before else True


def f_fit(y, g):
    """A zero residual at z_star = z when y["b"] = G(z): z is a minimiser of f(y, G(.))."""
    return ((g - y["b"]) ** 2 * y["a"].exp()).sum()


def dense_solve(matvec, b):
    """The caller's solver: the operator's dense matrix from matvec, then a direct solve."""
    columns = [matvec(e.reshape(b.shape)).reshape(-1) for e in torch.eye(b.numel(), dtype=b.dtype)]
    return torch.linalg.solve(torch.stack(columns, 1), b.reshape(-1)).reshape(b.shape)


def naive_implicit(f, G, z_star, y, w):
    """-(∂²L/∂z∂y)ᵀ H⁻¹ w, H and the mixed term by double backward through one forward of G."""
    zw = z_star.detach().requires_grad_()
    (gradient,) = torch.autograd.grad(f(y, G(zw)), zw, create_graph=True)
    H = torch.stack([torch.autograd.grad(gradient.reshape(-1)[i], zw, retain_graph=True)[0].reshape(-1)
                     for i in range(zw.numel())])
    x = torch.linalg.solve(H, w.reshape(-1)).reshape(w.shape)
    return tuple(-g for g in torch.autograd.grad(gradient, list(y.values()), x))


IMPLICIT_CASES = [("spectral", None), ("spectral hooks", None), ("eval", None), ("closure", None),
                  ("eval", _train_mode)]


@pytest.mark.parametrize("kind, change", IMPLICIT_CASES, ids=["spectral", "spectral hooks", "eval", "closure",
                                                              "eval, train mode"])
def test_implicit_argmin_replays_the_calls_state_on_every_backward(kind, change):
    """Two backwards (retain_graph=True) both see G as at the call, whatever ran or changed in between."""
    width = 6
    G, reference, target = (closure(make("eval", width, conditioned=True)) if kind == "closure"
                            else make(kind, width, conditioned=True) for _ in range(3))
    z, y, w = data(n=2, width=width)
    with torch.no_grad():
        b = target(z)  # one forward from the same state: z is an exact minimiser
    y = {"a": y["a"], "b": b.requires_grad_()}
    y_ref = clone(y)
    z_hat = mixedad.implicit_argmin(f_fit, G, z, y, solve=dense_solve)
    if change is not None:
        change(G)
    loss = (z_hat * w).sum()
    first = torch.autograd.grad(loss, list(y.values()), retain_graph=True)
    if isinstance(G, nn.Module):
        G(z)  # a forward of the caller's in between: train-mode buffers step
    second = torch.autograd.grad(loss, list(y.values()))
    expected = naive_implicit(f_fit, reference, z, y_ref, w)
    zero = 1e-12 * float(expected[1].abs().max())  # at a zero residual the weights' leaf y["a"] gets round-off
    assert_close(first, expected, rtol=1e-9, atol=zero)
    assert_close(second, expected, rtol=1e-9, atol=zero)


# -- the pieces ---------------------------------------------------------------------------------------------------

def test_labels_name_each_leaf_as_messages_do():
    t = torch.zeros(1)
    assert input_labels("z", t) == ["z"]
    assert input_labels("z", (t, t)) == ["z[0]", "z[1]"]
    assert input_labels("y", {"a": t, "b": [t]}) == ["y's leaf 0 (y['a'])", "y's leaf 1 (y['b'][0])"]
