"""Review, second round: state, randomness, caching, user rules and inputs, beyond tests/test_review_state.py.

The first review (tests/test_review_state.py, 189 situations) checked the promises of "State that a
pass replays or caches" (docs/semantics.md, DESIGN.md) for the common sources and routes. This
file tries, as a demanding new user would, what it did not: random sources that reach G another
way (a generator passed positionally, a NumPy ``Generator`` or ``random.Random`` that G holds, G
seeding the global generators itself, ``torch.distributions``, ``rrelu``), random draws in f, two
threads at once, G's state changed between a saved pass and its use in ways other than an in-place
write (``G.float()``, ``G.half()``, ``load_state_dict``, a generator or a config replaced), saved
passes interleaved with other calls on the same G, more user rules (dunder methods, aten overloads,
tangents of the wrong type or shape, rules for random ops, a rule that raises), in-place layers and
writes into z that the first review did not try, memory plans beside a first call, and what
``tangent_report(G, z).route`` says along a sequence of calls.

Every situation is a row of the table: a small builder (float64, tiny) that returns G, f, z, y, v
and a sequence of steps: calls of mixedad, each with a naive twin written in this file (double
backward, ``torch.autograd.grad(..., create_graph=True)``, one plain forward of G per call and per
chunk), things the user does between calls (``Do``), checks of mixedad's side only (``Check``), and
``Pair`` steps whose two sides are written out by the case (threads, memory plans). The case is
built twice from the same seeds; one copy runs the naive sequence, the other mixedad's, from the
same random states. Verdicts:

- ``exact``: every result equals its naive twin's, relative error < 1e-9 (float64);
- ``refused``: a step raises an error of mixedad's own (the message opens with the public call)
  that matches the case's regex; where the naive code raises, only a refusal is right;
- ``warns``: exact, and a warning matching the case's regex was given.

After every case, whatever the verdict, these must hold (a "leak" otherwise): torch's global RNG,
Python's ``random``, NumPy's global state, each ``torch.Generator`` G uses and each other random
source the case names (a NumPy ``Generator``, a ``random.Random``) end where the naive sequence
leaves them; module buffers, parameters and training flags as the naive sequence leaves them; the
caller's v, y and the tensors the steps pass unchanged, and z as the naive sequence leaves it; no
torch function or dispatch mode, forward-AD level, functorch level or grad mode left behind, no
torch attribute patched; no right rule rejected; and each ``Check`` of the case.

Where the right answer is debatable the case says so in a comment, and takes reverse mode's answer
(double backward's number, or its refusal, which mixedad must give as an error of its own).

``python -m tests.test_review_state_more`` prints a table of the verdicts now.
"""
import random
import re
import threading
import time
import types
import warnings

import numpy as np
import pytest
import torch
import torch._dynamo  # noqa: F401  (importing it replaces torch.manual_seed: do that before any snapshot)
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function, forward_ad
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

import mixedad

from tests.seams_common import attributes as _attributes, check, first_line, rel_error

DT = torch.float64
RTOL = 1e-9
OWN_ERROR = re.compile(r"^\s*(mixed_grad|input_grad|mixed_jacobian|z_curvature|implicit_grad|implicit_argmin|"
                       r"cached_backward|tangent_report|plan|register)\(")
#: A warning no "exact" case may give: a right rule (or jvp) rejected.
DISAGREES = r"disagrees with the backward"
#: Damping for implicit differentiation: the Hessians here are indefinite without it.
DAMPING = 100.0

torch._dynamo.mutation_guard.install_generation_tagging_init()

pytestmark = pytest.mark.filterwarnings("ignore")

# ----------------------------------------------------------------------------------------------
# The case table
# ----------------------------------------------------------------------------------------------

CASES = []


def case(area, expect="exact", match=None, rtol=RTOL, name=None, not_match=None):
    """Register a builder. ``expect``: "exact", "refused", "warns", or alternatives joined by "|".

    ``match`` is the regex a refusal's message (for "refused") or a warning (for "warns", written
    ``Category: message``) must match; a warning that also matches ``not_match`` does not count.
    """

    def register(build):
        CASES.append(types.SimpleNamespace(area=area, name=name or build.__name__, build=build, expect=expect,
                                           match=match, rtol=rtol, not_match=not_match))
        return build

    return register


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
    """input_grad forward then backward."""
    return [Call("ig_fwd", chunk=chunk), Call("ig_bwd", **opts)]


def no_grad_do(fn):
    def run(p):
        with torch.no_grad():
            fn(p)

    return Do(run)


def seq_tanh():
    return nn.Sequential(lin(3, 6), nn.Tanh(), lin(6, 4))


def igamma_tail(W3):
    """torch.igamma in x: no forward-AD formula, so mixedad's pass restarts on it (a second run of G)."""

    def tail(h):
        return torch.igamma(torch.full_like(h, 1.5), h ** 2 + 0.5) @ W3

    return tail


def forget():
    return Do(lambda p: mixedad.op_rules.forget_failures())


#: The calls a random G is tried with: each runs G more than once in mixedad (a restart, a replay, products).
ROUTES = {
    "mg": lambda z: [Call("mg")],
    "ig": lambda z: ig(None, W=W_like(z)),
    "ig_chunk": lambda z: ig(2, W=W_like(z)),
    "mj": lambda z: [Call("mj", chunk_size=5)],
    "curv": lambda z: [Call("curv", kind="hessian"), Call("matvec", u=W_like(z)), Call("matvec", u=W_like(z))],
    "curv_ggn": lambda z: [Call("curv", kind="ggn"), Call("matvec", u=W_like(z))],
    "implicit": lambda z: [Call("implicit", w=W_like(z), damping=DAMPING)],
    "argmin": lambda z: [Call("argmin_fwd", damping=DAMPING), Call("argmin_bwd", W=W_like(z))],
    "vmap": lambda z: [Call("vmap", V=torch.randn(3, *z.shape, dtype=DT), randomness="same")],
    "five": lambda z: [Call("mg") for _ in range(5)],
}


def f_for(route):
    return f_imp if route in ("implicit", "argmin") else f_vec


# ----------------------------------------------------------------------------------------------
# Area 1: random sources that reach G (or f) another way
# ----------------------------------------------------------------------------------------------

def _np_state(rng):
    return lambda: rng.bit_generator.state


def _np_set_state(rng):
    return lambda state: setattr(rng.bit_generator, "state", state)


def random_source(source):
    """``(noise, gens, sources)``: h -> h with a draw from ``source``; G's torch.Generators; other sources."""
    gens, sources = [], []
    if source in ("positional_poisson", "positional_binomial", "reseeded_generator", "many_generator_ops"):
        gens = [torch.Generator().manual_seed(4321)]
    if source == "numpy_generator":
        rng = np.random.default_rng(7)
        sources = [("G's NumPy Generator", _np_state(rng), _np_set_state(rng))]
    if source == "python_random_instance":
        rnd = random.Random(7)
        sources = [("G's random.Random", rnd.getstate, rnd.setstate)]

    def noise(h):
        if source == "positional_poisson":  # torch.poisson(input, generator): the generator positionally
            return h * torch.poisson(torch.full(h.shape, 2.0, dtype=DT), gens[0]) / 2.0
        if source == "positional_binomial":  # torch.binomial(count, prob, generator)
            return h * torch.binomial(torch.full(h.shape, 5.0, dtype=DT), torch.full(h.shape, 0.5, dtype=DT),
                                      gens[0]) / 2.5
        if source == "numpy_generator":  # a NumPy Generator G holds (not np.random's global state)
            return h * torch.from_numpy(rng.random(h.shape) + 0.5)
        if source == "python_random_instance":  # a random.Random G holds (not the module's global state)
            return h * (0.5 + rnd.random())
        if source == "seeds_torch":  # G seeds torch's global generator itself, then draws
            torch.manual_seed(99)
            return h + 0.3 * torch.randn(h.shape, dtype=DT)
        if source == "seeds_python_numpy":
            random.seed(5)
            np.random.seed(5)
            return h * (0.5 + random.random()) * torch.from_numpy(np.random.rand(*h.shape) + 0.5)
        if source == "reseeded_generator":  # G reseeds the generator it holds on every call
            gens[0].manual_seed(77)
            return h + 0.3 * torch.randn(h.shape, generator=gens[0], dtype=DT)
        if source == "fresh_generator":  # a new Generator per call, seeded from the global one
            g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 30, ())))
            return h + 0.3 * torch.randn(h.shape, generator=g, dtype=DT)
        if source == "default_generator":  # torch.default_generator passed as generator=
            return h + 0.3 * torch.randn(h.shape, generator=torch.default_generator, dtype=DT)
        if source == "many_generator_ops":  # generator= on randint and the in-place samplers
            g = gens[0]
            k = torch.randint(0, 3, h.shape, generator=g).to(DT)
            a = torch.empty(h.shape, dtype=DT).normal_(0.0, 0.2, generator=g)
            b = torch.empty(h.shape, dtype=DT).uniform_(0.5, 1.5, generator=g)
            c = torch.empty(h.shape, dtype=DT).exponential_(2.0, generator=g)
            d = torch.empty(h.shape, dtype=DT).geometric_(0.5, generator=g)
            e = torch.empty(h.shape, dtype=DT).log_normal_(0.0, 0.1, generator=g)
            return (h + a + 0.1 * k) * b + 0.05 * c + 0.01 * d * e
        if source == "distributions":  # torch.distributions: a reparametrised sample and a plain one
            s = torch.distributions.Normal(h, 0.2).rsample()
            m = torch.distributions.Bernoulli(probs=torch.full(h.shape, 0.7, dtype=DT)).sample()
            return s * m
        if source == "rrelu":  # F.rrelu in training draws its slopes from the global generator
            return F.rrelu(h, 0.1, 0.3, training=True)
        raise AssertionError(source)

    return noise, gens, sources


