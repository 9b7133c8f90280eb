"""The default's tangent programs (``mixed_grad`` without ``compile=True``): the route, and every seam case.

The default runs G's tangent program eagerly from the third call with the same inputs' layouts
(:func:`mixedad._programs.cache.push_program`), after checking it once against the per-op pass.
Here each seam case of ``tests/test_seams.py`` and ``tests/test_seams_more.py`` runs with programs
written and run from the first call, unchecked (``programs_unchecked``): the cases whose G is an
``nn.Sequential`` chain of ``torch.nn`` layers with rules run through the program, so that its own
numbers and what it leaves behind (buffers, random state, flags) meet the same verdict as the
per-op pass: exact against double backward, or refused with the case's message, with no leak; the
others must take the per-op pass as before.
Below them, the route itself: which call writes, checks and runs; every zoo generator call after
call against double backward (and its buffers against plain forwards); a wrong or failing program
dropped with a warning; what a trace must refuse or clean up; the program's exact peak bytes.
"""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixedad
from mixedad._programs import cache, rules
from mixedad._programs.cache import programs_unchecked
from mixedad.reference import double_backward_mixed_grad
from tests import test_seams, test_seams_more
from tests._programs.common import D, f
from tests._programs.common import problem as _problem
from tests.seams_common import cases_with_open_marked
from tests.test_seams_more import CarryCache, InPlaceCounter

#: As in the seam modules: warnings are part of each case's verdict (its messages), not errors here.
pytestmark = pytest.mark.filterwarnings("ignore")


def _params(module):
    for c in cases_with_open_marked(module.CASES, module.OPEN):
        if isinstance(c, type(pytest.param(None))):  # an open case: marked as in its own module
            yield pytest.param(module, c.values[0], marks=c.marks, id=f"{_short(module)}-{c.values[0].name}")
        else:
            yield pytest.param(module, c, id=f"{_short(module)}-{c.name}")


def _short(module):
    return module.__name__.rsplit(".", 1)[-1]


@pytest.mark.parametrize("module, c", [*_params(test_seams), *_params(test_seams_more)])
def test_seam_through_the_program(module, c):
    with programs_unchecked():
        module.check(c)


# --- the route itself ----------------------------------------------------------------------------


#: Zoo members with a default program: the nn.Sequential chains of torch.nn layers (the others take the per-op
#: pass on every call, and compile=True, which traces their code).
WITH_PROGRAM = {"mlp", "dcgan"}


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", sorted(mixedad.zoo.MEMBERS))
def test_every_zoo_generator_by_the_default_equals_double_backward_call_after_call(name, mode):
    """Calls 1 (per-op pass), 2 (the check) and 3, 4 (the program alone) against double backward in float64, and
    G's buffers after them against four plain forwards (train mode updates running statistics)."""
    G = mixedad.zoo.MEMBERS[name](dtype=D).train(mode == "train")
    twin = mixedad.zoo.MEMBERS[name](dtype=D).train(mode == "train")
    z, y, v = _problem(G)
    twin.load_state_dict(G.state_dict())  # after _problem's forward
    for call in range(4):
        reference = double_backward_mixed_grad(f, copy.deepcopy(twin), z, y, v)
        ours = mixedad.mixed_grad(f, G, z, y, v)
        with torch.no_grad():
            twin(z)  # G's buffers end as one plain forward leaves them
        scale = reference.abs().max()
        assert (ours - reference).abs().max() <= 1e-9 * scale, f"call {call + 1}"
        for (key, mine), theirs in zip(G.state_dict().items(), twin.state_dict().values()):
            assert torch.equal(mine, theirs), f"call {call + 1}: buffer {key}"
    if name in WITH_PROGRAM:
        [entry] = cache._EAGER[G].values()
        assert entry.status == "program", entry.reason
    else:
        assert G not in cache._EAGER  # not an nn.Sequential: no key, no program


