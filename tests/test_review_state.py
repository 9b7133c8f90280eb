"""Review: state that a pass replays or caches, random sources, user rules, inputs written, caches.

A review as a new user of "State that a pass replays or caches" (docs/semantics.md, DESIGN.md):
every call that runs G more than once must see what the first pass saw, leave every random source
as one plain forward leaves it, refuse state that moved between build and use, check user rules
for every kind of op and every pattern of tangent-carrying arguments, write nothing the caller
passed (where G writes its input, G writes mixedad's copy), and key its caches on what changes.

Every situation is a row of the table: a small builder (float64, tiny) that returns G, f, z, y, v
and a sequence of steps: calls of mixedad (``mixed_grad``, a ``vmap`` over its tangent,
``mixed_jacobian``, ``input_grad`` forward and backward, ``z_curvature`` products, ``implicit_grad``,
``implicit_argmin`` forward and backward, ``cached_backward``, ``tangent_report``) and things the
user does between them (write a weight in place, swap a module, register a rule, ...). Each call
has its naive twin, written in tests/review_state_common.py (with the harness this file shares with
tests/test_review_state_more.py) and not from ``mixedad.reference``:
``torch.autograd.grad(torch.autograd.grad(f(y, G(z)), z, create_graph=True)[0], y, v)`` and its
kin, one plain forward of G per call (per chunk for ``input_grad``). This file holds the cases.

The case is built twice from the same seeds: one copy runs the naive sequence, the other
mixedad's, from the same global random states (torch's CPU generator, Python's ``random``,
NumPy's global generator; G's own ``torch.Generator``s are built with the copy). Verdicts:

- ``exact``: every call's result equals its naive twin's, relative error < 1e-9 (float64);
- ``refused``: a step raises an error of mixedad's own (the message opens with the public call,
  ``input_grad(...``, ``z_curvature(...``) that matches the case's regex;
- ``warns``: exact, and a warning matching the case's regex was given.

After every case, whatever the verdict, these must hold (a "leak" otherwise): torch's global RNG,
Python's random state, NumPy's global state and each generator G uses end where the naive
sequence leaves them; module buffers, parameters, training flags and plain attributes (numbers,
strings) as the naive sequence leaves them; the caller's v, y and the tensors the steps pass (W, u,
V) unchanged, z as the naive sequence leaves it (unchanged: naive code hands a G that writes its
input a copy), and ``cached_backward``'s inputs too; no torch function or dispatch mode, forward-AD
level, functorch level or changed grad mode left behind, no torch attribute patched; no right rule
rejected; and each step's own checks (a user rule's calls counted, what ``tangent_report`` says).

``python -m tests.test_review_state`` prints a table of the verdicts now.
"""
import random
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

import mixedad

from tests.review_state_common import (DAMPING, DT, MUL_ARGS, RTOL, SHARED_ROUTES, TANH_ARGS, WRONG_WARNING, Call,
                                       Check, Do, Review, codes, counted, f_imp, f_vec, first_tangent, forget, ig,
                                       igamma_tail, lin, mat, mul_rule, no_grad_do, problem, register_step, seq_mlp,
                                       seq_tanh, tanh_G, tanh_rule, unregister_step, used, W_like)
from tests.seams_common import check

#: Errors of mixedad's own open with one of the public calls this review makes.
OWN_ERROR = re.compile(r"^\s*(mixed_grad|input_grad|mixed_jacobian|z_curvature|implicit_grad|implicit_argmin|"
                       r"cached_backward|tangent_report)\(")
REVIEW = Review(OWN_ERROR)
CASES, case = REVIEW.cases, REVIEW.case

pytestmark = pytest.mark.filterwarnings("ignore")

# ----------------------------------------------------------------------------------------------
# The case table: G, f and the routes this review tries them with
# ----------------------------------------------------------------------------------------------

def f_dict(y, g):
    """f for a dict y {"a": (4,), "b": (2,)}."""
    return (torch.sin(g * y["a"]) + g.pow(3) * y["a"]).sum() + (g[..., :2] ** 2 * y["b"].exp()).sum()


#: The routes G is tried with, by name: calls that run G more than once in mixedad (a restart, a replay, products),
#: or several calls in a row. Here a vmap over v keeps vmap's default randomness="error" (a G that draws is
#: vmapped with randomness="same" by its own case), and a GGN operator takes a product and a matmat.
ROUTES = {
    **SHARED_ROUTES,
    "mg_twice": lambda z: [Call("mg"), Call("mg")],
    "vmap": lambda z: [Call("vmap", V=torch.randn(3, *z.shape, dtype=DT))],
    "compile": lambda z: [Call("mg", compile=True) for _ in range(3)],
    "curv_dense": lambda z: [Call("curv", kind="hessian"), Call("dense")],
    "curv_ggn": lambda z: [Call("curv", kind="ggn"), Call("matvec", u=W_like(z)), Call("matmat", U=torch.randn(
        2, *z.shape, dtype=DT))],
}


# ----------------------------------------------------------------------------------------------
# Area 1: random sources, replayed and left as one plain forward leaves them
# ----------------------------------------------------------------------------------------------

def draw(source, gens):
    """h -> h with a random draw from ``source`` (G's generators are ``gens``)."""

    def apply(h):
        if source == "global":
            return h + 0.3 * torch.randn(h.shape, dtype=DT)
        if source == "global_dropout":
            return F.dropout(h, 0.4, training=True)
        if source == "gen_randn":
            return h + 0.3 * torch.randn(h.shape, generator=gens[0], dtype=DT)
        if source == "gen_bernoulli":
            return h * torch.bernoulli(torch.full(h.shape, 0.6, dtype=DT), generator=gens[0]) / 0.6
        if source == "gen_randperm":
            return h[..., torch.randperm(h.shape[-1], generator=gens[0])]
        if source == "gen_rand_mask":  # a dropout-like mask made with a generator
            return h * (torch.rand(h.shape, generator=gens[0], dtype=DT) < 0.6).to(DT) / 0.6
        if source == "gen_normal":
            return torch.normal(h, 0.2, generator=gens[0]) * torch.tanh(h)
        if source == "gen_multinomial":
            idx = torch.multinomial(torch.ones(h.shape[-1], dtype=DT), h.shape[-1], replacement=True,
                                    generator=gens[0])
            return h[..., idx]
        if source == "two_gens":
            noisy = h + 0.3 * torch.randn(h.shape, generator=gens[0], dtype=DT)
            return noisy * torch.bernoulli(torch.full(h.shape, 0.7, dtype=DT), generator=gens[1])
        if source == "python":
            return h * (0.5 + random.random()) + 0.1 * random.gauss(0.0, 1.0)
        if source == "python_shuffle":
            perm = list(range(h.shape[-1]))
            random.shuffle(perm)
            return h[..., perm]
        if source == "numpy":
            return h * torch.from_numpy(np.random.rand(*h.shape) + 0.5)
        if source == "numpy_scale":
            return h * float(np.random.rand() + 0.5)
        raise AssertionError(source)

    return apply


def generators_for(source):
    n = 2 if source == "two_gens" else 1 if source.startswith("gen_") else 0
    return [torch.Generator().manual_seed(1234 + i) for i in range(n)]