def _random_case(source, route, *, restart=False, expect="exact", comment=None):
    def build():
        noise, gens, sources = random_source(source)
        W1, W2 = mat(3, 6), mat(6, 4)
        tail = igamma_tail(mat(6, 4)) if restart else (lambda h: h @ W2)

        def G(q):
            return tail(noise(torch.tanh(q @ W1)))

        z = codes()
        steps = ([forget()] if restart else []) + ROUTES[route](z)
        return problem(G, z, steps, gens=gens, sources=sources, f=f_for(route))

    build.__name__ = f"{source}__{route}{'__restart_igamma' if restart else ''}"
    case("random sources", expect=expect, match=r"^(mixed_grad|input_grad|mixed_jacobian|z_curvature)\(")(build)


# A generator passed positionally (torch.poisson(rates, g), torch.binomial(count, prob, g)) is a generator
# G's ops receive, as much as generator=g is (docs/semantics.md, "State a call replays").
for _route in ("ig_chunk", "curv", "mj"):
    _random_case("positional_poisson", _route)
_random_case("positional_poisson", "mg", restart=True)
_random_case("positional_binomial", "ig_chunk")

# A NumPy Generator (np.random.default_rng()) or a random.Random that G holds, which no torch function sees:
# a snapshot finds it among what G holds (a module's attribute, a closure) and replays it, so every pass that
# runs G again draws what the first drew. Reverse mode's answer (the naive code's, from the one forward) or an
# error of mixedad's own are both right; a silent mix of draws is not.
for _route in ("ig_chunk", "curv"):
    _random_case("numpy_generator", _route, expect="exact|refused")
_random_case("numpy_generator", "mg", restart=True, expect="exact|refused")
_random_case("python_random_instance", "ig_chunk", expect="exact|refused")

# G that seeds the global sources, or reseeds its own generator, on every call: deterministic draws.
for _route in ("ig_chunk", "curv", "mj"):
    _random_case("seeds_torch", _route)
_random_case("seeds_torch", "mg", restart=True)
_random_case("seeds_python_numpy", "ig_chunk")
_random_case("reseeded_generator", "ig_chunk")
_random_case("fresh_generator", "ig_chunk")
_random_case("fresh_generator", "mg", restart=True)
_random_case("default_generator", "ig_chunk")
_random_case("default_generator", "curv")
for _route in ("ig_chunk", "mj", "curv"):
    _random_case("many_generator_ops", _route)
for _route in ("ig_chunk", "curv_ggn"):
    _random_case("distributions", _route)
for _route in ("ig_chunk", "mj"):
    _random_case("rrelu", _route)


def f_dropout(y, g):
    """f that draws: dropout on g (a discriminator in train mode), from torch's global generator."""
    return f_vec(y, F.dropout(g, 0.3, training=True))


def f_dropout_imp(y, g):
    return f_imp(y, F.dropout(g, 0.3, training=True))


def _random_f_case(route, G_kind="plain"):
    """f draws random numbers; G does not (or draws too). Double backward evaluates f once per call."""

    def build():
        if G_kind == "sequential":
            G = seq_tanh()
        else:
            W1, W2 = mat(3, 6), mat(6, 4)
            G = lambda q: torch.tanh(q @ W1) @ W2  # noqa: E731
        z = codes()
        f = f_dropout_imp if route in ("implicit", "argmin") else f_dropout
        return problem(G, z, ROUTES[route](z), f=f)

    build.__name__ = f"f_draws_dropout__{route}{'' if G_kind == 'plain' else '__' + G_kind}"
    case("random sources")(build)


# With chunk_size, input_grad checks on the first two chunks that f sums over codes, by evaluating f on them joined:
# an f that draws (dropout) is a sum over codes, chunk by chunk, as the naive chunked code evaluates it, but its
# joined evaluation draws other masks. A refusal that says "f is not a sum over latent codes" is a false one.
for _route in ("mg", "ig", "ig_chunk", "mj", "implicit", "vmap"):
    _random_f_case(_route)
_random_f_case("five", "sequential")


@case("random sources")
def f_draws_from_its_own_generator__ig():
    """f adds noise from a torch.Generator it holds; G draws from the global generator (dropout)."""
    gen = torch.Generator().manual_seed(31)
    W1, W2 = mat(3, 6), mat(6, 4)
    G = lambda q: F.dropout(torch.tanh(q @ W1), 0.3, training=True) @ W2  # noqa: E731

    def f(y, g):
        return f_vec(y, g * (1 + 0.2 * torch.randn(g.shape, generator=gen, dtype=DT)))

    z = codes()
    return problem(G, z, ig(None, W=W_like(z)), f=f, gens=[gen])


# ----------------------------------------------------------------------------------------------
# Area 2: threads
# ----------------------------------------------------------------------------------------------

def gen_G(gen):
    """tanh(z W1) plus noise from ``gen``, then W2."""
    W1, W2 = mat(3, 6), mat(6, 4)
    return lambda q: (torch.tanh(q @ W1) + 0.3 * torch.randn(q.shape[0], 6, generator=gen, dtype=DT)) @ W2


def _plain_draws(gen, n):
    return torch.stack([torch.randn(3, generator=gen, dtype=DT) for _ in range(n)])


def _other_thread_draws(mixedad_side):
    """Thread B draws DRAWS times from its own generator (known to mixedad from an earlier call) while this
    thread runs mixedad calls on another, deterministic G until B is done. B's numbers are a plain
    generator's: no call of another thread may rewind or replay B's generator."""

    def ours(p):
        drawn, done = [], threading.Event()

        def b():
            try:
                drawn.append(_plain_draws(p.gens[0], DRAWS))
            finally:
                done.set()

        t = threading.Thread(target=b)
        t.start()
        calls = 0
        try:
            while not done.is_set() or calls == 0:
                mixedad_side(p)
                calls += 1
        finally:
            t.join()
        return drawn[0]

    def naive(p):
        return _plain_draws(p.gens[0], DRAWS)

    return Pair(naive, ours)


DRAWS = 20000


def _ig_once(p):
    yl = p.y.detach().clone().requires_grad_()
    dfdz = mixedad.input_grad(p.f, p.G_other, p.z, yl, chunk_size=2)
    torch.autograd.grad(outer_loss(dfdz, p.W), yl)


@case("threads")
def other_threads_generator_not_rewound_by_mixed_grad():
    """B's generator became known to mixedad through a call with B's G; A's calls must leave it alone."""
    gen = torch.Generator().manual_seed(11)
    G_b = gen_G(gen)
    G_a = seq_tanh()
    z = codes()
    p = problem(G_b, z, [Call("mg"), None], gens=[gen], G_other=G_a)
    p.steps[1] = _other_thread_draws(lambda p: mixedad.mixed_grad(p.f, p.G_other, p.z, p.y, p.v))
    return p


@case("threads")
def other_threads_generator_not_rewound_by_input_grad():
    gen = torch.Generator().manual_seed(11)
    G_b = gen_G(gen)
    W1, W2 = mat(3, 6), mat(6, 4)
    G_a = lambda q: torch.tanh(q @ W1) @ W2  # noqa: E731
    z = codes()
    p = problem(G_b, z, [Call("mg"), None], gens=[gen], G_other=G_a, W=W_like(z))
    p.steps[1] = _other_thread_draws(_ig_once)
    return p


