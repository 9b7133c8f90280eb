"""mixedad.z_curvature: the GGN and the Hessian in z, against torch.func.hessian / jacrev in float64."""
import math

import pytest
import torch
from torch import nn

import mixedad
from mixedad.profiling import peak_memory
from mixedad.testing import assert_close

from tests.curvature_problems import NAMES, F64, f_cubic, problem, reference_ggn, reference_hessian

REFERENCE = {"hessian": reference_hessian, "ggn": reference_ggn}


def flat(x):
    return torch.cat([t.reshape(-1) for t in (x if isinstance(x, tuple) else (x,))])


def like_z(z, seed=5):
    gen = torch.Generator().manual_seed(seed)
    if isinstance(z, tuple):
        return tuple(torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in z)
    return torch.randn(z.shape, generator=gen, dtype=z.dtype)


@pytest.mark.parametrize("keep_graph", [False, True])
@pytest.mark.parametrize("kind", ["hessian", "ggn"])
@pytest.mark.parametrize("name", NAMES)
def test_dense_and_matvec_against_torch_func(name, kind, keep_graph):
    f, G, z, y = problem(name)
    expected = REFERENCE[kind](f, G, z, y)
    op = mixedad.z_curvature(f, G, z, y, kind=kind, keep_graph=keep_graph)
    assert_close(op.dense(), expected, rtol=1e-10)
    u = like_z(z)
    product = op @ u
    assert type(product) is type(u) and flat(product).shape == flat(u).shape
    assert_close(flat(product), expected @ flat(u), rtol=1e-10)
    assert_close(flat(op.matvec(u)), flat(product), rtol=1e-14)


def test_the_ggn_drops_gs_curvature_and_the_hessian_keeps_it():
    f, G, z, y = problem("mlp")
    hessian, ggn = reference_hessian(f, G, z, y), reference_ggn(f, G, z, y)
    assert (hessian - ggn).abs().max() > 1e-3 * hessian.abs().max()  # the test can tell them apart


@pytest.mark.parametrize("segments", ["auto", 1, 2, 5])
@pytest.mark.parametrize("kind", ["hessian", "ggn"])
def test_every_segmentation_gives_the_same_operator(kind, segments):
    f, G, z, y = problem("mlp")
    op = mixedad.z_curvature(f, G, z, y, kind=kind, segments=segments)
    assert op.segments == (round(math.sqrt(len(G) / 2)) if segments == "auto" else segments)
    assert_close(op.dense(), REFERENCE[kind](f, G, z, y), rtol=1e-10)


def test_segments_as_callables_for_a_g_that_is_not_sequential():
    """G returns (image, z) for a prior on z: segments carry z along as a second tensor."""
    net = mixedad.zoo.mlp(4, 3, dtype=F64)
    G = lambda z: (net(z), z)  # noqa: E731
    segments = [lambda z: (net[:4](z), z), lambda h, z: (net[4:](h), z)]
    f, _, z, y = problem("image_and_z")
    for kind in ("hessian", "ggn"):
        op = mixedad.z_curvature(f, G, z, y, kind=kind, segments=segments)
        assert op.segments == 2
        assert_close(op.dense(), REFERENCE[kind](f, G, z, y), rtol=1e-10)


def test_segments_that_do_not_compose_to_g_are_refused():
    f, G, z, y = problem("mlp")
    with pytest.raises(ValueError, match="do not compose to G"):
        mixedad.z_curvature(f, G, z, y, segments=[G[:3]])