def random_G(source, tail=None):
    """A plain function G: tanh(z W1), a draw, then ``tail`` (a linear map by default)."""
    gens = generators_for(source)
    W1, W2 = mat(3, 6), mat(6, 4)
    noise = draw(source, gens)

    def G(q):
        h = noise(torch.tanh(q @ W1))
        return (h @ W2) if tail is None else tail(h)

    return G, gens


class Noisy(nn.Module):
    """A module that draws in its forward; a generator it holds, or a global source."""

    def __init__(self, source):
        super().__init__()
        self.l1, self.l2 = lin(3, 6), lin(6, 4)
        self.source = source
        self.gens = generators_for(source)
        self.gen = self.gens[0] if self.gens else None  # a generator held on the module

    def forward(self, q):
        return self.l2(draw(self.source, self.gens)(torch.tanh(self.l1(q))))


def grid_sample_tail(W3):
    """grid_sample: an op in NO_FORMULA (the local rule, no restart)."""
    grid = torch.rand(1, 2, 2, 2, dtype=DT) * 2 - 1

    def tail(h):
        img = h.reshape(h.shape[0], 1, 2, 3)
        out = F.grid_sample(img, grid.expand(h.shape[0], -1, -1, -1), align_corners=False)
        return out.reshape(h.shape[0], 4) @ W3

    return tail


def hook_tail(W2):
    """An identity gradient hook: the whole-G fallback."""

    def tail(h):
        if h.requires_grad:
            h.register_hook(lambda grad: grad)
        return torch.tanh(h) @ W2

    return tail


def autograd_grad_tail(W2):
    """torch.autograd.grad inside G, on a private leaf: the whole-G fallback."""

    def tail(h):
        with torch.enable_grad():
            s = torch.tensor(0.7, dtype=DT, requires_grad=True)
            (ds,) = torch.autograd.grad((s ** 2).sum(), s)
        return torch.tanh(h * ds.detach()) @ W2

    return tail


def noisy_function(source, gens):
    """A custom Function without jvp that draws inside its forward; a new class each time (first use)."""
    noise = draw(source, gens)

    class NoisySine(Function):
        @staticmethod
        def forward(ctx, x):
            m = noise(torch.ones_like(x))
            ctx.save_for_backward(x, m)
            return torch.sin(x) * m

        @staticmethod
        def backward(ctx, grad):
            x, m = ctx.saved_tensors
            return grad * torch.cos(x) * m

    return NoisySine


def _random_case(source, call, *, tail=None, module=False, name=None, f=None, pre=()):
    def build():
        if module:
            G = Noisy(source)
            gens = G.gens
        else:
            t = None if tail is None else tail()
            G, gens = random_G(source, t)
        z = codes()
        return problem(G, z, [*pre, *ROUTES[call](z)], gens=gens,
                       f=f or (f_imp if call in ("implicit", "argmin") else f_vec))

    build.__name__ = name or f"{source}__{call}{'__module' if module else ''}"
    case("random sources")(build)


for _source, _calls in {
    "gen_randn": ["mg", "ig", "ig_chunk", "mj", "curv", "curv_dense", "implicit", "argmin"],
    "gen_bernoulli": ["ig_chunk", "mj", "curv_ggn"],
    "gen_randperm": ["ig", "mj", "argmin"],
    "gen_rand_mask": ["ig", "curv"],
    "gen_normal": ["ig_chunk"],
    "gen_multinomial": ["ig_chunk"],
    "two_gens": ["ig_chunk", "mj"],
    "python": ["mg", "ig", "ig_chunk", "mj", "curv", "implicit"],
    "python_shuffle": ["ig_chunk"],
    "numpy": ["ig", "ig_chunk", "mj", "curv_dense"],
    "numpy_scale": ["argmin"],
    "global": ["ig_chunk", "curv", "argmin"],
    "global_dropout": ["ig", "mj"],
}.items():
    for _call in _calls:
        _random_case(_source, _call)

for _source, _call in [("gen_randn", "ig_chunk"), ("gen_bernoulli", "mj"), ("gen_rand_mask", "curv")]:
    _random_case(_source, _call, module=True)

# a pass restarted on an op without a forward-AD formula (torch.igamma); the failure is forgotten first
for _source in ["gen_randn", "gen_bernoulli", "python", "numpy", "global"]:
    _random_case(_source, "mg", tail=lambda: igamma_tail(mat(6, 4)), pre=[forget()],
                 name=f"{_source}__restart_igamma")
_random_case("gen_randn", "ig_chunk", tail=lambda: igamma_tail(mat(6, 4)), pre=[forget()],
             name="gen_randn__restart_igamma__ig_chunk")
# an op of NO_FORMULA (grid_sample): the local rule, one pass
_random_case("gen_randn", "mg", tail=lambda: grid_sample_tail(mat(4, 4)), name="gen_randn__no_formula_grid_sample")
_random_case("gen_randn", "ig", tail=lambda: grid_sample_tail(mat(4, 4)),
             name="gen_randn__no_formula_grid_sample__ig")
# the whole-G fallback: a gradient hook, torch.autograd.grad inside G
for _source in ["gen_randn", "gen_bernoulli", "python", "numpy"]:
    _random_case(_source, "mg", tail=lambda: hook_tail(mat(6, 4)), name=f"{_source}__hook_fallback")
for _source in ["gen_randn", "numpy_scale"]:
    _random_case(_source, "mg", tail=lambda: autograd_grad_tail(mat(6, 4)), name=f"{_source}__autograd_grad_fallback")
_random_case("gen_randn", "ig_chunk", tail=lambda: hook_tail(mat(6, 4)), name="gen_randn__hook_fallback__ig_chunk")


def _function_case(source, call):
    def build():
        gens = generators_for(source)
        Fn = noisy_function(source, gens)
        W1, W2 = mat(3, 6), mat(6, 4)
        G = lambda q: Fn.apply(q @ W1) @ W2  # noqa: E731
        z = codes()
        return problem(G, z, ROUTES[call](z), gens=gens)

    build.__name__ = f"{source}__custom_function_first_use__{call}"
    case("random sources")(build)


for _source, _call in [("gen_bernoulli", "mg"), ("gen_randn", "mg"), ("python", "mg"), ("numpy", "mg"),
                       ("global", "mg"), ("gen_bernoulli", "ig_chunk")]:
    _function_case(_source, _call)


#: What the warning of a compile=True call on a G that draws must name (not "the program differs").
_DRAW_NAMED = {"python": r"random", "numpy_scale": r"NumPy|np\.random", "gen_randn": r"random|generator",
               "global": r"random|draw"}


def _compile_case(source, expect="warns"):
    def build():
        G = Noisy(source)
        z = codes()
        return problem(G, z, [Call("mg", compile=True) for _ in range(3)], gens=G.gens)

    build.__name__ = f"{source}__compile_three_calls"
    # Runs eager, with a warning naming the draw; exact on every call.
    case("random sources", expect=expect, match=r"compile=True.*(" + _DRAW_NAMED[source] + ")",
         not_match=r"differs from the eager pass")(build)


for _source in ["python", "numpy_scale", "gen_randn", "global"]:
    _compile_case(_source)