def _two_threads(kind, n_calls=6):
    """Two threads at once, each calling mixedad ``n_calls`` times on its own G with its own generator.
    The naive twin runs each thread's sequence of naive calls (they share nothing)."""

    def build():
        gens = [torch.Generator().manual_seed(100 + i) for i in range(2)]
        Gs = [gen_G(g) for g in gens]
        z = codes()
        W = W_like(z)

        def one(p, i, naive):
            if kind == "mg":
                return (naive_mg if naive else mixedad_mg)(p, G=Gs[i])
            if naive:
                return naive_ig_pair(p, Gs[i], W)
            yl = p.y.detach().clone().requires_grad_()
            dfdz = mixedad.input_grad(p.f, Gs[i], p.z, yl, chunk_size=2)
            (gy,) = torch.autograd.grad(outer_loss(dfdz, W), yl)
            return [dfdz.detach(), gy]

        def naive(p):
            return [[one(p, i, True) for _ in range(n_calls)] for i in range(2)]

        def ours(p):
            out, errors = [[], []], []
            start = threading.Barrier(2)

            def run(i):
                try:
                    start.wait()
                    for _ in range(n_calls):
                        out[i].append(one(p, i, False))
                except Exception as e:  # noqa: BLE001
                    errors.append(e)

            ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            if errors:
                raise errors[0]
            return out

        return problem(Gs[0], z, [Pair(naive, ours)], gens=gens)

    build.__name__ = f"two_threads_at_once_own_generators__{kind}"
    case("threads")(build)


def naive_ig_pair(p, G, W, chunk=2):
    with torch.enable_grad():
        yl = p.y.detach().clone().requires_grad_()
        zl = p.z.detach().clone().requires_grad_()
        total = sum(p.f(yl, G(zl[i:i + chunk])) for i in range(0, zl.shape[0], chunk))
        (gz,) = torch.autograd.grad(total, zl, create_graph=True)
        (gy,) = torch.autograd.grad(outer_loss(gz, W), yl)
    return [gz.detach(), gy]


_two_threads("mg")
_two_threads("ig")


@case("threads")
def two_threads_at_once_train_batchnorm_each():
    """Two threads, each its own train-mode G with batch norm and no random source: buffers as the naive
    sequence of each thread leaves them."""
    Gs = [nn.Sequential(lin(3, 6), nn.BatchNorm1d(6, dtype=DT), nn.Tanh(), lin(6, 4)) for _ in range(2)]
    z = codes()

    def naive(p):
        return [[naive_mg(p, G=G) for _ in range(4)] for G in Gs]

    def ours(p):
        out, errors = [[], []], []
        start = threading.Barrier(2)

        def run(i):
            try:
                start.wait()
                for _ in range(4):
                    out[i].append(mixedad_mg(p, G=Gs[i]))
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errors:
            raise errors[0]
        return out

    return problem(Gs[0], z, [Pair(naive, ours)], modules=Gs)


# ----------------------------------------------------------------------------------------------
# Area 3: G's state between a saved pass and its use, and saved passes beside other calls
# ----------------------------------------------------------------------------------------------

def seq_mlp(norm=None, dropout=False, gen_noise=False):
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


def _between_ig(name, change, *, expect="exact", match=r"^input_grad\(", build_G=seq_mlp, chunk=None,
                rtol=RTOL, **extra):
    """input_grad's forward, ``change`` (a Do), then its backward."""

    def build():
        G = build_G()
        z = codes()
        return problem(G, z, [Call("ig_fwd", chunk=chunk), change, Call("ig_bwd", W=W_like(z))], **extra)

    build.__name__ = name
    case("between forward and backward", expect=expect, match=match, rtol=rtol)(build)


# G.float() / G.half() / G.to(float32) swap each parameter's .data for a converted tensor (same Parameter object,
# version unchanged). Double backward's graph holds the float64 weights it saved and answers; mixedad's backward
# replays G with float32 weights on float64 z.
_between_ig("ig_G_float_before_backward", Do(lambda p: p.G.float()), expect="exact|refused")
_between_ig("ig_G_half_before_backward", Do(lambda p: p.G.half()), expect="exact|refused")
_between_ig("ig_G_to_float32_chunks_before_backward", Do(lambda p: p.G.to(torch.float32)), expect="exact|refused",
            chunk=2)
# A round trip through float32: the weights are float64 again, rounded, the version unchanged. Double backward
# answers with the weights it saved; a replay with the rounded weights mixes states (relative 1e-8 here).
_between_ig("ig_G_float_then_double_before_backward", Do(lambda p: p.G.float().double()), expect="exact|refused")
# load_state_dict copies in place: double backward refuses (saved weight modified); so must mixedad.
_between_ig("ig_load_state_dict_same_values_before_backward", Do(lambda p: p.G.load_state_dict(p.G.state_dict())),
            expect="refused", match=r"^input_grad\(.*0\.weight")
_between_ig("ig_requires_grad_false_before_backward", Do(lambda p: p.G.requires_grad_(False)))


def _zero_grad(p):
    for q in p.G.parameters():
        q.grad = torch.ones_like(q)
    p.G.zero_grad()


_between_ig("ig_zero_grad_before_backward", Do(_zero_grad))
# Module modes are replayed: an eval forward, a train-mode backward (dropout on) must be the eval pass.
_between_ig("ig_eval_forward_train_before_backward_dropout", Do(lambda p: p.G.train()),
            build_G=lambda: seq_mlp(dropout=True).eval(), chunk=2)
# The structure of G changed: double backward's graph is the old G's. A replay of the new G is another function.
_between_ig("ig_layer_appended_before_backward", Do(lambda p: p.G.append(nn.Tanh())), expect="exact|refused")
_between_ig("ig_activation_swapped_before_backward", Do(lambda p: p.G.__setitem__(1, nn.Sigmoid())),
            expect="exact|refused")
_between_ig("ig_forward_hook_added_before_backward",
            Do(lambda p: p.G[1].register_forward_hook(lambda m, i, o: o * 2.5)), expect="exact|refused")
_between_ig("ig_forward_pre_hook_added_before_backward",
            Do(lambda p: p.G[2].register_forward_pre_hook(lambda m, i: (i[0] * 0.5,))), expect="exact|refused")


class Configured(nn.Module):
    """A G whose noise scale is a float attribute and whose gain sits in a dict attribute (a config)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = lin(3, 6), lin(6, 4)
        self.scale = 0.7
        self.config = {"gain": 1.3}
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, q):
        h = torch.tanh(self.l1(q)) * self.config["gain"]
        return self.l2(h + self.scale * torch.randn(h.shape, generator=self.gen, dtype=h.dtype, device=h.device))


def _configured_case(name, change, expect="exact", chunk=2):
    def build():
        G = Configured()
        z = codes()
        return problem(G, z, [Call("ig_fwd", chunk=chunk), Do(change), Call("ig_bwd", W=W_like(z))],
                       gens=[G.gen], G_gens=lambda p: [p.G.gen])

    build.__name__ = name
    case("between forward and backward", expect=expect, match=r"^input_grad\(")(build)


_configured_case("ig_float_attribute_changed_before_backward", lambda p: setattr(p.G, "scale", 0.1))
# A config dict: nothing mixedad can see. Double backward's graph holds the old gain; a replay reads the new one.
_configured_case("ig_dict_config_changed_before_backward", lambda p: p.G.config.update(gain=-2.0),
                 expect="exact|refused")
_configured_case("ig_generator_reseeded_before_backward", lambda p: p.G.gen.manual_seed(1234))
_configured_case("ig_generator_drawn_from_before_backward",
                 lambda p: torch.randn(7, generator=p.G.gen))
# The generator object replaced: the backward's replay draws from one the forward never saw.
_configured_case("ig_generator_replaced_before_backward",
                 lambda p: setattr(p.G, "gen", torch.Generator().manual_seed(999)), expect="exact|refused")


@case("between forward and backward")
def ig_dropout_global_draws_and_reseed_before_backward():
    G = seq_mlp(dropout=True)
    z = codes()
    return problem(G, z, [Call("ig_fwd", chunk=2), Do(lambda p: (torch.randn(9), torch.manual_seed(3))),
                          Call("ig_bwd", W=W_like(z))])


@case("between forward and backward", expect="exact|refused", match=r"^input_grad\(.*\by\b")
def ig_adam_step_on_y_before_backward():
    """An optimizer step on y itself. f is additive in y, so double backward saved no y and answers with the
    forward's values: that, or mixedad's refusal naming y."""
    G = seq_mlp()
    z = codes()

    def f(y, g):
        return ((g + y) ** 3).sum()

    def step(p):
        (yl,) = p.ctx["yl"]
        yl.grad = torch.ones_like(yl)
        torch.optim.Adam([yl], lr=0.1).step()
        yl.grad = None

    return problem(G, z, [Call("ig_fwd"), Do(step), Call("ig_bwd", W=W_like(z))], f=f)


def closure_G():
    W1, W2 = mat(3, 6), mat(6, 4)
    G = lambda q: torch.tanh(q @ W1) @ W2  # noqa: E731
    G.W1 = W1
    return G


def _closure_change(name, steps_of, match):
    def build():
        G = closure_G()
        z = codes()
        return problem(G, z, steps_of(z), f=f_imp)

    build.__name__ = name
    case("between forward and backward", expect="refused", match=match)(build)


_write_W1 = no_grad_do(lambda p: p.G.W1.mul_(1.2))
_closure_change("curv_closure_tensor_written_between_products",
                lambda z: [Call("curv", kind="hessian"), Call("matvec", u=W_like(z)), _write_W1,
                           Call("matvec", u=W_like(z))], r"^z_curvature\(")
_closure_change("curv_keep_graph_closure_tensor_written_between_products",
                lambda z: [Call("curv", kind="hessian", keep_graph=True), Call("matvec", u=W_like(z)), _write_W1,
                           Call("matvec", u=W_like(z))], r"^z_curvature\(")
_closure_change("curv_ggn_keep_graph_closure_tensor_written_between_products",
                lambda z: [Call("curv", kind="ggn", keep_graph=True), Call("matvec", u=W_like(z)), _write_W1,
                           Call("matvec", u=W_like(z))], r"^z_curvature\(")
_closure_change("argmin_closure_tensor_written_before_backward",
                lambda z: [Call("argmin_fwd", damping=DAMPING), _write_W1, Call("argmin_bwd", W=W_like(z))],
                r"^implicit_argmin\(")


@case("between forward and backward", expect="exact|refused", match=r"^z_curvature\(")
def curv_activation_swapped_between_products():
    G = seq_mlp()
    z = codes()
    return problem(G, z, [Call("curv", kind="hessian"), Call("matvec", u=W_like(z)),
                          Do(lambda p: p.G.__setitem__(1, nn.Sigmoid())), Call("matvec", u=W_like(z))], f=f_imp)


@case("between forward and backward")
def curv_dropout_user_draws_between_products():
    """The operator's products replay the construction's masks; the user's own draws in between stand."""
    G = seq_mlp(dropout=True)
    z = codes()
    return problem(G, z, [Call("curv", kind="hessian"), Call("matvec", u=W_like(z)), Do(lambda p: torch.randn(5)),
                          Call("matvec", u=W_like(z)), Do(lambda p: torch.manual_seed(8)), Call("dense")], f=f_imp)