def _counting_runs(monkeypatch):
    runs = []
    real = cache._run

    def counted(call, G, zs, vs, eager_push, entry):
        runs.append(entry.status)
        return real(call, G, zs, vs, eager_push, entry)

    monkeypatch.setattr(cache, "_run", counted)
    return runs


def test_the_first_call_writes_nothing_the_second_checks_and_later_ones_run_the_program(monkeypatch):
    G = mixedad.zoo.mlp(3, 8, dtype=D)
    z, y, v = _problem(G)
    writes = []
    real_write = cache.write
    monkeypatch.setattr(cache, "write", lambda *a, **k: writes.append(1) or real_write(*a, **k))
    runs = _counting_runs(monkeypatch)
    mixedad.mixed_grad(f, G, z, y, v)
    assert writes == [] and G not in cache._EAGER
    mixedad.mixed_grad(f, G, z, y, v)
    assert writes == [1] and runs == []
    [entry] = cache._EAGER[G].values()
    assert entry.status == "program" and entry.difference <= 1e-12 and not entry.compiled
    mixedad.mixed_grad(f, G, z, y, v)
    mixedad.mixed_grad(f, G, z, y, v)
    assert writes == [1] and runs == ["program", "program"]
    z2, y2, v2 = _problem(G, batch=5)  # new layouts: the per-op pass first again
    mixedad.mixed_grad(f, G, z2, y2, v2)
    assert writes == [1]


def test_a_program_that_differs_from_the_per_op_pass_is_dropped_with_a_warning(monkeypatch):
    G = mixedad.zoo.mlp(3, 8, dtype=D, activation="relu")
    z, y, v = _problem(G)
    per_op = mixedad.mixed_grad(f, G, z, y, v)
    wrong = rules._pointwise_module(lambda t, x, y_, params: 2 * torch.ops.aten.threshold_backward(t, y_, 0), ())
    monkeypatch.setitem(rules.MODULES, nn.ReLU, wrong)  # a rule with a wrong tangent, as a bug would write
    with pytest.warns(RuntimeWarning, match="tangent program differs from mixedad's per-op pass .*please report"):
        second = mixedad.mixed_grad(f, G, z, y, v)
    third = mixedad.mixed_grad(f, G, z, y, v)
    assert torch.equal(second, per_op) and torch.equal(third, per_op)
    [entry] = cache._EAGER[G].values()
    assert entry.status == "eager"


def _ill_conditioned_dcgan():
    """float32, eval mode, 8 extra blocks: one ReLU input of 32768 lies 2.5e-6 from zero (float64), within
    float32's round-off, and the program, whose convolutions carry the batch norms, takes the other side of the
    kink from the per-op pass: they lie 4.2e-3 apart."""
    G, z, y, v = mixedad.benchmark.build("dcgan", 8, 16, 8, torch.float32, "cpu")
    return G.eval(), z, y, v