class NoisyMap(nn.Module):
    """f of cached_backward: one input (3,) to (4,), with a draw."""

    def __init__(self, source):
        super().__init__()
        self.l1, self.l2 = lin(3, 6), lin(6, 4)
        self.gens = generators_for(source)
        self.noise = draw(source, self.gens)

    def forward(self, x):
        return self.l2(self.noise(torch.tanh(self.l1(x))))


def _cached_case(source):
    def build():
        fc = NoisyMap(source)
        inputs = [torch.randn(3, dtype=DT) for _ in range(4)]
        p = problem(fc, codes(), [Call("cached", chunk_size=2)], gens=fc.gens)
        p.inputs = inputs
        p.g_of = lambda Z: (Z ** 2).sum() + torch.sin(Z).sum()
        return p

    build.__name__ = f"{source}__cached_backward"
    case("random sources")(build)


for _source in ["gen_randn", "python", "numpy", "global"]:
    _cached_case(_source)


@case("random sources")
def gen_randn__sequential_custom_module_five_calls():
    """A custom module holding a generator inside an nn.Sequential: per-op pass on every call."""
    inner = Noisy("gen_randn")
    G = nn.Sequential(inner, nn.Tanh(), lin(4, 4))
    return problem(G, codes(), [Call("mg") for _ in range(5)], gens=inner.gens)


@case("random sources")
def gen_randn__vmap_randomness_same():
    """A vmap over v of a G drawing from a generator (vmap's randomness="same"): one plain forward's draw."""
    G, gens = random_G("gen_randn")
    z = codes()
    return problem(G, z, [Call("vmap", V=torch.randn(3, *z.shape, dtype=DT), randomness="same")], gens=gens)


# ----------------------------------------------------------------------------------------------
# Area 2: state changed between build and use raises (and mixedad's own replays do not)
# ----------------------------------------------------------------------------------------------


def _ig_change(name, change, match, chunk=None, norm=None, expect="refused", user_writes_z=False):
    def build():
        G = seq_mlp(norm)
        z = codes()
        return problem(G, z, [Call("ig_fwd", chunk=chunk), no_grad_do(change), Call("ig_bwd", W=W_like(z))],
                       user_writes_z=user_writes_z)

    build.__name__ = name
    case("versions", expect=expect, match=match)(build)


_ig_change("ig_weight_mul_inplace_before_backward", lambda p: p.G[0].weight.mul_(1.1),
           r"^input_grad\(.*0\.weight")
_ig_change("ig_chunks_weight_mul_inplace_before_backward", lambda p: p.G[0].weight.mul_(1.1),
           r"^input_grad\(.*0\.weight", chunk=2)
_ig_change("ig_last_weight_copy_inplace_before_backward", lambda p: p.G[2].weight.copy_(torch.randn(4, 6, dtype=DT)),
           r"^input_grad\(.*2\.weight")
# Debatable: naive double backward does not save a Linear's bias, so it answers with the bias of the
# forward; mixedad's backward replays G, and a replay with the new bias would mix states. Refusing,
# naming the parameter, is the honest answer here.
_ig_change("ig_bias_add_inplace_before_backward", lambda p: p.G[0].bias.add_(0.3), r"^input_grad\(.*0\.bias")
_ig_change("ig_eval_bn_running_mean_inplace_before_backward", lambda p: p.G[1].running_mean.add_(0.5),
           r"^input_grad\(.*1\.running_mean", norm="bn_eval")
# Values back where they were, but the version moved, as autograd sees it: autograd refuses too.
_ig_change("ig_weight_changed_and_changed_back", lambda p: (p.G[0].weight.mul_(2.0), p.G[0].weight.div_(2.0)),
           r"^input_grad\(.*0\.weight")
_ig_change("ig_z_written_inplace_before_backward", lambda p: p.z.add_(0.1), r"^input_grad\(.*\bz\b",
           user_writes_z=True)


@case("versions", expect="refused", match=r"^input_grad\(.*0\.weight")
def ig_weight_optimizer_step_before_backward():
    G = seq_mlp()
    z = codes()

    def step(p):
        for q in p.G.parameters():
            q.grad = torch.ones_like(q)
        torch.optim.SGD(p.G.parameters(), lr=0.05).step()
        for q in p.G.parameters():
            q.grad = None

    return problem(G, z, [Call("ig_fwd"), Do(step), Call("ig_bwd", W=W_like(z))])


@case("versions", expect="refused", match=r"^input_grad\(")
def ig_closure_tensor_inplace_before_backward():
    W1, W2 = mat(3, 6), mat(6, 4)
    z = codes()
    p = problem(lambda q: torch.tanh(q @ W1) @ W2, z, [Call("ig_fwd", chunk=2), None, Call("ig_bwd", W=W_like(z))])
    p.steps[1] = no_grad_do(lambda _: W1.mul_(1.2))
    return p


@case("versions", expect="refused", match=r"^input_grad\(.*\by\b")
def ig_y_written_inplace_before_backward():
    G = seq_mlp()
    z = codes()
    return problem(G, z, [Call("ig_fwd"), no_grad_do(lambda p: p.ctx["yl"][0].mul_(1.5)),
                          Call("ig_bwd", W=W_like(z))])


# Not in place: G's parameter replaced by a new one. Double backward's graph holds the old one and
# answers with it; a mixedad error is honest too.
@case("versions", expect="exact|refused", match=r"^input_grad\(.*0\.weight")
def ig_weight_replaced_before_backward():
    G = seq_mlp()
    z = codes()

    def swap(p):
        p.G[0].weight = nn.Parameter(torch.randn(6, 3, dtype=DT))

    return problem(G, z, [Call("ig_fwd"), Do(swap), Call("ig_bwd", W=W_like(z))])


@case("versions", expect="refused", match=r"^input_grad\(.*0\.weight")
def ig_retain_graph_then_weight_changed_then_backward():
    G = seq_mlp()
    z = codes()
    W = W_like(z)
    return problem(G, z, [Call("ig_fwd", chunk=2), Call("ig_bwd", W=W, retain=True),
                          no_grad_do(lambda p: p.G[0].weight.mul_(0.9)), Call("ig_bwd", W=W)])


@case("versions")
def ig_weight_changed_after_backward_then_new_call():
    G = seq_mlp()
    z = codes()
    return problem(G, z, [*ig(2, W=W_like(z)), no_grad_do(lambda p: p.G[0].weight.mul_(1.3)), *ig(2, W=W_like(z))])


@case("versions")
def ig_train_batchnorm_chunks_no_raise():
    G = seq_mlp("bn_train")
    z = codes()
    return problem(G, z, ig(2, W=W_like(z)))


@case("versions")
def ig_train_batchnorm_retain_graph_twice_no_raise():
    G = seq_mlp("bn_train")
    z = codes()
    W = W_like(z)
    return problem(G, z, [Call("ig_fwd", chunk=2), Call("ig_bwd", W=W, retain=True), Call("ig_bwd", W=W)])


@case("versions")
def ig_spectral_norm_train_no_raise():
    G = nn.Sequential(nn.utils.parametrizations.spectral_norm(lin(3, 6)), nn.Tanh(), lin(6, 4))
    z = codes()
    return problem(G, z, ig(2, W=W_like(z)))