@case("between forward and backward")
def implicit_grad_train_dropout_and_batchnorm():
    G = seq_mlp("bn_train", dropout=True)
    z = codes()
    return problem(G, z, ROUTES["implicit"](z), f=f_imp)


@case("between forward and backward")
def implicit_argmin_train_dropout_and_batchnorm():
    G = seq_mlp("bn_train", dropout=True)
    z = codes()
    return problem(G, z, ROUTES["argmin"](z), f=f_imp)


def _interleaved(name, between, build_G=lambda: seq_mlp("bn_train", dropout=True)):
    """input_grad's backward with retain_graph=True, other calls on the same G, then the backward again:
    nothing of mixedad's own may trip the check of what the backward reads again."""

    def build():
        G = build_G()
        z = codes()
        W = W_like(z)
        gens = [G.gen] if hasattr(G, "gen") else []
        return problem(G, z, [Call("ig_fwd", chunk=2), Call("ig_bwd", W=W, retain=True), *between(z),
                              Call("ig_bwd", W=W, retain=True), *between(z), Call("ig_bwd", W=W)], gens=gens)

    build.__name__ = name
    case("between forward and backward")(build)


_interleaved("ig_retain_graph_interleaved_mixed_grad_report_plan",
             lambda z: [Call("mg"), Call("report"), Call("plan")])
_interleaved("ig_retain_graph_interleaved_input_grad_and_curvature",
             lambda z: [Call("ig_other", chunk=2, W=W_like(z)), Call("curv", kind="ggn"), Call("matvec", u=W_like(z))])
_interleaved("ig_retain_graph_interleaved_generator_module", lambda z: [Call("mg"), Call("report"), Call("plan"),
                                                                        Call("mj", chunk_size=4)], build_G=Configured)
_interleaved("ig_retain_graph_interleaved_eval_program_calls",
             lambda z: [Do(lambda p: p.G.eval()), Call("mg"), Call("mg"), Call("mg"), Do(lambda p: p.G.train())])
_interleaved("ig_retain_graph_interleaved_compile_calls",
             lambda z: [Call("mg", compile=True), Call("mg", compile=True)], build_G=lambda: seq_mlp("bn_eval"))


@case("between forward and backward", expect="exact|refused", match=r"^input_grad\(")
def ig_G_closes_over_tensor_requiring_grad():
    """G reads s, a tensor that requires grad (a learnable style vector), outside y. Double backward fills s.grad
    through the mixed derivative; mixedad's G is frozen. Its answer must include s's gradient, or refuse, as it
    refuses such a tensor in f."""
    W1, W2 = mat(3, 6), mat(6, 4)
    s = torch.randn(6, dtype=DT).requires_grad_()
    G = lambda q: (torch.tanh(q @ W1) * s) @ W2  # noqa: E731
    z = codes()
    p = problem(G, z, [Call("ig_fwd"), Call("ig_bwd", W=W_like(z), also=[s])])
    return p


class FMap(nn.Module):
    """cached_backward's f: a (2, 3) input to (2, 4), with an eval batch norm, dropout, and a tensor it closes over."""

    def __init__(self, writes_input=False, dropout=False, eval_mode=False):
        super().__init__()
        self.l1, self.bn, self.l2 = lin(3, 6), nn.BatchNorm1d(6, dtype=DT), lin(6, 4)
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2.0)
        self.bn.eval()
        self.gain = torch.randn(6, dtype=DT)  # a plain tensor the forward reads (not a buffer)
        self.writes_input, self.dropout = writes_input, dropout
        if eval_mode:
            self.eval()

    def forward(self, x):
        if self.writes_input:
            x = x.mul_(2.0)  # the caller's input, written in place (a plain forward writes it once)
        h = torch.tanh(self.bn(self.l1(x))) * self.gain
        if self.dropout:
            h = F.dropout(h, 0.3, training=True)
        return self.l2(h)


def _cached_case(name, g_of, expect="exact", match=r"^cached_backward\(", **fmap):
    def build():
        fm = FMap(**fmap)
        p = problem(fm, codes(), [Call("cached", chunk_size=2)])
        p.inputs = [torch.randn(2, 3, dtype=DT) for _ in range(4)]
        p.g_of = lambda Z: g_of(p, Z)
        return p

    build.__name__ = name
    case("between forward and backward", expect=expect, match=match)(build)


def _g_plain(p, Z):
    return (Z ** 2).sum() + torch.sin(Z).sum()


def _g_writes_gain(p, Z):
    with torch.no_grad():
        p.G.gain.mul_(1.5)  # g changes a tensor f closes over: double backward's saved tensor moved
    return _g_plain(p, Z)


def _g_writes_running_mean(p, Z):
    with torch.no_grad():
        p.G.bn.running_mean.add_(0.5)  # eval batch norm saved it for its backward
    return _g_plain(p, Z)


def _g_draws(p, Z):
    return _g_plain(p, Z * (1 + 0.1 * torch.randn(Z.shape, dtype=DT)))


# Debatable: f's module is in train mode, so mixedad's snapshot copies its plain tensor attribute and pass 2
# replays the copy (the forward's gain), a consistent answer (train-mode state is replayed, docs/semantics.md);
# double backward refuses (mul saved the gain). Either is right; a mix of gains is not.
_cached_case("cached_g_writes_tensor_f_reads", _g_writes_gain, expect="refused|answered")
_cached_case("cached_g_writes_tensor_f_reads__eval", _g_writes_gain, expect="refused", eval_mode=True)
_cached_case("cached_g_writes_eval_batchnorm_statistics_of_f", _g_writes_running_mean, expect="refused",
             match=r"^cached_backward\(.*running_mean")
_cached_case("cached_g_draws_and_f_has_dropout", _g_draws, dropout=True)
# f writes its input in place: the naive code writes each input once; pass 2 of cached_backward runs f again on the
# input pass 1 already wrote. Reverse mode's answer is the naive code's (or a refusal): not f of 4x.
_cached_case("cached_f_writes_its_input", _g_plain, expect="exact|refused", writes_input=True)