def test_damping_adds_lambda_times_u():
    f, G, z, y = problem("tuple_z")
    op = mixedad.z_curvature(f, G, z, y, kind="hessian", damping=0.7)
    expected = reference_hessian(f, G, z, y) + 0.7 * torch.eye(op.size, dtype=F64)
    assert_close(op.dense(), expected, rtol=1e-10)
    assert_close(op.trace(), expected.trace(), rtol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_diagonal_and_trace_exact(name):
    f, G, z, y = problem(name)
    op = mixedad.z_curvature(f, G, z, y, kind="ggn", damping=0.1)
    expected = reference_ggn(f, G, z, y) + 0.1 * torch.eye(op.size, dtype=F64)
    diagonal = op.diagonal()
    assert type(diagonal) is type(z)
    assert_close(flat(diagonal), expected.diagonal(), rtol=1e-10)
    trace = op.trace()
    assert trace.dim() == 0
    assert_close(trace, expected.trace(), rtol=1e-10)


def test_hutchinson_estimates_are_unbiased_within_their_standard_error():
    """Rademacher probes: Var(p^T H p) = 2 sum_{i != j} H_ij^2; the estimates sit within 4 standard errors."""
    f, G, z, y = problem("mlp")
    op = mixedad.z_curvature(f, G, z, y, kind="hessian")
    H = reference_hessian(f, G, z, y)
    samples = 400
    off = H - torch.diag(H.diagonal())
    trace = op.trace(samples=samples, generator=torch.Generator().manual_seed(0))
    assert abs(trace - H.trace()) <= 4 * math.sqrt(2 * (off ** 2).sum() / samples)
    diagonal = flat(op.diagonal(samples=samples, generator=torch.Generator().manual_seed(1)))
    errors = (diagonal - H.diagonal()).abs()
    assert (errors <= 4 * ((off ** 2).sum(1) / samples).sqrt() + 1e-12).all()
    # The same generator state gives the same estimate; the probes leave the global RNG alone.
    state = torch.get_rng_state()
    again = op.trace(samples=samples, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.get_rng_state(), state) and torch.equal(again, trace)


def test_matmat_pushes_k_vectors_at_once():
    f, G, z, y = problem("batchnorm_eval")
    op = mixedad.z_curvature(f, G, z, y, kind="hessian")
    U = torch.randn(3, *z.shape, dtype=F64)
    assert_close(op.matmat(U), torch.stack([op @ u for u in U]), rtol=1e-12)
    with pytest.raises(ValueError, match="leading dimension"):
        op.matmat(z)


def test_solve_reaches_the_tolerance():
    f, G, z, y = problem("tuple_z")
    op = mixedad.z_curvature(f, G, z, y, kind="ggn", damping=0.5)
    b = like_z(z)
    x = op.solve(b, tol=1e-10)
    A = reference_ggn(f, G, z, y) + 0.5 * torch.eye(op.size, dtype=F64)
    assert (A @ flat(x) - flat(b)).norm() <= 1e-10 * flat(b).norm() * 1.01
    assert op.last_solve.residual <= 1e-10 and op.last_solve.iterations <= op.size


def test_solve_warns_at_maxiter():
    f, G, z, y = problem("mlp")
    op = mixedad.z_curvature(f, G, z, y, kind="ggn", damping=1e-3)
    with pytest.warns(RuntimeWarning, match=r"\(maxiter=2\) with relative residual"):
        op.solve(like_z(z), tol=1e-12, maxiter=2)
    assert op.last_solve.iterations == 2


def test_solve_on_an_indefinite_hessian_breaks_down_with_a_clear_error():
    f, G, z, y = problem("mlp")
    op = mixedad.z_curvature(lambda y, g: -f_cubic(y, g), G, z, y, kind="hessian")
    with pytest.raises(mixedad.CurvatureError, match="not positive definite.*damping"):
        op.solve(like_z(z))


def test_bad_arguments():
    f, G, z, y = problem("mlp")
    with pytest.raises(ValueError, match="kind in"):
        mixedad.z_curvature(f, G, z, y, kind="fisher")
    with pytest.raises(ValueError, match="damping"):
        mixedad.z_curvature(f, G, z, y, damping=-1.0)
    with pytest.raises(TypeError, match="segments=3 slices an nn.Sequential"):
        mixedad.z_curvature(f, lambda z: G(z), z, y, segments=3)
    with pytest.raises(TypeError, match="segments"):
        mixedad.z_curvature(f, G, z, y, segments=[G, 3])
    op = mixedad.z_curvature(f, G, z, y)
    with pytest.raises(ValueError, match="samples"):
        op.trace(samples=0)
    with pytest.raises(ValueError, match="shape"):
        op @ torch.ones(5, dtype=F64)
    with pytest.raises(ValueError, match="tol"):
        op.solve(z, tol=0)


def test_dropout_and_train_mode_batchnorm_see_one_state_and_are_left_as_found():
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Dropout(0.3), nn.Tanh(), nn.Linear(6, 3)).to(F64).train()
    z, y = torch.randn(4, 3, dtype=F64), torch.randn(4, 3, dtype=F64)
    stats = [b.clone() for b in G[1].buffers()]
    rng = torch.get_rng_state()
    op = mixedad.z_curvature(f_cubic, G, z, y, kind="hessian")
    H = op.dense()
    assert_close(H, H.T, rtol=1e-10)  # one linear map: every product saw the same dropout masks
    assert_close(op.dense(), H, rtol=1e-14)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(stats, G[1].buffers()))
    assert G.training