@case("versions")
def ig_dropout_train_retain_graph_twice_no_raise():
    G = nn.Sequential(lin(3, 6), nn.Tanh(), nn.Dropout(0.3), lin(6, 4))
    z = codes()
    W = W_like(z)
    return problem(G, z, [Call("ig_fwd"), Call("ig_bwd", W=W, retain=True), Call("ig_bwd", W=W)])


def _curv_change(name, change, match, norm=None, keep_graph=False):
    def build():
        G = seq_mlp(norm)
        z = codes()
        return problem(G, z, [Call("curv", kind="hessian", keep_graph=keep_graph), Call("matvec", u=W_like(z)),
                              no_grad_do(change), Call("matvec", u=W_like(z))])

    build.__name__ = name
    case("versions", expect="refused", match=match)(build)


_curv_change("curv_weight_mul_inplace_between_products", lambda p: p.G[0].weight.mul_(1.1),
             r"^z_curvature\(.*0\.weight")
_curv_change("curv_keep_graph_weight_mul_inplace_between_products", lambda p: p.G[2].weight.mul_(1.1),
             r"^z_curvature\(.*2\.weight", keep_graph=True)
_curv_change("curv_eval_bn_running_var_inplace_between_products", lambda p: p.G[1].running_var.mul_(2.0),
             r"^z_curvature\(.*1\.running_var", norm="bn_eval")


@case("versions")  # buffers as one plain train-mode forward leaves them: see the note on z_curvature above
def curv_train_batchnorm_repeated_use_no_raise():
    G = seq_mlp("bn_train")
    z = codes()
    return problem(G, z, [Call("curv", kind="hessian"), Call("matvec", u=W_like(z)), Call("matvec", u=W_like(z)),
                          Call("dense")])


@case("versions")
def curv_spectral_norm_train_repeated_use_no_raise():
    G = nn.Sequential(nn.utils.parametrizations.spectral_norm(lin(3, 6)), nn.Tanh(), lin(6, 4))
    z = codes()
    return problem(G, z, [Call("curv", kind="ggn"), Call("matvec", u=W_like(z)), Call("matvec", u=W_like(z))])


@case("versions")
def curv_weight_changed_then_new_operator():
    G = seq_mlp()
    z = codes()
    return problem(G, z, [Call("curv", kind="hessian"), Call("matvec", u=W_like(z)),
                          no_grad_do(lambda p: p.G[0].weight.mul_(1.2)), Call("curv", kind="hessian"),
                          Call("matvec", u=W_like(z))])


def _argmin_change(name, change, match, user_writes_z=False):
    def build():
        G = seq_mlp()
        z = codes()
        return problem(G, z, [Call("argmin_fwd", damping=DAMPING), no_grad_do(change),
                              Call("argmin_bwd", W=W_like(z))], f=f_imp, user_writes_z=user_writes_z)

    build.__name__ = name
    case("versions", expect="refused", match=match)(build)


_argmin_change("argmin_z_star_written_before_backward", lambda p: p.z.add_(0.2), r"^implicit_argmin\(.*z_star",
               user_writes_z=True)
_argmin_change("argmin_y_written_before_backward", lambda p: p.ctx["yl"][0].mul_(1.5), r"^implicit_argmin\(.*\by\b")
_argmin_change("argmin_weight_written_before_backward", lambda p: p.G[0].weight.mul_(1.1),
               r"^implicit_argmin\(.*0\.weight")


# ----------------------------------------------------------------------------------------------
# Area 3: user rules, checked for every kind of op, every tangent pattern, on every route
# ----------------------------------------------------------------------------------------------

@torch.library.custom_op("mixedad_review_state::scaled_sin", mutates_args=())
def _scaled_sin(x: torch.Tensor) -> torch.Tensor:
    return 2 * torch.sin(x)


@_scaled_sin.register_fake
def _(x):
    return torch.empty_like(x)


def _scaled_sin_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _scaled_sin_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return 2 * torch.cos(x) * grad


_scaled_sin.register_autograd(_scaled_sin_backward, setup_context=_scaled_sin_setup)
LIB_OP = torch.ops.mixedad_review_state.scaled_sin


def scaled_tanh_function():
    class ScaledTanh(Function):  # a third-party op without jvp
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return 3 * torch.tanh(x)

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * 3 * (1 - torch.tanh(x) ** 2)

    return ScaledTanh


def sin_rule(scale, factor=1.0):
    """For sin(x) times ``factor``: right at scale 1."""

    def sin_tangent(op):
        x, dx = first_tangent(op)
        return op.primal(), scale * factor * torch.cos(x) * dx

    sin_tangent.__qualname__ = "right_sin_tangent" if scale == 1 else "wrong_sin_tangent"
    return sin_tangent


def linear_rule(scale):
    def linear_tangent(op):
        dx = op.tangents["input"]
        return op.primal(), scale * F.linear(dx, op.primals["weight"])

    linear_tangent.__qualname__ = "right_linear_tangent" if scale == 1 else "wrong_linear_tangent"
    return linear_tangent


LINEAR_ARGS = ("input", "weight", "bias")


def report_says(op_name, path, absent=False):
    def check(p):
        report = p.ctx.get("report")
        if report is None:
            return ["no report"]
        ops = report.ops(path)
        found = any(op_name in o for o in ops)
        if found == absent:
            return [f"tangent_report: {op_name!r} {'listed' if absent else 'not listed'} under {path!r}: "
                    f"{path}: {ops}; report:\n{report}"]
        return []

    return Check(check)


#: A rejected rule's warning: a RuntimeWarning that names the rule and gives both numbers of the dot-product test.


def _wrong_rule_case(name, build_G, op, rule, arguments, route, warn_name):
    def build():
        G = build_G()
        z = codes()
        steps = [register_step(op, lambda p: rule, arguments), *ROUTES[route](z)]
        return problem(G, z, steps)

    build.__name__ = name
    case("user rules", expect="warns", match=WRONG_WARNING.format(warn_name))(build)


_wrong_rule_case("wrong_rule_torch_tanh_plain_G", tanh_G, torch.tanh, tanh_rule(2.0), TANH_ARGS, "mg",
                 "wrong_tanh_tangent")
_wrong_rule_case("wrong_rule_torch_tanh_sequential_five_calls", seq_tanh, torch.tanh, tanh_rule(2.0), TANH_ARGS,
                 "five", "wrong_tanh_tangent")
_wrong_rule_case("wrong_rule_torch_tanh_vmap", tanh_G, torch.tanh, tanh_rule(2.0), TANH_ARGS, "vmap",
                 "wrong_tanh_tangent")
_wrong_rule_case("wrong_rule_torch_tanh_mixed_jacobian", tanh_G, torch.tanh, tanh_rule(2.0), TANH_ARGS, "mj",
                 "wrong_tanh_tangent")
_wrong_rule_case("wrong_rule_torch_tanh_input_grad_chunks", tanh_G, torch.tanh, tanh_rule(2.0), TANH_ARGS, "ig_chunk",
                 "wrong_tanh_tangent")
_wrong_rule_case("wrong_rule_F_linear_sequential_five_calls", seq_tanh, F.linear, linear_rule(0.5), LINEAR_ARGS,
                 "five", "wrong_linear_tangent")
