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
and a sequence of steps: calls of mixedad, each with a naive twin (double backward,
``torch.autograd.grad(..., create_graph=True)``, one plain forward of G per call and per chunk),
things the user does between calls (``Do``), checks of mixedad's side only (``Check``), and ``Pair``
steps whose two sides are written out by the case (threads, memory plans). The naive twins and the
harness, shared with the first review, are in tests/review_state_common.py; this file holds the
cases. The case is built twice from the same seeds; one copy runs the naive sequence, the other
mixedad's, from the same random states. Verdicts:

- ``exact``: every result equals its naive twin's, relative error < 1e-9 (float64);
- ``refused``: a step raises an error of mixedad's own (the message opens with the public call)
  that matches the case's regex; where the naive code raises, only a refusal is right;
- ``warns``: exact, and a warning matching the case's regex was given.

After every case, whatever the verdict, these must hold (a "leak" otherwise): torch's global RNG,
Python's ``random``, NumPy's global state, each ``torch.Generator`` G uses and each other random
source the case names (a NumPy ``Generator``, a ``random.Random``) end where the naive sequence
leaves them; module buffers, parameters, training flags and plain attributes (numbers, strings) as
the naive sequence leaves them; the caller's v, y and the tensors the steps pass unchanged, and z
and ``cached_backward``'s inputs as the naive sequence leaves them; no torch function or dispatch
mode, forward-AD level, functorch level or grad mode left behind, no torch attribute patched; no
right rule rejected; and each ``Check`` of the case.

Where the right answer is debatable the case says so in a comment, and takes reverse mode's answer
(double backward's number, or its refusal, which mixedad must give as an error of its own).

``python -m tests.test_review_state_more`` prints a table of the verdicts now.
"""
import random
import re
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

import mixedad

from tests.review_state_common import (DAMPING, DT, MUL_ARGS, RTOL, SHARED_ROUTES, TANH_ARGS, WRONG_WARNING, Call,
                                       Check, Do, Pair, Review, codes, f_imp, f_vec, forget, ig, ig_bwd, igamma_tail,
                                       lin, mat, mixedad_ig_fwd, mixedad_mg, mul_rule, naive_ig_fwd, naive_mg, named,
                                       no_grad_do, outer_loss, problem, register_step, seq_mlp, seq_tanh, tanh_G,
                                       tanh_rule, unregister_step, used, W_like)
from tests.seams_common import check

#: Errors of mixedad's own open with one of the public calls this review makes (profiling's plan and the rules'
#: register among them, which the first review does not call).
OWN_ERROR = re.compile(r"^\s*(mixed_grad|input_grad|mixed_jacobian|z_curvature|implicit_grad|implicit_argmin|"
                       r"cached_backward|tangent_report|plan|register)\(")
REVIEW = Review(OWN_ERROR)
CASES, case = REVIEW.cases, REVIEW.case

pytestmark = pytest.mark.filterwarnings("ignore")

# ----------------------------------------------------------------------------------------------
# The case table: the routes G is tried with
# ----------------------------------------------------------------------------------------------

#: The calls a random G is tried with: each runs G more than once in mixedad (a restart, a replay, products).
#: Unlike the first review's, a vmap over v here takes randomness="same" (an f that draws is vmapped on this route,
#: which vmap's default randomness="error" refuses), and a GGN operator takes one product.
ROUTES = {
    **SHARED_ROUTES,
    "curv_ggn": lambda z: [Call("curv", kind="ggn"), Call("matvec", u=W_like(z))],
    "vmap": lambda z: [Call("vmap", V=torch.randn(3, *z.shape, dtype=DT), randomness="same")],
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


def _at_once(one, n_calls):
    """Two threads started together, thread i calling ``one(i)`` ``n_calls`` times: their results, or the first
    error either raised."""
    out, errors = [[], []], []
    start = threading.Barrier(2)

    def run(i):
        try:
            start.wait()
            for _ in range(n_calls):
                out[i].append(one(i))
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
            return _at_once(lambda i: one(p, i, False), n_calls)

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
        return _at_once(lambda i: mixedad_mg(p, G=Gs[i]), 4)

    return problem(Gs[0], z, [Pair(naive, ours)], modules=Gs)


# ----------------------------------------------------------------------------------------------
# Area 3: G's state between a saved pass and its use, and saved passes beside other calls
# ----------------------------------------------------------------------------------------------


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


#: A rejected rule's warning: a RuntimeWarning that names the rule and gives both numbers of the dot-product test.


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
# The table's tests (the harness, the calls and their naive twins: tests/review_state_common.py)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_state_more(c):
    check(c, REVIEW.evaluate)


def test_there_are_enough_cases():
    assert len(CASES) >= 60
    assert len({c.name for c in CASES}) == len(CASES)


if __name__ == "__main__":
    REVIEW.print_table()