def _anchor_matvec(f, G, z, y, u):
    """torchopt/JAXopt style: the gradient with create_graph once, then one backward per product."""
    z_work = z.detach().requires_grad_()
    (gradient,) = torch.autograd.grad(f(y, G(z_work)), z_work, create_graph=True)
    return torch.autograd.grad(gradient, z_work, u, retain_graph=True)[0]


def _ours(kind):
    return lambda f, G, z, y, u: mixedad.z_curvature(f, G, z, y, kind=kind) @ u


def _mlp_problem(depth):
    G = mixedad.zoo.mlp(depth, 64, seed=0).requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    z, y, u = (torch.randn(16, 64, generator=gen) for _ in range(3))
    return f_cubic, G, z, y, u


def test_product_peaks_against_the_anchor():
    """Exact bytes, float32 MLP of width 64: depth 8 and 32, the operator built and one product taken."""
    peaks = {}
    for depth in (8, 32):
        problem_ = _mlp_problem(depth)
        anchor_result, anchor = peak_memory(_anchor_matvec, *problem_)
        hessian_result, hessian = peak_memory(_ours("hessian"), *problem_)
        _, ggn = peak_memory(_ours("ggn"), *problem_)
        assert_close(hessian_result, anchor_result, rtol=1e-4)
        peaks[depth] = {"anchor": anchor, "hessian": hessian, "ggn": ggn}
    assert peaks[8]["ggn"] <= 0.45 * peaks[8]["anchor"], peaks
    assert peaks[32]["ggn"] <= 0.25 * peaks[32]["anchor"], peaks
    assert peaks[32]["hessian"] <= 0.40 * peaks[32]["anchor"], peaks
    for kind in ("ggn", "hessian"):
        assert peaks[32][kind] <= 2.2 * peaks[8][kind], peaks
    assert peaks[32]["anchor"] >= 3 * peaks[8]["anchor"]  # the anchor does grow with depth


def test_a_g_that_is_not_sequential_with_segments_meets_the_same_bounds_and_without_is_no_worse():
    """Depth 32 behind a lambda: one segment (no worse than the anchor), or segments= (the Sequential's bounds)."""
    from mixedad._curvature.segments import auto_count

    f, G, z, y, u = _mlp_problem(32)
    whole = lambda x: G(x)  # noqa: E731  (not an nn.Sequential: one segment unless told)
    count = auto_count(len(G))
    bounds = [round(i * len(G) / count) for i in range(count + 1)]
    segments = [G[a:b] for a, b in zip(bounds, bounds[1:])]
    _, anchor = peak_memory(_anchor_matvec, f, whole, z, y, u)
    for kind, bound in (("ggn", 0.25), ("hessian", 0.40)):
        _, alone = peak_memory(_ours(kind), f, whole, z, y, u)
        assert alone <= 1.05 * anchor, (kind, alone, anchor)
        _, segmented = peak_memory(lambda *a: mixedad.z_curvature(*a[:4], kind=kind, segments=segments) @ a[4],
                                   f, whole, z, y, u)
        assert segmented <= bound * anchor, (kind, segmented, anchor)