class Counting(nn.Module):
    """A G that counts its calls in a plain int and seeds a fresh generator with the count: each call draws anew."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = lin(3, 6), lin(6, 4)
        self.calls = 0

    def forward(self, q):
        self.calls += 1
        g = torch.Generator().manual_seed(1000 + self.calls)
        h = torch.tanh(self.l1(q))
        return self.l2(h + 0.3 * torch.randn(h.shape, generator=g, dtype=h.dtype))


@case("between forward and backward")
def ig_G_counts_its_calls_in_an_int_attribute():
    G = Counting()
    z = codes()
    return problem(G, z, [*ig(2, W=W_like(z)), Call("mg"), *ig(None, W=W_like(z)), Call("curv", kind="ggn"),
                          Call("matvec", u=W_like(z))])


@case("between forward and backward")
def two_saved_input_grads_backward_in_reverse_order():
    """Two input_grad forwards on the same G (its generator drawn by each), then their backwards, last first."""
    G = Configured()
    z = codes()
    W1, W2 = W_like(z), W_like(z)

    def run(naive):
        def go(p):
            fwd = naive_ig_fwd if naive else mixedad_ig_fwd
            fwd(p, chunk=2)
            first = dict(p.ctx)
            fwd(p)
            out = [ig_bwd(p, W2)]
            p.ctx.update(first)
            out.append(ig_bwd(p, W1))
            return out

        return go

    return problem(G, z, [Pair(run(True), run(False))], gens=[G.gen])


@case("between forward and backward")
def curvature_operator_then_input_grad_then_products():
    G = Configured()
    z = codes()
    return problem(G, z, [Call("curv", kind="hessian"), Call("matvec", u=W_like(z)), *ig(2, W=W_like(z)),
                          Call("mg"), Call("matvec", u=W_like(z))], gens=[G.gen], f=f_imp)


@case("between forward and backward", expect="exact|refused", match=r"^z_curvature\(")
def curv_generator_replaced_between_products():
    G = Configured()
    z = codes()
    return problem(G, z, [Call("curv", kind="hessian"), Call("matvec", u=W_like(z)),
                          Do(lambda p: setattr(p.G, "gen", torch.Generator().manual_seed(999))),
                          Call("matvec", u=W_like(z))], gens=[G.gen], f=f_imp, G_gens=lambda p: [p.G.gen])


@case("between forward and backward")
def mixed_jacobian_chunks_generator_and_train_batchnorm():
    """A batch of tangents cannot run train-mode batch norm: one pass per tangent, each from the same state."""
    G = nn.Sequential(Configured(), nn.BatchNorm1d(4, dtype=DT), nn.Tanh(), lin(4, 4))
    z = codes()
    return problem(G, z, [Call("mj", chunk_size=5), Call("mj", chunk_size=1)], gens=[G[0].gen])


# ----------------------------------------------------------------------------------------------
# Area 4: users' rules
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


def tanh_rule(scale=1.0, name=None, post=lambda t: t):
    def tanh_tangent(op):
        x, dx = op.primals["input"], op.tangents["input"]
        return op.primal(), post(scale * (1 - torch.tanh(x) ** 2) * dx)

    return named(tanh_tangent, name or ("right_tanh_tangent" if scale == 1 else "wrong_tanh_tangent"))


def mul_rule(scale_b=1.0, name="right_mul_tangent"):
    def mul_tangent(op):
        a, b = op.primals["input"], op.primals["other"]
        da, db = op.tangents["input"], op.tangents["other"]
        t = 0
        if da is not None:
            t = t + da * b
        if db is not None:
            t = t + scale_b * a * db
        return op.primal(), t

    return named(mul_tangent, name)


TANH_ARGS = ("input",)
MUL_ARGS = ("input", "other")

#: A rejected rule's warning: a RuntimeWarning that names the rule and gives both numbers of the dot-product test.
WRONG_WARNING = (r"^RuntimeWarning: .*{}.*disagree.*=\s*[-+]?(\d[\d.]*(e[-+]?\d+)?|nan|inf)"
                 r".*=\s*[-+]?(\d[\d.]*(e[-+]?\d+)?|nan|inf)")


def tanh_G():
    W1, W2 = mat(3, 6), mat(6, 4)
    return lambda q: torch.tanh(q @ W1) @ W2


def _rule_case(name, build_G, op, make_rule, arguments, steps_of, expect="exact", match=None, route_used=True):
    def build():
        G = build_G()
        z = codes()
        steps = [register_step(op, make_rule, arguments)]
        for step in steps_of(z):
            if route_used is not None and step.kind not in ("ig_fwd",):
                step.opts.update(used(route_used))
            steps.append(step)
        return problem(G, z, steps)

    build.__name__ = name
    case("user rules", expect=expect, match=match)(build)


def _mul_G(kind):
    W1, W2 = mat(3, 6), mat(6, 4)
    c = torch.randn(6, dtype=DT)
    if kind == "operator":
        return lambda q: ((q @ W1) * c) @ W2
    return lambda q: torch.ops.aten.mul.Tensor(q @ W1, c) @ W2


# "register each form G calls" (register's docstring): G writes h * c, which reaches mixedad as torch.Tensor.mul,
# never as torch.Tensor.__mul__. A rule registered for __mul__ must run, or register must say that this form is
# never seen (it does: a TypeError naming the form to register), right rule or wrong.
_rule_case("right_rule_tensor_dunder_mul_is_used", lambda: _mul_G("operator"), torch.Tensor.__mul__,
           lambda p: mul_rule(), MUL_ARGS, lambda z: [Call("mg"), Call("mg")], expect="exact|refused",
           match=r"^register\(torch\.Tensor\.__mul__\): .* reaches mixedad as torch\.Tensor\.mul")
_rule_case("wrong_rule_tensor_dunder_mul_is_caught", lambda: _mul_G("operator"), torch.Tensor.__mul__,
           lambda p: named(lambda op: (op.primal(), 2 * op.tangents["input"] * op.primals["other"]),
                           "mul_tangent_wrong_a"),
           MUL_ARGS, lambda z: [Call("mg")], expect="warns|refused",
           match=WRONG_WARNING.format("mul_tangent_wrong_a") + r"|^register\(torch\.Tensor\.__mul__\)",
           route_used=None)
# An OpOverload: a rule for torch.ops.aten.mul.Tensor, which G calls directly.
_rule_case("wrong_rule_aten_overload_mul_tensor", lambda: _mul_G("aten"), torch.ops.aten.mul.Tensor,
           lambda p: named(lambda op: (op.primal(), 2 * op.tangents["self"] * op.primals["other"]),
                           "aten_mul_tangent_wrong"), None,
           lambda z: [Call("mg"), *ig(2, W=W_like(z)), Call("mj", chunk_size=5)], expect="warns",
           match=WRONG_WARNING.format("aten_mul_tangent_wrong"), route_used=None)
_rule_case("right_rule_aten_overload_mul_tensor_vmap", lambda: _mul_G("aten"), torch.ops.aten.mul.Tensor,
           lambda p: named(lambda op: (op.primal(), op.tangents["self"] * op.primals["other"]),
                           "aten_mul_tangent"), None, lambda z: [Call("mg"), ROUTES["vmap"](z)[0]])
# Tangents of the wrong kind: a float32 tangent for a float64 op is wrong by round-off (rejected, warned); one of
# another shape, or a number, cannot be a tangent at all. Reverse mode's answer is the op's backward: reject the
# rule with the warning (or refuse, naming the rule), not crash in torch.
_rule_case("rule_tangent_float32_for_float64_op", tanh_G, torch.tanh,
           lambda p: tanh_rule(name="tanh_tangent_float32", post=lambda t: t.float()), TANH_ARGS,
           lambda z: [Call("mg")], expect="warns|refused",
           match=WRONG_WARNING.format("tanh_tangent_float32") + r"|tanh_tangent_float32 registered for torch.tanh "
                                                                 r"returned a tangent of shape", route_used=None)
_rule_case("rule_tangent_wrong_shape_broadcastable", tanh_G, torch.tanh,
           lambda p: tanh_rule(name="tanh_tangent_summed", post=lambda t: t.sum(0)), TANH_ARGS,
           lambda z: [Call("mg")], expect="warns|refused", match=r"tanh_tangent_summed", route_used=None)
_rule_case("rule_tangent_wrong_shape", tanh_G, torch.tanh,
           lambda p: tanh_rule(name="tanh_tangent_cut", post=lambda t: t[..., :3]), TANH_ARGS,
           lambda z: [Call("mg")], expect="warns|refused", match=r"tanh_tangent_cut", route_used=None)
_rule_case("rule_tangent_is_a_python_number", tanh_G, torch.tanh,
           lambda p: named(lambda op: (op.primal(), 0.0), "tanh_tangent_number"), TANH_ARGS,
           lambda z: [Call("mg")], expect="warns|refused", match=r"tanh_tangent_number", route_used=None)


def _raising_rule(op):
    raise ValueError("this rule is unfinished")


# Debatable: the rule is the user's code. But mixedad's own probe calls it first, swallows the error and trusts the
# rule ("the real call will raise it again"). Reverse mode needs no rule: reject it with a warning, or refuse
# with an error that names the rule, rather than let a bare ValueError out of the middle of G.
_rule_case("rule_that_raises", tanh_G, torch.tanh, lambda p: named(_raising_rule, "unfinished_tanh_tangent"),
           TANH_ARGS, lambda z: [Call("mg")], expect="warns|refused", match=r"unfinished_tanh_tangent",
           route_used=None)


def _dropout_rule(op):
    out = op.primal()
    p = op.primals.get("p", 0.5)
    return out, op.tangents["input"] * (out != 0) / (1 - p)


# A right rule for a random op: dropout's tangent is the mask the primal drew. The probe must compare it with the
# backward of the same draw, not reject it because the probe's own call drew another mask.
_rule_case("right_rule_for_random_op_dropout", lambda: (lambda W1, W2: (
    lambda q: F.dropout(torch.tanh(q @ W1), 0.4, training=True) @ W2))(mat(3, 6), mat(6, 4)), F.dropout,
    lambda p: named(_dropout_rule, "dropout_tangent"), None, lambda z: [Call("mg"), *ig(2, W=W_like(z))])


def _no_grad_tanh_G():
    W1, W2 = mat(3, 6), mat(6, 4)

    def G(q):
        h = q @ W1
        with torch.no_grad():
            s = torch.tanh(h)
        return (h * s) @ W2

    return G


_rule_case("right_rule_for_op_under_no_grad_is_not_used", _no_grad_tanh_G, torch.tanh, lambda p: tanh_rule(),
           TANH_ARGS, lambda z: [Call("mg"), *ig(2, W=W_like(z)), Call("mj", chunk_size=5)], route_used=False)
# A wrong rule for an op G only calls under no_grad is never used; a warning about it is not required.
_rule_case("wrong_rule_for_op_under_no_grad_changes_nothing", _no_grad_tanh_G, torch.tanh,
           lambda p: tanh_rule(2.0), TANH_ARGS, lambda z: [Call("mg"), Call("vmap", V=torch.randn(2, 4, 3, dtype=DT))],
           expect="exact|warns", match=WRONG_WARNING.format("wrong_tanh_tangent"), route_used=False)
_rule_case("wrong_rule_implicit_grad", tanh_G, torch.tanh, lambda p: tanh_rule(2.0), TANH_ARGS,
           lambda z: [Call("implicit", w=W_like(z), damping=DAMPING)], expect="warns",
           match=WRONG_WARNING.format("wrong_tanh_tangent"), route_used=None)


@case("user rules")
def rule_registered_while_program_cached_then_unregistered_input_grad():
    """input_grad's backward runs the default's program from its third call; a rule registered then is used,
    and after it is unregistered, never again."""
    G = seq_tanh()
    z = codes()
    W = W_like(z)
    steps = [*ig(None, W=W), *ig(None, W=W), *ig(None, W=W),
             register_step(torch.tanh, lambda p: tanh_rule(), TANH_ARGS),
             Call("ig_fwd"), Call("ig_bwd", W=W, **used()), Call("mg", **used()),
             unregister_step(torch.tanh)]
    for _ in range(3):
        steps += [Call("ig_fwd"), Call("ig_bwd", W=W, **used(False)), Call("mg", **used(False))]
    return problem(G, z, steps)


@case("user rules", expect="warns", match=WRONG_WARNING.format("wrong_tanh_tangent"))
def wrong_rule_registered_while_program_cached_vmap_and_jacobian():
    G = seq_tanh()
    z = codes()
    return problem(G, z, [Call("mg"), Call("mg"), Call("mg"),
                          register_step(torch.tanh, lambda p: tanh_rule(2.0), TANH_ARGS),
                          Call("vmap", V=torch.randn(2, 4, 3, dtype=DT)), Call("mj", chunk_size=4), Call("mg")])


# ----------------------------------------------------------------------------------------------
# Area 5: inputs written (by G, by f), and tensors G writes that its backward saved
# ----------------------------------------------------------------------------------------------

def _writer(kind):
    W, W2 = mat(3, 4), mat(2, 4)
    if kind == "out_into_z":  # torch.mul(q, 2, out=q): autograd refuses out= on a tensor that requires grad
        return lambda q: torch.tanh(torch.mul(q, 2.0, out=q) @ W)
    if kind == "copy_into_z":  # z overwritten with an affine function of itself (which saves nothing)
        return lambda q: torch.tanh(q.copy_(2.0 * q + 1.0) @ W)
    if kind == "copy_into_z_sin":  # sin saves its input, which copy_ then overwrites: double backward refuses
        return lambda q: torch.tanh(q.copy_(torch.sin(q) * 2.0) @ W)
    if kind == "copy_into_z_read_again":  # q * q saves q, then q is overwritten: double backward refuses
        return lambda q: torch.tanh(q.copy_(q * q + 1.0) @ W)
    if kind == "index_put_into_z":
        return lambda q: torch.tanh(q.index_put_((torch.tensor([0]),), q[1:2] * 3.0) @ W)
    if kind == "masked_fill_into_z":
        return lambda q: torch.tanh(q.masked_fill_(q > 0.5, 0.5) @ W)
    if kind == "setitem_reads_z":  # q[:, 1] = q[:, 0] ** 2: the power saved a view of q, then q is written
        def G(q):
            q[:, 1] = q[:, 0] ** 2
            return torch.tanh(q @ W)

        return G
    if kind == "second_of_tuple":  # z = (a, b); G writes only b
        return lambda a, b: torch.tanh(a @ W + b.mul_(1.5).sin_() @ W2)
    raise AssertionError(kind)


def _write_case(kind, route, expect="exact", match=None):
    def build():
        G = _writer(kind)
        if kind == "second_of_tuple":
            z = (codes(), codes(4, 2))
            v = (torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT))
        else:
            z, v = codes(), None
        if route == "vmap" and isinstance(z, tuple):
            steps = [Call("vmap", V=tuple(torch.randn(3, *t.shape, dtype=DT) for t in z))]
        else:
            steps = ROUTES[route](z[0] if isinstance(z, tuple) else z)
        if isinstance(z, tuple):
            for st in steps:
                if "W" in st.opts:
                    st.opts["W"] = tuple(W_like(t) for t in z)
        return problem(G, z, steps, v=v, writes_z=True)

    build.__name__ = f"G_writes_z__{kind}__{route}"
    case("inputs written", expect=expect, match=match or r"^(mixed_grad|input_grad|mixed_jacobian)\(")(build)


# Double backward refuses these (out= on a tensor that requires grad; a saved tensor overwritten). out= is refused
# by autograd itself, so mixedad refuses with an error of its own. Where double backward refuses only because a
# value it saved was overwritten, the derivative exists and forward mode, which saves nothing, computes it: mixedad
# may answer (docs/semantics.md; tests/_frontend/test_inputs.py checks such answers against the out-of-place G's
# double backward) or refuse; input_grad, a reverse pass through G, refuses.
for _route in ("mg", "ig_chunk"):
    _write_case("out_into_z", _route, expect="refused")
for _route in ("mg", "ig_chunk", "vmap"):
    _write_case("copy_into_z_read_again", _route, expect="refused|answered")
_write_case("copy_into_z_sin", "mg", expect="refused|answered")
_write_case("setitem_reads_z", "mg", expect="refused|answered")
_write_case("setitem_reads_z", "mj", expect="refused|answered")
for _route in ("five", "ig_chunk", "vmap", "mj"):
    _write_case("copy_into_z", _route)
for _route in ("five", "ig_chunk", "vmap"):
    _write_case("index_put_into_z", _route)
for _route in ("five", "mj"):
    _write_case("masked_fill_into_z", _route)
for _route in ("five", "ig_chunk", "vmap"):
    _write_case("second_of_tuple", _route)


def _layer_first(kind):
    if kind == "dropout_inplace_eval":
        return nn.Sequential(nn.Dropout(0.3, inplace=True), lin(3, 6), nn.Tanh(), lin(6, 4)).eval()
    if kind == "hardswish_inplace":
        return nn.Sequential(nn.Hardswish(inplace=True), lin(3, 6), nn.Tanh(), lin(6, 4))
    if kind == "nested_relu6_inplace":
        return nn.Sequential(nn.Sequential(nn.ReLU6(inplace=True), lin(3, 6)), nn.Tanh(), lin(6, 4))
    if kind == "silu_inplace_after_scale":  # a layer that writes in place the output of a view-returning layer
        return nn.Sequential(nn.Flatten(), nn.SiLU(inplace=True), lin(3, 6), nn.Tanh(), lin(6, 4))
    raise AssertionError(kind)


def _layer_case(kind, route):
    def build():
        G = _layer_first(kind)
        z = codes()
        return problem(G, z, ROUTES[route](z), writes_z=True)

    build.__name__ = f"sequential_{kind}_first__{route}"
    case("inputs written")(build)


for _route in ("five", "ig_chunk"):
    _layer_case("dropout_inplace_eval", _route)
for _route in ("five", "vmap", "ig_chunk"):
    _layer_case("hardswish_inplace", _route)
for _route in ("five", "mj"):
    _layer_case("nested_relu6_inplace", _route)
_layer_case("silu_inplace_after_scale", "five")


# A layer that writes in place a tensor the layer before saved for its backward: Sigmoid saves its output and
# ReLU(inplace=True) overwrites it. Double backward refuses ("modified by an inplace operation"); forward mode
# saves nothing and gives the out-of-place function's derivative (see above): answered or refused.
@case("inputs written", expect="refused|answered", match=r"^(mixed_grad|input_grad)\(")
def sequential_sigmoid_then_relu_inplace__five():
    G = nn.Sequential(lin(3, 6), nn.Sigmoid(), nn.ReLU(inplace=True), lin(6, 4))
    return problem(G, codes(), [Call("mg") for _ in range(5)])


def _tanh_output_scaled(route):
    def build():
        W1, W2 = mat(3, 6), mat(6, 4)

        def G(q):
            h = torch.tanh(q @ W1)
            h.mul_(2.0)  # tanh saved h for its backward
            return h @ W2

        z = codes()
        return problem(G, z, ROUTES[route](z))

    build.__name__ = f"tanh_output_scaled_in_place__{route}"
    case("inputs written", expect="refused|answered", match=r"^(mixed_grad|input_grad|mixed_jacobian)\(")(build)


for _route in ("mg", "ig_chunk", "mj"):
    _tanh_output_scaled(_route)


@case("inputs written")
def z_is_a_view_of_a_larger_tensor_G_writes_it():
    """z = base[:, 1:4] (not contiguous); G writes its input in place. base must be left as it was."""
    base = torch.randn(4, 5, dtype=DT)
    saved = base.clone()
    z = base[:, 1:4]
    W = mat(3, 4)
    G = lambda q: torch.tanh(q.mul_(2.0) @ W)  # noqa: E731

    def untouched(p):
        return [] if torch.equal(base, saved) else ["the tensor z is a view of was written"]

    return problem(G, z, [Call("mg"), Call("mg"), *ig(2, W=W_like(z)), Call("vmap", V=torch.randn(2, 4, 3, dtype=DT)),
                          Check(untouched)], writes_z=True)


def _f_writes(kind, route):
    def build():
        W1, W2 = mat(3, 6), mat(6, 4)
        G = lambda q: torch.tanh(q @ W1) @ W2  # noqa: E731

        if kind == "g":
            def f(y, g):
                g.mul_(2.0)  # f scales G's output in place (G's last op saved nothing it needs)
                return f_vec(y, g)
        else:
            def f(y, g):
                y.add_(0.0)  # an in-place write into y: autograd refuses it on a leaf that requires grad
                return f_vec(y, g)

        z = codes()
        return problem(G, z, ROUTES[route](z), f=f)

    build.__name__ = f"f_writes_{kind}_in_place__{route}"
    expect = "exact" if kind == "g" else "refused"
    case("inputs written", expect=expect, match=r"^(mixed_grad|input_grad|mixed_jacobian)\(")(build)


for _route in ("mg", "ig_chunk", "mj", "vmap"):
    _f_writes("g", _route)
for _route in ("mg", "ig_chunk"):
    _f_writes("y", _route)


# ----------------------------------------------------------------------------------------------
# Area 6: routes, caches and memory plans
# ----------------------------------------------------------------------------------------------

def route_is(expected):
    def check(p):
        report = p.ctx.get("report")
        if report is None:
            return ["no report"]
        return [] if report.route == expected else [
            f"tangent_report(G, z).route after call #{len(p.ctx.get('calls', []))}: {report.route!r}, "
            f"expected {expected!r}"]

    return Check(check)


@case("routes and plans")
def tangent_report_route_along_calls_and_rules():
    """route: what mixed_grad runs for G at these inputs now. A Sequential's third call with the same inputs
    runs the program; a rule of the user's sends G to the per-op pass; after it is unregistered the programs
    are written again (first call per-op pass, second checked, third the program)."""
    G = seq_tanh()
    z = codes()
    steps = [Call("report"), route_is("per-op pass"), Call("mg"), Call("report"), route_is("per-op pass"),
             Call("mg"), Call("report"), route_is("tangent program"), Call("mg"), Call("report"),
             route_is("tangent program"),
             register_step(torch.tanh, lambda p: tanh_rule(), TANH_ARGS), Call("report"), route_is("per-op pass"),
             Call("mg", **used()), Call("mg", **used()), Call("mg", **used()), Call("report"), route_is("per-op pass"),
             unregister_step(torch.tanh), Call("mg", **used(False)), Call("mg", **used(False)), Call("report"),
             route_is("tangent program"), Call("mg", **used(False))]
    return problem(G, z, steps)


@case("routes and plans")
def tangent_report_calls_do_not_count_as_calls():
    """Reports between calls take the per-op pass and leave the program's count alone: results exact throughout."""
    G = nn.Sequential(lin(3, 6), nn.BatchNorm1d(6, dtype=DT), nn.Tanh(), lin(6, 4))
    z = codes()
    steps = []
    for _ in range(4):
        steps += [Call("report"), Call("report"), Call("mg")]
    return problem(G, z, steps)