def test_a_program_on_an_ill_conditioned_g_equals_the_per_op_pass_bit_for_bit():
    """The check stays tight (a tangent 0.5% off fails), and a program whose primal is G's own calls passes it on a
    G where a ReLU input lies within round-off of zero: it takes that kink as the per-op pass (and double
    backward) takes it. A program with batch norms folded into the convolutions' primal, channels-last, lay
    4.2e-3 from the per-op pass here."""
    G, z, y, v = _ill_conditioned_dcgan()
    first = mixedad.mixed_grad(f, G, z, y, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        second = mixedad.mixed_grad(f, G, z, y, v)
    [entry] = cache._EAGER[G].values()
    assert entry.status == "program" and entry.difference == 0.0
    third = mixedad.mixed_grad(f, G, z, y, v)
    assert torch.equal(second, first) and torch.equal(third, first)


def _linear_leaking_its_bias(e):
    """A wrong rule, as a bug would write it: nn.Linear's tangent with the bias added (not linear in v)."""
    graph = e.builder.graph
    return e.call(F.linear, e.only_first(), graph.get_attr(f"{e.node.target}.weight"),
                  graph.get_attr(f"{e.node.target}.bias"))


@pytest.mark.parametrize("bug", ["relu 5%", "tanh 2%", "linear bias in the tangent"])
def test_a_wrong_program_is_dropped_where_round_off_is_large(monkeypatch, bug):
    """On the ill-conditioned DCGAN (and a small MLP for nn.Linear), small wrong tangents fail the check."""
    if bug == "linear bias in the tangent":
        G = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
        z, y, v = (torch.randn(5, 4), torch.randn(5, 3), torch.randn(5, 4))
        module, rule = nn.Linear, _linear_leaking_its_bias
    else:
        G, z, y, v = _ill_conditioned_dcgan()
        scale, op = (1.05, torch.ops.aten.threshold_backward) if bug == "relu 5%" else (1.02, None)
        module = nn.ReLU if bug == "relu 5%" else nn.Tanh
        rule = rules._pointwise_module(
            (lambda t, x, y_, params: scale * torch.ops.aten.threshold_backward(t, y_, 0)) if op is not None else
            (lambda t, x, y_, params: scale * torch.ops.aten.tanh_backward(t, y_)), ())
    mixedad.mixed_grad(f, G, z, y, v)
    monkeypatch.setitem(rules.MODULES, module, rule)
    with pytest.warns(RuntimeWarning, match="tangent program differs from mixedad's per-op pass .*please report"):
        mixedad.mixed_grad(f, G, z, y, v)
    [entry] = cache._EAGER[G].values()
    assert entry.status == "eager"


def test_a_program_that_raises_later_falls_back_to_the_per_op_pass_with_a_warning(monkeypatch):
    G = mixedad.zoo.mlp(3, 8, dtype=D)
    z, y, v = _problem(G)
    per_op = [mixedad.mixed_grad(f, G, z, y, v) for _ in range(2)][0]
    [entry] = cache._EAGER[G].values()

    def broken(*args):
        raise RuntimeError("broken on purpose")

    entry.run = broken
    with pytest.warns(RuntimeWarning, match="runs its per-op pass .*broken on purpose"):
        assert torch.equal(mixedad.mixed_grad(f, G, z, y, v), per_op)
    assert entry.status == "eager"


@pytest.mark.filterwarnings("ignore:mixedad. mixed_grad.* with compile=True runs eager")
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("reassign", [False, True])
def test_a_forward_that_writes_its_buffer_gets_no_program_and_stays_exact(reassign, compile):
    """Found reviewing the default route: the trace ran ``self.calls += 1`` on the buffer itself, so the check
    passed and every later compiled call was 17% off with the counter stuck (compile=True before this)."""
    G, twin = InPlaceCounter(reassign).eval(), InPlaceCounter(reassign).eval()  # writes into its own buffer
    twin.load_state_dict(G.state_dict())
    z, y, v = torch.randn(4, 5, dtype=D), torch.randn(4, 4, dtype=D), torch.randn(4, 5, dtype=D)
    for call in range(4):
        reference = double_backward_mixed_grad(f, twin, z, y, v)
        ours = mixedad.mixed_grad(f, G, z, y, v, compile=compile)
        assert torch.allclose(ours, reference, rtol=1e-12, atol=0), f"call {call + 1}"
        assert G.calls.item() == call + 1
    if compile:  # G's code traced, and the write refused (reassigned: a new buffer, a new key each call)
        entries = cache._CACHE[G].values()
        assert entries and all(e.status == "eager" and "calls" in e.reason for e in entries)
    else:  # the default writes programs for nn.Sequential chains of torch.nn layers only
        assert G not in cache._EAGER


@pytest.mark.filterwarnings("ignore:mixedad. mixed_grad.* with compile=True runs eager")
@pytest.mark.parametrize("compile", [False, True])
def test_a_refused_trace_leaves_no_proxy_in_an_attribute(compile):
    """Found reviewing the default route: after a trace refused ``self.cache = h``, the cache held the trace's
    proxy, and G's next call crashed."""
    G = CarryCache().eval()  # keeps a tensor between calls: a trace stored its proxy there
    z, y, v = torch.randn(4, 5, dtype=D), torch.randn(4, 4, dtype=D), torch.randn(4, 5, dtype=D)
    for _ in range(3):
        mixedad.mixed_grad(f, G, z, y, v, compile=compile)
        assert type(G.cache) is torch.Tensor
    G(z)  # and G still runs


def test_the_program_peak_is_flat_in_depth_and_no_higher_than_the_per_op_pass():
    """Exact bytes, under mixedad.profiling (which the default's programs run under): the third call runs G's
    program."""
    from mixedad.benchmark import build, objective
    from mixedad.profiling import peak_memory

    for model, width, batch in [("dcgan", 8, 4), ("mlp", 32, 8)]:
        peaks = {}
        for depth in (1, 4):
            for mode in ("eval", "train") if model == "dcgan" else ("eval",):
                G, z, y, v = build(model, depth, width, batch, torch.float64, "cpu")
                G.train(mode == "train").requires_grad_(False)
                with mixedad.programs.per_op_pass():
                    _, per_op = peak_memory(lambda: mixedad.mixed_grad(objective, G, z, y, v))
                for _ in range(2):
                    mixedad.mixed_grad(objective, G, z, y, v)
                [entry] = cache._EAGER[G].values()
                assert entry.status == "program", (model, entry.reason)
                _, program = peak_memory(lambda: mixedad.mixed_grad(objective, G, z, y, v))
                assert program <= per_op, (model, depth, mode, program, per_op)
                peaks[depth, mode] = program
        for mode in {m for _, m in peaks}:
            assert peaks[1, mode] == peaks[4, mode], (model, mode, peaks)


def test_per_op_pass_keeps_programs_out_and_ends_with_its_block_even_on_error():
    G = mixedad.zoo.mlp(3, 8, dtype=D)
    z, y, v = _problem(G)
    with mixedad.programs.per_op_pass():
        for _ in range(3):
            mixedad.mixed_grad(f, G, z, y, v)
    assert G not in cache._EAGER
    with pytest.raises(ZeroDivisionError), mixedad.programs.per_op_pass():
        1 / 0
    for _ in range(2):  # outside, a first call and a second that writes and checks the program
        mixedad.mixed_grad(f, G, z, y, v)
    [entry] = cache._EAGER[G].values()
    assert entry.status == "program"


def test_a_submodule_switched_to_eval_gets_its_program_after_all():
    """Train-mode dropout draws random numbers: no program. Its layer put in eval mode alone: a program."""
    G = nn.Sequential(nn.Linear(4, 4, dtype=D), nn.Dropout(0.5), nn.Tanh())
    z, v, y = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)
    for _ in range(3):
        mixedad.mixed_grad(f, G, z, y, v)
    assert [e.status for e in cache._EAGER[G].values()] == ["eager"]
    G[1].eval()
    for _ in range(3):
        ours = mixedad.mixed_grad(f, G, z, y, v)
    assert "program" in [e.status for e in cache._EAGER[G].values()]
    assert torch.allclose(ours, double_backward_mixed_grad(f, G, z, y, v), rtol=1e-12, atol=0)