def _autograd_references(f, G, z, y):
    """Hessian and GGN by plain autograd (torch.func cannot run the zoo's custom Functions), math attention."""
    with mixedad.reference.differentiable_attention():
        hessian = torch.autograd.functional.hessian(lambda q: f(y, G(q)), z).reshape(z.numel(), z.numel())
        g = G(z).detach()
        J = torch.autograd.functional.jacobian(G, z).reshape(g.numel(), z.numel())
        Hg = torch.autograd.functional.hessian(lambda q: f(y, q), g).reshape(g.numel(), g.numel())
    return {"hessian": hessian, "ggn": J.T @ Hg @ J}


@pytest.mark.parametrize("kind", ["hessian", "ggn"])
@pytest.mark.parametrize("name", ["stylegan2_ada", "transformer_sdpa", "transformer_layer", "vq_decoder"])
def test_zoo_generators_with_custom_functions_attention_and_quantisers(name, kind):
    """Custom Functions without jvp or setup_context, fused attention (whose backward has no derivative: the
    sweeps take the math backend), a cdist quantiser: against plain autograd in float64."""
    G = mixedad.zoo.MEMBERS[name](dtype=F64, seed=0)
    z = torch.randn(mixedad.zoo.latent_shape(G, 1), generator=torch.Generator().manual_seed(0), dtype=F64)
    with torch.no_grad():
        y = torch.randn(G(z).shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    op = mixedad.z_curvature(f_cubic, G, z, y, kind=kind)
    assert_close(op.dense(), _autograd_references(f_cubic, G, z, y)[kind], rtol=1e-9)


# -- found by a review as a new user --------------------------------------------------------------------

def _train_mode_problem(layer):
    gen = torch.Generator().manual_seed(3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        G = nn.Sequential(nn.Linear(4, 6), layer, nn.Tanh(), nn.Linear(6, 3)).to(F64).train()
    z, y = torch.randn(5, 4, generator=gen, dtype=F64), torch.randn(5, 3, generator=gen, dtype=F64)
    return f_cubic, G, z, y


@pytest.mark.parametrize("kind", ["hessian", "ggn"])
@pytest.mark.parametrize("layer", ["dropout", "batchnorm"])
def test_keep_graph_sees_the_calls_random_state_and_buffers_and_leaves_them_alone(kind, layer):
    """keep_graph=True drew other dropout masks than the sweeps (relative error 0.9), and a train-mode BatchNorm
    crashed its first product (the kept graph had saved the running statistics restored in place)."""
    f, G, z, y = _train_mode_problem(nn.Dropout(0.5) if layer == "dropout" else nn.BatchNorm1d(6))
    buffers = {k: v.clone() for k, v in G.state_dict().items()}
    swept = mixedad.z_curvature(f, G, z, y, kind=kind).dense()
    kept = mixedad.z_curvature(f, G, z, y, kind=kind, keep_graph=True)
    assert_close(kept.dense(), swept, rtol=1e-10)
    assert_close(kept.dense(), swept, rtol=1e-10)  # again: the graph is still valid
    assert all(torch.equal(v, buffers[k]) for k, v in G.state_dict().items())


@pytest.mark.parametrize("kind", ["hessian", "ggn"])
def test_the_operators_methods_under_inference_mode(kind):
    """They returned only the damping term under torch.inference_mode (autograd is off there)."""
    f, G, z, y = problem("mlp")
    op = mixedad.z_curvature(f, G, z, y, kind=kind, damping=0.1)
    u = like_z(z)
    expected, dense = op @ u, op.dense()
    with torch.inference_mode():
        assert_close(op @ u, expected, rtol=1e-14)
        assert_close(op.dense(), dense, rtol=1e-14)
        inside = mixedad.z_curvature(f, G, z, y, kind=kind, damping=0.1)
        assert_close(inside.dense(), dense, rtol=1e-14)


def test_keywords_checked_with_clear_messages():
    f, G, z, y = problem("mlp")
    import numpy as np

    for damping in (np.float32(0.5), torch.tensor(0.5), 1):
        assert mixedad.z_curvature(f, G, z, y, damping=damping).damping == pytest.approx(float(damping))
    with pytest.raises(ValueError, match="finite number >= 0"):
        mixedad.z_curvature(f, G, z, y, damping=math.inf)
    op = mixedad.z_curvature(f, G, z, y)
    with pytest.raises(ValueError, match="finite number > 0, got 'a'"):
        op.solve(like_z(z), tol="a")
    with pytest.raises(ValueError, match="NaN or infinite"):
        op.solve(torch.full_like(z, math.nan))
    with pytest.raises(TypeError, match="torch.Generator"):
        op.trace(samples=2, generator=0)
    with pytest.raises(ValueError, match="z's dtype and device"):
        op.matmat(torch.zeros(2, *z.shape))  # float32
    assert op.matmat(torch.zeros(0, *z.shape, dtype=z.dtype)).shape == (0, *z.shape)
    with pytest.raises(ValueError, match="scalar"):
        mixedad.z_curvature(lambda y_, g: (g - y_) ** 2, G, z, y, kind="ggn")  # at construction, not first product


def test_a_singular_ggn_says_so():
    """A compressed-sensing shape (more latent dimensions than outputs), no damping: the GGN is singular."""
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(2, 6, generator=gen, dtype=F64)
    op = mixedad.z_curvature(lambda y, g: ((g - y) ** 2).sum(), lambda z: z @ A.T, torch.randn(6, generator=gen,
                             dtype=F64), torch.randn(2, generator=gen, dtype=F64), kind="ggn")
    with pytest.raises(mixedad.CurvatureError, match="Gauss-Newton matrix is only positive semi-definite"):
        op.solve(torch.randn(6, generator=gen, dtype=F64))


def test_keep_graph_saves_z_itself_unless_g_writes_its_input():
    """The kept graph holds no copy of z (its first op saves the caller's z's memory), where G does not write
    its input; a G that does gets a copy, exact, and the caller's z is left as it was."""
    f = lambda y, g: ((g - y) ** 2).sum() + (torch.sin(g) * y).sum()  # noqa: E731
    gen = torch.Generator().manual_seed(2)
    z, y = torch.randn(3, 4, generator=gen, dtype=F64), torch.randn(3, 4, generator=gen, dtype=F64)
    G = nn.Sequential(nn.Softplus(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).to(F64)  # softplus saves its input
    saved = []

    def pack(t):
        saved.append(t.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mixedad.z_curvature(f, G, z, y, kind="ggn", keep_graph=True)
    assert z.data_ptr() in saved  # the first op saved z itself, not a copy
    writes = nn.Sequential(nn.ReLU(inplace=True), *G)
    z_before = z.clone()
    op = mixedad.z_curvature(f, writes, z, y, kind="hessian", keep_graph=True)
    assert op._chain.writes[0] and torch.equal(z, z_before)
    assert_close(op.dense(), torch.func.hessian(lambda q: f(y, writes(q.clone())))(z).reshape(12, 12), rtol=1e-10)
    assert torch.equal(z, z_before)


class _WritesItsInputWithGrad(nn.Module):
    def forward(self, x):
        if torch.is_grad_enabled():
            with torch.no_grad():
                x.mul_(1.0)
        return torch.tanh(x)


def test_keep_graph_refuses_a_g_that_writes_its_input_only_with_grad():
    f = lambda y, g: ((g - y) ** 2).sum()  # noqa: E731
    z, y = torch.randn(3, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    with pytest.raises(RuntimeError, match=r"^z_curvature\(f, G, z, y\): G wrote its input z in place with grad"):
        mixedad.z_curvature(f, _WritesItsInputWithGrad(), z, y, keep_graph=True)