_wrong_rule_case("wrong_rule_library_op", lambda: (lambda W1, W2: (lambda q: LIB_OP(q @ W1) @ W2))(
    mat(3, 6), mat(6, 4)), LIB_OP, sin_rule(3.0, 2.0), None, "mg", "wrong_sin_tangent")
_wrong_rule_case("wrong_rule_library_op_input_grad_chunks", lambda: (lambda W1, W2: (lambda q: LIB_OP(q @ W1) @ W2))(
    mat(3, 6), mat(6, 4)), LIB_OP, sin_rule(3.0, 2.0), None, "ig_chunk", "wrong_sin_tangent")
_wrong_rule_case("wrong_rule_library_op_vmap", lambda: (lambda W1, W2: (lambda q: LIB_OP(q @ W1) @ W2))(
    mat(3, 6), mat(6, 4)), LIB_OP, sin_rule(3.0, 2.0), None, "vmap", "wrong_sin_tangent")
_wrong_rule_case("wrong_rule_aten_sin", lambda: (lambda W1, W2: (lambda q: torch.ops.aten.sin(q @ W1) @ W2))(
    mat(3, 6), mat(6, 4)), torch.ops.aten.sin, sin_rule(2.0), None, "mg", "wrong_sin_tangent")
_wrong_rule_case("wrong_rule_aten_sin_mixed_jacobian", lambda: (lambda W1, W2: (
    lambda q: torch.ops.aten.sin(q @ W1) @ W2))(mat(3, 6), mat(6, 4)), torch.ops.aten.sin, sin_rule(2.0), None, "mj",
    "wrong_sin_tangent")


def _mul_wrong_in_a(op):
    """For ``(q @ W1).mul(c)``: the term of the argument that carries the tangent, doubled."""
    b, da = op.primals["other"], op.tangents["input"]
    return op.primal(), 2 * da * b


_mul_wrong_in_a.__qualname__ = "mul_tangent_wrong_in_a"
_wrong_rule_case("wrong_rule_tensor_mul_method", lambda: (lambda W1, W2, c: (lambda q: (q @ W1).mul(c) @ W2))(
    mat(3, 6), mat(6, 4), torch.randn(6, dtype=DT)), torch.Tensor.mul, _mul_wrong_in_a, MUL_ARGS, "mg",
    "mul_tangent_wrong_in_a")


def _function_G(Fn):
    W1, W2 = mat(3, 6), mat(6, 4)
    return lambda q: Fn.apply(q @ W1) @ W2


def _wrong_function_rule(route):
    def build():
        Fn = scaled_tanh_function()
        G = _function_G(Fn)
        z = codes()
        steps = [register_step(Fn, lambda p: tanh_rule(2.0)), *ROUTES[route](z)]
        return problem(G, z, steps)

    build.__name__ = f"wrong_rule_custom_function__{route}"
    case("user rules", expect="warns", match=WRONG_WARNING.format("wrong_tanh_tangent"))(build)


for _route in ["mg", "vmap", "mj"]:
    _wrong_function_rule(_route)


class TanhNet(nn.Module):
    """Not a Sequential: compile=True traces it."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = lin(3, 6), lin(6, 4)

    def forward(self, q):
        return self.l2(torch.tanh(self.l1(q)))


@case("user rules", expect="warns", match=WRONG_WARNING.format("wrong_tanh_tangent"))
def wrong_rule_torch_tanh_compile():
    G = TanhNet()
    z = codes()
    return problem(G, z, [register_step(torch.tanh, lambda p: tanh_rule(2.0), TANH_ARGS), *ROUTES["compile"](z)])


def _right_rule_case(name, build_G, op, rule, arguments, route, report_name=None):
    def build():
        G = build_G()
        z = codes()
        steps = [register_step(op, lambda p: rule, arguments)]
        for step in ROUTES[route](z):
            if step.kind != "ig_fwd":  # input_grad's forward is a reverse pass: the rule runs in its backward
                step.opts.update(used())
            steps.append(step)
        if report_name:
            steps += [Call("report"), report_says(report_name, "user rule")]
        return problem(G, z, steps)

    build.__name__ = name
    case("user rules")(build)


_right_rule_case("right_rule_torch_tanh_plain_G", tanh_G, torch.tanh, tanh_rule(1.0), TANH_ARGS, "mg", "tanh")
_right_rule_case("right_rule_torch_tanh_sequential_five_calls", seq_tanh, torch.tanh, tanh_rule(1.0), TANH_ARGS,
                 "five", "tanh")
_right_rule_case("right_rule_torch_tanh_vmap", tanh_G, torch.tanh, tanh_rule(1.0), TANH_ARGS, "vmap")
_right_rule_case("right_rule_torch_tanh_mixed_jacobian", tanh_G, torch.tanh, tanh_rule(1.0), TANH_ARGS, "mj")
_right_rule_case("right_rule_torch_tanh_compile", TanhNet, torch.tanh, tanh_rule(1.0), TANH_ARGS, "compile", "tanh")
_right_rule_case("right_rule_F_linear_sequential_five_calls", seq_tanh, F.linear, linear_rule(1.0), LINEAR_ARGS,
                 "five", "linear")
_right_rule_case("right_rule_library_op_plain_G", lambda: (lambda W1, W2: (lambda q: LIB_OP(q @ W1) @ W2))(
    mat(3, 6), mat(6, 4)), LIB_OP, sin_rule(1.0, 2.0), None, "mg", "scaled_sin")
_right_rule_case("right_rule_sequential_input_grad_chunks", seq_tanh, torch.tanh, tanh_rule(1.0), TANH_ARGS,
                 "ig_chunk")


@case("user rules")
def right_rule_custom_function_tangent_report():
    Fn = scaled_tanh_function()
    G = _function_G(Fn)
    z = codes()
    rule = tanh_rule(3.0, name="right_scaled_tanh_tangent")
    return problem(G, z, [register_step(Fn, lambda p: rule), Call("mg", **used()), Call("report"),
                          report_says("ScaledTanh", "user rule")])


@case("user rules", expect="warns", match=WRONG_WARNING.format("wrong_tanh_tangent"))
def wrong_rule_tangent_report_says_local_rule():
    """A rejected rule is not what runs: the report must not list the op under "user rule"."""
    G = tanh_G()
    z = codes()
    return problem(G, z, [register_step(torch.tanh, lambda p: tanh_rule(2.0), TANH_ARGS), Call("report"),
                          report_says("tanh", "user rule", absent=True), report_says("tanh", "local double-VJP")])


@case("user rules", expect="warns", match=WRONG_WARNING.format("wrong_tanh_tangent"))
def wrong_rule_tangent_report_after_mixed_grad_rejected_it():
    G = tanh_G()
    z = codes()
    return problem(G, z, [register_step(torch.tanh, lambda p: tanh_rule(2.0), TANH_ARGS), Call("mg"),
                          Call("report"), report_says("tanh", "user rule", absent=True)])


def _declining_mul(b_scale):
    """Declines a product with a number; for two tensors, ``mul_rule(b_scale)``."""
    inner = mul_rule(b_scale)

    def declining_mul_tangent(op):
        if not isinstance(op.primals["other"], torch.Tensor):
            return NotImplemented
        return inner(op)

    declining_mul_tangent.__qualname__ = "declining_mul_tangent" if b_scale == 1 else "declining_mul_tangent_wrong"
    return declining_mul_tangent


def _mul_G():
    W1, W2, W3 = mat(3, 6), mat(3, 6), mat(6, 4)
    return lambda q: torch.mul(torch.mul(q @ W1, 2.0), torch.tanh(q @ W2)) @ W3


@case("user rules")
def declining_rule_right():
    G = _mul_G()
    z = codes()
    return problem(G, z, [register_step(torch.mul, lambda p: _declining_mul(1.0), MUL_ARGS), Call("mg", **used()),
                          Call("mg", **used())])


@case("user rules", expect="warns", match=WRONG_WARNING.format("declining_mul_tangent_wrong"))
def declining_rule_wrong_when_it_answers():
    G = _mul_G()
    z = codes()
    return problem(G, z, [register_step(torch.mul, lambda p: _declining_mul(3.0), MUL_ARGS), Call("mg"),
                          Call("mg")])


def _mul_checked_with_a(name, G_of, steps_of):
    """A torch.mul rule checked while only a carries a tangent (right there), then used where b carries one
    (wrong there): the first call with b's pattern must check it again."""

    def build():
        W1, W2, W3 = mat(3, 6), mat(3, 6), mat(6, 4)
        c = torch.randn(6, dtype=DT)
        G_a = lambda q: torch.mul(q @ W1, c) @ W3  # noqa: E731
        G = G_of(W1, W2, W3, c)
        z = codes()
        return problem(G, z, [register_step(torch.mul, lambda p: mul_rule(5.0), MUL_ARGS), Call("mg", G=G_a),
                              *steps_of(G, z)])

    build.__name__ = name
    case("user rules", expect="warns", match=WRONG_WARNING.format("mul_tangent_wrong_in_b"))(build)