@case("routes and plans", rtol=1e-9)
def batchnorm_momentum_none_train_program_five_calls():
    """Cumulative averages (momentum=None) read num_batches_tracked: the program must update them as a plain
    forward does, call after call."""
    G = nn.Sequential(lin(3, 6), nn.BatchNorm1d(6, momentum=None, dtype=DT), nn.Tanh(), lin(6, 4))
    return problem(G, codes(), [Call("mg") for _ in range(5)])


@case("routes and plans")
def program_then_per_op_pass_block_then_program():
    G = seq_mlp("bn_eval")
    z = codes()
    steps = [Call("mg"), Call("mg"), Call("mg"), Call("mg", per_op=True), Call("mg", per_op=True), Call("mg")]
    return problem(G, z, steps)


class _SoftCube(Function):
    """A custom Function without jvp: the local rule, probed on its first use."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.tanh(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        t = torch.tanh(x)
        return g * (t + x * (1 - t * t))


def _plan_G(kind):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = lin(64, 64)

        def forward(self, x):
            h = self.l(x)
            if kind == "function":
                return Fn.apply(h)
            return torch.erf(h)

    Fn = type("SoftCubeFresh", (_SoftCube,), {})  # a new class: its probe is a first use
    return nn.Sequential(*[Block() for _ in range(3)])


def _erf_rule(op):
    x, dx = op.primals["input"], op.tangents["input"]
    wide = torch.cat([dx, dx, dx], 0)  # a rule that holds more than PyTorch's formula would
    return op.primal(), (2 / torch.pi ** 0.5) * torch.exp(-x * x) * wide[: x.shape[0]]


def _plan_case(kind):
    """plan before the first call: its mixed_grad peak may not be below the first real call's peak_memory, whose
    probe (a new Function, a new rule) the plan must count."""

    def build():
        G = _plan_G(kind)
        z = torch.randn(16, 64, dtype=DT)
        y = torch.randn(64, dtype=DT)

        def f(y, g):
            return ((g - y) ** 2 * y).sum()

        def ours(p):
            planned = mixedad.profiling.plan(p.f, p.G, p.z, p.y, methods=("mixed_grad",), device="cpu")
            result, peak = mixedad.profiling.peak_memory(mixedad.mixed_grad, p.f, p.G, p.z, p.y, p.v)
            if planned.peaks["mixed_grad"] < peak:
                p.problems.append(f"plan {planned.peaks['mixed_grad']} bytes < the first call's {peak} bytes")
            return result

        steps = []
        if kind == "rule":
            steps.append(register_step(torch.erf, lambda p: named(_erf_rule, "wide_erf_tangent"), TANH_ARGS))
        steps.append(Pair(lambda p: naive_mg(p), ours))
        return problem(G, z, steps, y=y, f=f)

    build.__name__ = f"plan_not_below_first_call__{kind}"
    case("routes and plans")(build)


_plan_case("function")
_plan_case("rule")


@case("routes and plans")
def plan_of_G_with_generator_leaves_it_alone():
    """A plan runs on meta copies: G's generator, the global sources and the buffers are untouched."""
    G = Configured()
    z = codes()
    return problem(G, z, [Call("plan"), Call("mg"), Call("plan"), *ig(2, W=W_like(z))], gens=[G.gen])


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

    Where G writes its input, G receives a non-leaf copy (double backward cannot write a leaf, so naive
    code clones it), and the caller's z is left as it was: mixedad writes nothing the caller passed.
    """
    G = p.G if G is None else G
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


def naive_mg(p, **o):
    G, z, y, f = _opts(p, o)
    v = o.get("v", p.v)
    with torch.enable_grad():
        yl = leaf_copies(y)
        leaves, spec = tree_flatten(yl)
        zl, out = naive_forward(p, G, z)
        gz = torch.autograd.grad(f(yl, out), zl, create_graph=True, allow_unused=True)
        gz = [torch.zeros_like(t) if g is None else g for g, t in zip(gz, zl)]
        grads = _grads(gz, leaves, _zs(v))
    return tree_unflatten([g.detach() for g in grads], spec)


def mixedad_mg(p, **o):
    G, z, y, f = _opts(p, o)
    if o.get("per_op"):
        with mixedad.per_op_pass():
            return mixedad.mixed_grad(f, G, z, y, o.get("v", p.v))
    return mixedad.mixed_grad(f, G, z, y, o.get("v", p.v), compile=o.get("compile", False))


def naive_vmap(p, V, **o):
    G, z, y, f = _opts(p, o)
    with torch.enable_grad():
        yl = leaf_copies(y)
        leaves, spec = tree_flatten(yl)
        zl, out = naive_forward(p, G, z)
        gz = torch.autograd.grad(f(yl, out), zl, create_graph=True)
        Vs = list(V) if isinstance(V, tuple) else [V]
        rows = [_grads(gz, leaves, [Vi[k] for Vi in Vs], retain_graph=True) for k in range(Vs[0].shape[0])]
    return tree_unflatten([torch.stack([r[i] for r in rows]).detach() for i in range(len(leaves))], spec)


def mixedad_vmap(p, V, **o):
    G, z, y, f = _opts(p, o)
    return torch.func.vmap(lambda v: mixedad.mixed_grad(f, G, z, y, v), randomness=o.get("randomness", "error"))(V)


def naive_mj(p, **o):
    G, z, y, f = _opts(p, o)
    with torch.enable_grad():
        yl = leaf_copies(y)
        leaves, spec = tree_flatten(yl)
        zl, out = naive_forward(p, G, z)
        (gz,) = torch.autograd.grad(f(yl, out), zl, create_graph=True)
        rows = []
        for i in range(z.numel()):
            e = torch.zeros(z.numel(), dtype=z.dtype)
            e[i] = 1
            rows.append(_grads([gz], leaves, [e.reshape(z.shape)], retain_graph=True))
    return tree_unflatten([torch.stack([r[j] for r in rows]).reshape(*z.shape, *leaf.shape).detach()
                           for j, leaf in enumerate(leaves)], spec)


def mixedad_mj(p, **o):
    G, z, y, f = _opts(p, o)
    return mixedad.mixed_jacobian(f, G, z, y, chunk_size=o.get("chunk_size"))


def outer_loss(dfdz, W):
    if isinstance(dfdz, (tuple, list)):
        return sum(outer_loss(d, w) for d, w in zip(dfdz, W))
    return (W * dfdz).sum() + 0.5 * (dfdz ** 2).sum()


def naive_ig_fwd(p, chunk=None, **o):
    with torch.enable_grad():
        yl = leaf_copies(p.y)
        zl, outs = naive_forward(p, chunk=chunk)
        total = p.f(yl, outs) if chunk is None else sum(p.f(yl, out) for out in outs)
        gz = torch.autograd.grad(total, zl, create_graph=True)
    p.ctx["yl"], p.ctx["dfdz"] = tree_leaves(yl), gz if isinstance(p.z, (tuple, list)) else gz[0]
    return [g.detach() for g in gz]


def mixedad_ig_fwd(p, chunk=None, **o):
    yl = leaf_copies(p.y)
    dfdz = mixedad.input_grad(p.f, p.G, p.z, yl, chunk_size=chunk)
    p.ctx["yl"], p.ctx["dfdz"] = tree_leaves(yl), dfdz
    return [d.detach() for d in _zs(dfdz)]


def ig_bwd(p, W, retain=False, also=(), **o):
    with torch.enable_grad():
        loss = outer_loss(p.ctx["dfdz"], W)
        return [g.detach() for g in _grads([loss], [*p.ctx["yl"], *also], retain_graph=retain)]


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
# it. An operator and its products leave G's buffers and every random source as they were (docs/semantics.md,
# "Limits"): the naive twin puts them back after its forward, as the first review's does.
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


def naive_dense(p, **o):
    zl = p.ctx["curv"][2][0]
    n = zl.numel()
    rows = []
    for i in range(n):
        e = torch.zeros(n, dtype=zl.dtype)
        e[i] = 1
        rows.append(_naive_product(p, e.reshape(zl.shape)).reshape(-1))
    return torch.stack(rows)


def _naive_damped_hessian(p, y_tree, damping, z=None):
    (zl,), out = naive_forward(p, z=z)
    (gz,) = torch.autograd.grad(p.f(y_tree, out), zl, create_graph=True)
    n = zl.numel()
    H = []
    for i in range(n):
        e = torch.zeros(n, dtype=zl.dtype)
        e[i] = 1
        H.append(_grads([gz], [zl], [e.reshape(zl.shape)], retain_graph=True)[0].reshape(-1))
    return torch.stack(H) + damping * torch.eye(n, dtype=zl.dtype), gz, zl


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


def _cached_params(p):
    return list(p.G.parameters())


def naive_cached(p, chunk_size=1, **o):
    for q in _cached_params(p):
        q.grad = None
    with torch.enable_grad():
        L = p.g_of(torch.stack([p.G(x) for x in p.inputs]))
        L.backward()
    out = [L.detach()] + [q.grad.clone() for q in _cached_params(p)]
    for q in _cached_params(p):
        q.grad = None
    return out


def mixedad_cached(p, chunk_size=1, **o):
    for q in _cached_params(p):
        q.grad = None
    L = mixedad.cached_backward(p.G, p.inputs, p.g_of, chunk_size=chunk_size)
    out = [L] + [q.grad.clone() for q in _cached_params(p)]
    for q in _cached_params(p):
        q.grad = None
    return out


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


def mixedad_report(p, **o):
    p.ctx["report"] = mixedad.tangent_report(p.G, p.z)
    return None


def mixedad_plan(p, **o):
    mixedad.profiling.plan(p.f, p.G, p.z, p.y, methods=("mixed_grad",), device="cpu")
    return None


CALLS = {
    "mg": (naive_mg, mixedad_mg),
    "vmap": (naive_vmap, mixedad_vmap),
    "mj": (naive_mj, mixedad_mj),
    "ig_fwd": (naive_ig_fwd, mixedad_ig_fwd),
    "ig_bwd": (ig_bwd, ig_bwd),
    "curv": (naive_curv, mixedad_curv),
    "matvec": (lambda p, u, **o: _naive_product(p, u), lambda p, u, **o: p.ctx["op"] @ u),
    "dense": (naive_dense, lambda p, **o: p.ctx["op"].dense()),
    "implicit": (naive_implicit_grad, mixedad_implicit),
    "argmin_fwd": (naive_argmin_fwd, mixedad_argmin_fwd),
    "argmin_bwd": (naive_argmin_bwd, mixedad_argmin_bwd),
    "cached": (naive_cached, mixedad_cached),
    "report": (lambda p, **o: None, mixedad_report),
    "plan": (lambda p, **o: None, mixedad_plan),
    "ig_other": (_ig_other(True), _ig_other(False)),
}


# ----------------------------------------------------------------------------------------------
# The harness: two copies, the same random states, compare results and what is left behind
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


def evaluate(c):
    """Run one case (torch on one thread: the sizes are tiny). Returns (verdict, detail, leaks, warnings, error)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _evaluate(c)
    finally:
        torch.set_num_threads(threads)