def test_the_layouts_seen_per_G_are_bounded(monkeypatch):
    monkeypatch.setattr(cache, "MAX_SEEN", 3)
    G = mixedad.zoo.mlp(2, 4, dtype=D)
    for batch in range(1, 7):
        z = torch.randn(batch, 4, dtype=D)
        mixedad.mixed_grad(f, G, z, z, z)
    assert len(cache._SEEN[G]) == 3


@pytest.mark.filterwarnings("ignore:mixedad. mixed_grad.* with compile=True runs eager")
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("where", ["module", "pre", "global"])
def test_a_hook_added_after_the_program_is_in_use_is_run(where, compile):
    """Found by a review: the key left hooks out, so a hook added later was never run (4.7 off, compile=True too)."""
    G = nn.Sequential(nn.Linear(4, 4, dtype=D), nn.Tanh(), nn.Linear(4, 4, dtype=D))
    z, y, v = (torch.randn(3, 4, dtype=D) for _ in range(3))
    for _ in range(3):
        mixedad.mixed_grad(f, G, z, y, v, compile=compile)
    double = lambda m, args, out: out * 2  # noqa: E731
    if where == "module":
        handle = G[1].register_forward_hook(double)
    elif where == "pre":
        handle = G[1].register_forward_pre_hook(lambda m, args: (args[0] * 3,))
    else:
        handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: out * 2 if m is G[1] else None)
    try:
        for _ in range(3):
            ours = mixedad.mixed_grad(f, G, z, y, v, compile=compile)
            assert torch.allclose(ours, double_backward_mixed_grad(f, G, z, y, v), rtol=1e-10, atol=0)
    finally:
        handle.remove()