def _mul_ab(W1, W2, W3, c):
    return lambda q: torch.mul(q @ W1, torch.tanh(q @ W2)) @ W3


_mul_checked_with_a("mul_rule_checked_with_a_then_used_with_a_and_b", _mul_ab, lambda G, z: [Call("mg", G=G)])
_mul_checked_with_a("mul_rule_checked_with_a_then_used_with_b_only",
                    lambda W1, W2, W3, c: (lambda q: torch.mul(c, q @ W1) @ W3), lambda G, z: [Call("mg", G=G)])
_mul_checked_with_a("mul_rule_checked_with_a_then_input_grad_with_a_and_b", _mul_ab, lambda G, z: ig(2, W=W_like(z)))


def _sin_cos_rule(p):
    """Right for torch.sin, wrong for torch.cos: one rule registered for two ops."""

    def sin_or_cos_tangent(op):
        x, dx = first_tangent(op)
        return op.primal(), torch.cos(x) * dx

    return sin_or_cos_tangent


@case("user rules", expect="warns", match=WRONG_WARNING.format("sin_or_cos_tangent"))
def one_rule_two_ops_right_for_first_wrong_for_second():
    W1, W2, W3 = mat(3, 6), mat(3, 6), mat(6, 4)
    G = lambda q: (torch.sin(q @ W1) + torch.cos(q @ W2)) @ W3  # noqa: E731
    z = codes()

    def reg(p):
        rule = counted(p, _sin_cos_rule(p))
        mixedad.op_rules.register(torch.sin, arguments=TANH_ARGS)(rule)
        mixedad.op_rules.register(torch.cos, arguments=TANH_ARGS)(rule)
        p.cleanups += [lambda: mixedad.op_rules.unregister(torch.sin), lambda: mixedad.op_rules.unregister(torch.cos)]

    return problem(G, z, [Do(reg), Call("mg"), Call("mg")])


@case("user rules")
def one_rule_two_ops_right_for_both():
    W1, W2, W3 = mat(3, 6), mat(3, 6), mat(6, 4)
    G = lambda q: (torch.sin(q @ W1) + torch.Tensor.sin(q @ W2)) @ W3  # noqa: E731
    z = codes()

    def reg(p):
        rule = counted(p, sin_rule(1.0))
        mixedad.op_rules.register(torch.sin, arguments=TANH_ARGS)(rule)
        mixedad.op_rules.register(torch.Tensor.sin, arguments=TANH_ARGS)(rule)
        p.cleanups += [lambda: mixedad.op_rules.unregister(torch.sin),
                       lambda: mixedad.op_rules.unregister(torch.Tensor.sin)]

    return problem(G, z, [Do(reg), Call("mg", **used()), Call("mg", **used())])


def _float32_only_wrong(p):
    def tanh_tangent_wrong_in_float32(op):
        x, dx = first_tangent(op)
        scale = 2.0 if x.dtype == torch.float32 else 1.0
        return op.primal(), scale * (1 - torch.tanh(x) ** 2) * dx

    return tanh_tangent_wrong_in_float32


@case("user rules", expect="warns", match=WRONG_WARNING.format("tanh_tangent_wrong_in_float32"), rtol=1e-4)
def rule_checked_in_float64_then_used_in_float32():
    W1, W2 = mat(3, 6), mat(6, 4)
    G64 = lambda q: torch.tanh(q @ W1) @ W2  # noqa: E731
    G32 = lambda q: torch.tanh(q @ W1.float()) @ W2.float()  # noqa: E731
    z = codes()
    z32, y32, v32 = z.float(), torch.randn(4), torch.randn(4, 3)
    return problem(G64, z, [register_step(torch.tanh, _float32_only_wrong, TANH_ARGS), Call("mg"),
                            Call("mg", G=G32, z=z32, y=y32, v=v32)])


@case("caches")
def rule_registered_between_calls_is_used():
    G = seq_tanh()
    z = codes()
    return problem(G, z, [*[Call("mg") for _ in range(3)],
                          register_step(torch.tanh, lambda p: tanh_rule(1.0), TANH_ARGS),
                          Call("mg", **used()), Call("mg", **used())])


@case("caches", expect="warns", match=WRONG_WARNING.format("wrong_tanh_tangent"))
def wrong_rule_registered_between_calls():
    G = seq_tanh()
    z = codes()
    return problem(G, z, [*[Call("mg") for _ in range(3)],
                          register_step(torch.tanh, lambda p: tanh_rule(2.0), TANH_ARGS), Call("mg"), Call("mg")])


@case("caches")
def rule_unregistered_between_calls_is_not_used():
    G = seq_tanh()
    z = codes()
    return problem(G, z, [register_step(torch.tanh, lambda p: tanh_rule(1.0), TANH_ARGS),
                          *[Call("mg", **used()) for _ in range(3)], unregister_step(torch.tanh),
                          Call("mg", **used(False)), Call("mg", **used(False))])


# ----------------------------------------------------------------------------------------------
# Area 4: nothing the caller passed is written (a G that writes its input writes a copy)
# ----------------------------------------------------------------------------------------------

def mul_inplace_G():
    W = mat(3, 4)
    return lambda q: torch.tanh(q.mul_(2.0) @ W)


def view_inplace_G():
    W = mat(3, 4)

    def G(q):
        q[:, 0].mul_(3.0)  # a view of the input, written in place
        return torch.tanh(q @ W)

    return G