def _evaluate(c):
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
    attrs_after = _attributes()
    changed = sorted(k for k in attrs_before if attrs_after.get(k) != attrs_before[k])
    if changed:
        leaks.append(f"torch attributes patched: {', '.join(changed)}")
    for label, t, saved in caller:
        if not _close_tensors(t.detach(), saved, 0.0):
            leaks.append(f"the caller's {label} was written")
    if truth_error is None or error is not None:
        if error is not None:  # a refusal writes none of cached_backward's inputs, whatever the naive code wrote
            expected_effects = {**expected_effects, "inputs": inputs_before}
        leaks += compare_effects(expected_effects, effects(ours))
    leaks += ours.problems
    messages = [f"{w.category.__name__}: {w.message}".replace("\n", " ") for w in caught]
    return _verdict(c, results, error, expected, truth_error, leaks, messages)


def _verdict(c, results, error, expected, truth_error, leaks, messages):
    short = [m[:160] for m in messages if "mixedad" in m or "disagrees" in m or "tangent" in m]
    if error is not None and truth_error is not None and len(results) > len(expected):
        return "answered", (f"call #{len(expected) + 1} answered where the naive code raises "
                            f"({first_line(truth_error)}); then: {first_line(error)}"), leaks, short, None
    if error is not None:
        text = str(error).strip()
        name = "refused" if OWN_ERROR.match(text) else "crash"
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


def ok(c, verdict, leaks, text):
    if verdict not in c.expect.split("|"):
        return False
    if verdict == "refused" and c.match and not re.search(c.match, text or "", re.S):
        return False
    return not leaks


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_state_more(c):
    check(c, evaluate)


def test_there_are_enough_cases():
    assert len(CASES) >= 60
    assert len({c.name for c in CASES}) == len(CASES)


def print_table():
    """``python -m tests.test_review_state_more``: the verdicts now, one row a case."""
    counts, by_area = {}, {}
    print("| area | case | expected | got | ok | relative error / detail |")
    print("|---|---|---|---|---|---|")
    t0 = time.perf_counter()
    for c in CASES:
        t = time.perf_counter()
        verdict, detail, leaks, messages, text = evaluate(c)
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
    print(f"{len(CASES)} cases, {counts.get(True, 0)} ok, {counts.get(False, 0)} failing, "
          f"{time.perf_counter() - t0:.1f} s")
    for area, (good, bad) in by_area.items():
        print(f"  {area}: {good + bad} cases, {bad} failing")


if __name__ == "__main__":
    print_table()