@pytest.mark.parametrize("compile", [False, True])
def test_a_layer_class_changed_after_import_gets_no_program_and_says_so(compile, recwarn):
    """Found by a review: with ``nn.Hardtanh.forward`` replaced between calls, the program took the Hardtanh rule
    anyway; the check caught it (difference 1) but blamed mixedad ("please report") or the compiler. Now the chain
    refuses the changed class (the default takes the per-op pass, silently) and compile=True names the change."""
    G = nn.Sequential(nn.Linear(4, 4, dtype=D), nn.Hardtanh(), nn.Linear(4, 4, dtype=D))
    z, y, v = (torch.randn(3, 4, dtype=D) for _ in range(3))
    for _ in range(3):
        mixedad.mixed_grad(f, G, z, y, v, compile=compile)
    original = nn.Hardtanh.forward
    nn.Hardtanh.forward = lambda self, x: torch.tanh(x) * 2
    try:
        for _ in range(3):
            ours = mixedad.mixed_grad(f, G, z, y, v, compile=compile)
            assert torch.allclose(ours, double_backward_mixed_grad(f, G, z, y, v), rtol=1e-10, atol=0)
    finally:
        nn.Hardtanh.forward = original
    messages = [str(w.message) for w in recwarn if "mixedad" in str(w.message)]
    assert not any("differs" in m or "report" in m for m in messages), messages
    if compile:
        assert any("Hardtanh whose class was changed after mixedad was imported" in m for m in messages), messages
    assert rules.module_rule(G[1]) is not None  # the class as found again: its rule holds


def test_the_default_writes_programs_for_sequential_chains_of_torch_layers_only():
    inner = nn.Sequential(nn.Linear(4, 6, dtype=D), nn.ReLU(inplace=True))
    chain = nn.Sequential(nn.Unflatten(-1, (4, 1, 1)), nn.Flatten(), inner, nn.Linear(6, 4, dtype=D), nn.Tanh())

    class Custom(nn.Module):
        def forward(self, x):
            return x * 2

    class MySequential(nn.Sequential):
        pass

    with_user_layer = nn.Sequential(nn.Linear(4, 4, dtype=D), Custom())
    subclass = MySequential(nn.Linear(4, 4, dtype=D), nn.Tanh())
    z, y, v = (torch.randn(3, 4, dtype=D) for _ in range(3))
    for G, reason in [(chain, None), (with_user_layer, "layer 1 is a Custom"), (subclass, "no key")]:
        for _ in range(4):
            ours = mixedad.mixed_grad(f, G, z, y, v)
            assert torch.allclose(ours, double_backward_mixed_grad(f, G, z, y, v), rtol=1e-12, atol=0)
        if reason == "no key":  # a subclass may do more in its forward: not even a key is computed
            assert G not in cache._EAGER
            continue
        [entry] = cache._EAGER[G].values()
        if reason is None:
            assert entry.status == "program", entry.reason
        else:
            assert entry.status == "eager" and reason in entry.reason