def leaky_first():
    return nn.Sequential(nn.LeakyReLU(0.1, inplace=True), lin(3, 6), nn.Tanh(), lin(6, 4))


def relu_first():
    return nn.Sequential(nn.ReLU(inplace=True), lin(3, 6), nn.Tanh(), lin(6, 4))


def elu_first():
    return nn.Sequential(nn.ELU(inplace=True), lin(3, 6), nn.Tanh(), lin(6, 4))


def _inplace_case(name, build_G, route, expect="exact", match=None, f=None):
    def build():
        G = build_G()
        z = codes()
        return problem(G, z, ROUTES[route](z), writes_z=True,
                       f=f or (f_imp if route == "implicit" else f_vec))

    build.__name__ = name
    case("inputs written", expect=expect, match=match)(build)


for _route in ["mg_twice", "ig", "ig_chunk", "mj", "vmap", "curv", "implicit"]:
    _inplace_case(f"mul_inplace_on_z__{_route}", mul_inplace_G, _route)
for _route in ["mg_twice", "ig_chunk", "mj", "vmap"]:
    _inplace_case(f"view_of_z_written__{_route}", view_inplace_G, _route)
for _route in ["five", "vmap", "ig"]:
    _inplace_case(f"sequential_relu_inplace_first__{_route}", relu_first, _route)
for _route in ["five", "ig_chunk", "vmap", "mj"]:
    _inplace_case(f"sequential_leaky_relu_inplace_first__{_route}", leaky_first, _route)
_inplace_case("sequential_elu_inplace_first__five", elu_first, "five")
# compile=True: an in-place write runs eager, with a warning that says so; exact on every call
_inplace_case("sequential_leaky_relu_inplace_first__compile", leaky_first, "compile", expect="warns",
              match=r"compile=True.*in[- ]place")


@case("inputs written")
def clamp_inplace_under_no_grad_on_z():
    W = mat(3, 4)

    def G(q):
        with torch.no_grad():
            q.clamp_(-0.5, 0.5)
        return torch.tanh(q @ W)

    z = codes()
    return problem(G, z, [Call("mg"), Call("mg"), *ig(2, W=W_like(z))], writes_z=True)


@case("inputs written")
def tuple_z_first_written_in_place():
    W1, W2 = mat(3, 4), mat(2, 4)
    G = lambda a, b: torch.tanh(a.mul_(1.5) @ W1 + b @ W2)  # noqa: E731
    z = (codes(), codes(4, 2))
    v = (torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT))
    return problem(G, z, [Call("mg"), Call("mg")], v=v, writes_z=True)


@case("inputs written")
def G_writes_nothing_v_y_z_untouched_five_routes():
    """A control: the same tensors through five calls; none of them is written."""
    G = seq_tanh()
    z = codes()
    return problem(G, z, [Call("mg"), Call("vmap", V=torch.randn(2, *z.shape, dtype=DT)), Call("mj", chunk_size=4),
                          *ig(2, W=W_like(z)), Call("mg")])


# ----------------------------------------------------------------------------------------------
# Area 5: caches (tangent programs per G and layout, Function verdicts, rule checks)
# ----------------------------------------------------------------------------------------------

def _cache_case(name, build_G, change, *, before=3, after=2, z_of=codes, call="mg", rtol=RTOL):
    def build():
        G = build_G()
        z = z_of()
        steps = [Call(call) for _ in range(before)] + [change] + [Call(call) for _ in range(after)]
        return problem(G, z, steps)

    build.__name__ = name
    case("caches", rtol=rtol)(build)


_cache_case("weight_mul_inplace_after_program", seq_tanh, no_grad_do(lambda p: p.G[0].weight.mul_(1.7)))
_cache_case("weight_written_through_data_after_program", seq_tanh,
            Do(lambda p: p.G[2].weight.data.mul_(-2.0)))
_cache_case("weight_replaced_by_new_parameter_after_program", seq_tanh,
            Do(lambda p: setattr(p.G[0], "weight", nn.Parameter(torch.randn(6, 3, dtype=DT)))))
_cache_case("module_swapped_after_program", seq_tanh, Do(lambda p: p.G.__setitem__(1, nn.Sigmoid())))
_cache_case("module_appended_after_program", seq_tanh, Do(lambda p: p.G.append(nn.Tanh())))
_cache_case("leaky_relu_slope_changed_after_program",
            lambda: nn.Sequential(lin(3, 6), nn.LeakyReLU(0.1), lin(6, 4)),
            Do(lambda p: setattr(p.G[1], "negative_slope", -0.7)))
_cache_case("leaky_relu_inplace_flag_flipped_after_program",
            lambda: nn.Sequential(lin(3, 6), nn.LeakyReLU(0.1), lin(6, 4)),
            Do(lambda p: setattr(p.G[1], "inplace", True)))


@case("caches")
def leaky_relu_first_inplace_flag_flipped_after_program():
    """From the fourth call G writes z (a plain forward does): z must end as the plain forwards leave it."""
    G = nn.Sequential(nn.LeakyReLU(0.1), lin(3, 6), nn.Tanh(), lin(6, 4))
    return problem(G, codes(), [Call("mg") for _ in range(3)] + [Do(lambda p: setattr(p.G[0], "inplace", True))]
                   + [Call("mg") for _ in range(2)], writes_z=True)


@case("caches")
def compile_train_eval_toggled_between_calls():
    G = conv_bn_G()
    z = conv_z()
    return problem(G, z, [Call("mg", compile=True), Call("mg", compile=True), Do(lambda p: p.G.train()),
                          Call("mg", compile=True), Call("mg", compile=True), Do(lambda p: p.G.eval()),
                          Call("mg", compile=True)])


_cache_case("forward_hook_added_after_program", seq_tanh,
            Do(lambda p: p.G[1].register_forward_hook(lambda m, i, o: o * 2.5)))
_cache_case("requires_grad_toggled_after_program", seq_tanh, Do(lambda p: p.G[0].weight.requires_grad_(False)))


@case("caches")
def weight_mul_inplace_after_program_input_grad():
    G = seq_tanh()
    z = codes()
    return problem(G, z, [*ig(None, W=W_like(z)), *ig(None, W=W_like(z)), *ig(None, W=W_like(z)),
                          no_grad_do(lambda p: p.G[0].weight.mul_(1.7)), *ig(None, W=W_like(z)),
                          *ig(None, W=W_like(z))])


def conv_bn_G():
    G = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, dtype=DT), nn.BatchNorm2d(3, dtype=DT), nn.ReLU(),
                      nn.Flatten(), lin(3 * 4 * 4, 4))
    with torch.no_grad():
        G[1].running_mean.normal_()
        G[1].running_var.uniform_(0.5, 2.0)
        G[1].weight.normal_()
    return G.eval()


def conv_z():
    return torch.randn(2, 2, 4, 4, dtype=DT)


_cache_case("eval_bn_running_var_written_through_data_after_program", conv_bn_G,
            Do(lambda p: p.G[1].running_var.data.mul_(4.0)), z_of=conv_z)
_cache_case("eval_bn_weight_mul_inplace_after_program", conv_bn_G,
            no_grad_do(lambda p: p.G[1].weight.mul_(-3.0)), z_of=conv_z)