def test_a_program_off_by_round_off_only_passes_and_one_off_by_half_a_percent_does_not(monkeypatch):
    """The default's check is tight: its program runs the per-op pass's kernels (a review saw 0.7% accepted at the
    compiled path's float32 tolerance)."""
    G = mixedad.zoo.mlp(3, 8, activation="relu")
    z, y, v = (torch.randn(5, 8) for _ in range(3))
    wrong = rules._pointwise_module(lambda t, x, y_, params: 1.005 * torch.ops.aten.threshold_backward(t, y_, 0), ())
    monkeypatch.setitem(rules.MODULES, nn.ReLU, wrong)
    mixedad.mixed_grad(f, G, z, y, v)
    with pytest.warns(RuntimeWarning, match="differs from mixedad's per-op pass"):
        mixedad.mixed_grad(f, G, z, y, v)


def test_meta_inputs_take_the_per_op_pass():
    G = mixedad.zoo.mlp(2, 4, device="meta")
    z, y, v = (torch.empty(3, 4, device="meta") for _ in range(3))
    for _ in range(3):
        assert mixedad.mixed_grad(f, G, z, y, v).device.type == "meta"
    assert G not in cache._EAGER


def test_a_float32_chain_computes_its_primal_as_a_plain_forward_within_the_per_op_pass_memory():
    """float32 on the CPU, eval and train mode: the program's primal is a plain forward's bit for bit, in its layout,
    its tangent the per-op pass's, and its peak at or below the per-op pass's."""
    from mixedad.benchmark import build, objective
    from mixedad.profiling import peak_memory

    for mode in ("eval", "train"):
        G, z, y, v = build("dcgan", 2, 8, 4, torch.float32, "cpu")
        G.train(mode == "train").requires_grad_(False)
        twin = copy.deepcopy(G).double()
        with mixedad.programs.per_op_pass():
            _, per_op = peak_memory(lambda: mixedad.mixed_grad(objective, G, z, y, v))
        for _ in range(2):
            mixedad.mixed_grad(objective, G, z, y, v)
        [entry] = cache._EAGER[G].values()
        assert entry.status == "program" and entry.difference <= 1e-6
        if mode == "eval":  # a train-mode forward moves the running statistics: not repeated here
            with torch.no_grad():
                (primal,), _ = entry.run(z, v)
                plain = G(z)
            assert torch.equal(primal, plain) and primal.stride() == plain.stride()
        reference = double_backward_mixed_grad(objective, copy.deepcopy(twin), z.double(), y.double(), v.double())
        ours, program = peak_memory(lambda: mixedad.mixed_grad(objective, G, z, y, v))
        assert ((ours.double() - reference).norm() / reference.norm()).item() < 1e-4, mode
        assert program <= per_op, (mode, program, per_op)


def test_a_layer_list_changed_with_modules_already_in_G_gives_another_program():
    """Found by a review: the key listed G's modules once each, so appending, repeating or reordering a module
    already in G kept the old program (2.4 off)."""
    a, b = nn.Linear(4, 4, dtype=D), nn.Tanh()
    G = nn.Sequential(a, b)
    z, y, v = (torch.randn(3, 4, dtype=D) for _ in range(3))
    changes = [lambda: G.append(G[0]), lambda: G.append(G[1]), lambda: G.__delitem__(1)]
    for change in [lambda: None, *changes]:
        change()
        for _ in range(4):
            ours = mixedad.mixed_grad(f, G, z, y, v)
            assert torch.allclose(ours, double_backward_mixed_grad(f, G, z, y, v), rtol=1e-12, atol=0)