_cache_case("conv_weight_mul_inplace_after_program", conv_bn_G,
            no_grad_do(lambda p: p.G[0].weight.mul_(0.5)), z_of=conv_z)
_cache_case("eval_bn_eps_changed_after_program", conv_bn_G, Do(lambda p: setattr(p.G[1], "eps", 0.5)), z_of=conv_z)
_cache_case("train_eval_toggled_after_program", conv_bn_G, Do(lambda p: p.G.train()), z_of=conv_z)


@case("caches")
def train_eval_toggled_twice_with_dropout():
    G = nn.Sequential(lin(3, 6), nn.Tanh(), nn.Dropout(0.4), lin(6, 4)).eval()
    z = codes()
    return problem(G, z, [Call("mg"), Call("mg"), Call("mg"), Do(lambda p: p.G.train()), Call("mg"), Call("mg"),
                          Do(lambda p: p.G.eval()), Call("mg"), Call("mg")])


@case("caches")
def z_layout_changed_after_program():
    G = conv_bn_G()
    z = conv_z()
    z_cl = z.contiguous(memory_format=torch.channels_last)
    return problem(G, z, [Call("mg"), Call("mg"), Call("mg"), Call("mg", z=z_cl), Call("mg", z=z_cl), Call("mg")])


@case("caches", rtol=1e-4)
def dtype_changed_after_program():
    """Three float32 calls, then G.double() and float64 calls (G.float() first)."""
    G = seq_tanh().float()
    z = codes()
    z32, y32, v32 = z.float(), torch.randn(4), torch.randn(4, 3)
    return problem(G, z, [Call("mg", z=z32, y=y32, v=v32) for _ in range(3)] + [Do(lambda p: p.G.double())]
                   + [Call("mg") for _ in range(2)])


@case("caches")
def compile_weight_mul_inplace_between_calls():
    G = TanhNet()
    z = codes()
    return problem(G, z, [Call("mg", compile=True), Call("mg", compile=True),
                          no_grad_do(lambda p: p.l1_mul(p)), Call("mg", compile=True)],
                   l1_mul=lambda p: p.G.l1.weight.mul_(-1.5))


def _jvp_function():
    class TwoArg(Function):
        """x * tanh(w); its jvp is right in x's term and wrong in w's."""

        @staticmethod
        def forward(x, w):
            return x * torch.tanh(w)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs)
            ctx.save_for_forward(*inputs)

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            return grad * torch.tanh(w), grad * x * (1 - torch.tanh(w) ** 2)

        @staticmethod
        def jvp(ctx, dx, dw):
            x, w = ctx.saved_tensors
            out = 0
            if dx is not None:
                out = out + dx * torch.tanh(w)
            if dw is not None:
                out = out + 4.0 * dw * x * (1 - torch.tanh(w) ** 2)
            return out

    return TwoArg


@case("caches", expect="warns", match=r"TwoArg\.jvp.*disagrees")
def function_jvp_verdict_x_only_then_x_and_w():
    """A Function whose jvp is wrong only in w's term: probed with x alone, then both carry tangents."""
    Fn = _jvp_function()
    W1, W2, W3 = mat(3, 6), mat(3, 6), mat(6, 4)
    c = torch.randn(6, dtype=DT)
    G_x = lambda q: Fn.apply(q @ W1, c) @ W3  # noqa: E731
    G_xw = lambda q: Fn.apply(q @ W1, q @ W2) @ W3  # noqa: E731
    z = codes()
    return problem(G_xw, z, [Call("mg", G=G_x), Call("mg", G=G_xw)])


@case("caches")
def custom_function_verdict_then_generator_state():
    """A Function without jvp drawing from a generator, used twice: its probe must not draw."""
    gens = generators_for("gen_randn")
    Fn = noisy_function("gen_randn", gens)
    W1, W2 = mat(3, 6), mat(6, 4)
    z = codes()
    return problem(lambda q: Fn.apply(q @ W1) @ W2, z, [Call("mg"), Call("mg"), *ig(2, W=W_like(z))], gens=gens)


# ----------------------------------------------------------------------------------------------
# Area 6: smaller
# ----------------------------------------------------------------------------------------------

# nn.LeakyReLU with a negative slope in place: torch refuses its in-place backward ("negative slope"),
# so double backward on it fails; reverse mode's meaning is the out-of-place function's. Either that
# number or an error of mixedad's own; never torch's leaf-variable error.
def _negative_leaky(first, route):
    def build():
        if first:
            G = nn.Sequential(nn.LeakyReLU(-0.5, inplace=True), lin(3, 6), nn.Tanh(), lin(6, 4))
            truth_G = nn.Sequential(nn.LeakyReLU(-0.5), G[1], G[2], G[3])
        else:
            G = nn.Sequential(lin(3, 6), nn.LeakyReLU(-0.2, inplace=True), lin(6, 4))
            truth_G = nn.Sequential(G[0], nn.LeakyReLU(-0.2), G[2])
        z = codes()
        steps = [Call("mg")] if route == "mg" else ig(2, W=W_like(z))
        return problem(G, z, steps, truth_G=truth_G, writes_z=first)

    build.__name__ = f"leaky_relu_negative_slope_inplace_{'first' if first else 'middle'}__{route}"
    case("smaller", expect="exact|refused", match=r"^(mixed_grad|input_grad)\(")(build)


for _first in (True, False):
    for _route in ("mg", "ig"):
        _negative_leaky(_first, _route)


@case("smaller")
def mixed_jacobian_dict_y():
    G = seq_tanh()
    y = {"a": torch.randn(4, dtype=DT), "b": torch.randn(2, dtype=DT)}
    return problem(G, codes(), [Call("mj")], y=y, f=f_dict)


@case("smaller")
def mixed_jacobian_dict_y_chunks():
    G = seq_tanh()
    y = {"a": torch.randn(4, dtype=DT), "b": torch.randn(2, dtype=DT)}
    return problem(G, codes(), [Call("mj", chunk_size=5)], y=y, f=f_dict)


@case("smaller")
def mixed_jacobian_tuple_y():
    G = seq_tanh()
    y = (torch.randn(4, dtype=DT), torch.randn(2, dtype=DT))
    f = lambda y, g: f_dict({"a": y[0], "b": y[1]}, g)  # noqa: E731
    return problem(G, codes(), [Call("mj", chunk_size=7)], y=y, f=f)


@case("smaller")
def mixed_jacobian_nested_dict_y():
    G = seq_tanh()
    y = {"outer": {"a": torch.randn(4, dtype=DT)}, "b": [torch.randn(2, dtype=DT)]}
    f = lambda y, g: f_dict({"a": y["outer"]["a"], "b": y["b"][0]}, g)  # noqa: E731
    return problem(G, codes(), [Call("mj")], y=y, f=f)


# ----------------------------------------------------------------------------------------------
# The table's tests (the harness, the calls and their naive twins: tests/review_state_common.py)
# ----------------------------------------------------------------------------------------------

def test_there_are_enough_cases():
    assert len(CASES) >= 110
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_state(c):
    check(c, REVIEW.evaluate)


if __name__ == "__main__":
    REVIEW.print_table()
