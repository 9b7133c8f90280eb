"""Users' tangent rules: ``mixedad.op_rules.register`` is used, reported and checked against the backward."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import mixedad
from mixedad.op_rules import OpRuleError, Path, register, unregister
from mixedad.reference import double_backward_mixed_grad
from mixedad.testing import assert_close

F64 = torch.float64


def f(y, g):
    return ((y + g) ** 3).sum()


def problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    W1, W2 = (torch.randn(5, 5, generator=gen, dtype=F64) / 2 for _ in range(2))
    z, y, v = (torch.randn(4, 5, generator=gen, dtype=F64) for _ in range(3))
    return W1, W2, z, y, v


class Softsign(torch.autograd.Function):
    """A Function the user cannot edit: no jvp, so mixedad would take the local rule."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x / (1 + x.abs())

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g / (1 + x.abs()) ** 2


class Softsign2(Softsign):
    """The same op under another class, so its rule is checked afresh."""


@pytest.fixture
def registered():
    """Register rules through this fixture: they are removed after the test, whatever happens."""
    ops = []

    def add(op, **options):
        ops.append(op)
        return register(op, **options)

    yield add
    for op in ops:
        unregister(op)


def test_a_rule_for_a_custom_function_is_used_reported_and_exact(registered):
    W1, W2, z, y, v = problem()
    calls = []

    @registered(Softsign)
    def softsign_tangent(op):
        calls.append(op.name)
        x, dx = op.primals["x"], op.tangents["x"]
        return op.primal(), dx / (1 + x.abs()) ** 2

    def G(z):
        return Softsign.apply(z @ W1) @ W2

    report = mixedad.tangent_report(G, z, v)
    assert report.ops(Path.USER) == ["Softsign (custom Function)"]
    assert "softsign_tangent" in str(report)
    assert_close(mixedad.mixed_grad(f, G, z, y, v, strategy="forward"), double_backward_mixed_grad(f, G, z, y, v))
    assert calls


def test_a_rule_for_a_torch_function_replaces_pytorchs_formula_until_unregistered(registered):
    W1, W2, z, y, v = problem(1)

    @registered(torch.erf, arguments=("input",))
    def erf_tangent(op):
        x = op.primals["input"]
        return op.primal(), op.tangents["input"] * 2 / torch.pi ** 0.5 * torch.exp(-x * x)

    def G(z):
        return torch.erf(z @ W1) @ W2

    assert mixedad.tangent_report(G, z, v).ops("user rule") == ["torch.erf"]
    assert_close(mixedad.mixed_grad(f, G, z, y, v), double_backward_mixed_grad(f, G, z, y, v))
    unregister(torch.erf)
    assert mixedad.tangent_report(G, z, v).ops("user rule") == []
    assert "torch.erf" in mixedad.tangent_report(G, z, v).ops("forward AD")


def test_a_rule_for_a_library_op_is_used_instead_of_the_local_rule(registered):
    W1, W2, z, y, v = problem(2)

    @torch.library.custom_op("mixedad_test::cube", mutates_args=())
    def cube(x: torch.Tensor) -> torch.Tensor:
        return x ** 3

    cube.register_autograd(lambda ctx, g: g * 3 * ctx.x ** 2,
                           setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]))

    def G(z):
        return torch.ops.mixedad_test.cube(torch.tanh(z @ W1)) @ W2

    assert "mixedad_test.cube" in mixedad.tangent_report(G, z, v).ops("local double-VJP")

    @registered(torch.ops.mixedad_test.cube)
    def cube_tangent(op):
        x = op.primals["x"]
        return op.primal(), 3 * x ** 2 * op.tangents["x"]

    report = mixedad.tangent_report(G, z, v)
    assert report.ops("user rule") and not report.ops("local double-VJP")
    assert_close(mixedad.mixed_grad(f, G, z, y, v, strategy="forward"), double_backward_mixed_grad(f, G, z, y, v))


def test_a_wrong_rule_warns_with_both_numbers_and_the_backward_gives_the_answer(registered):
    W1, W2, z, y, v = problem(3)

    @registered(Softsign2)
    def twice_too_big(op):
        x, dx = op.primals["x"], op.tangents["x"]
        return op.primal(), 2 * dx / (1 + x.abs()) ** 2

    def G(z):
        return Softsign2.apply(z @ W1) @ W2

    with pytest.warns(RuntimeWarning, match=r"twice_too_big registered for .* disagrees with the backward: .* = "):
        ours = mixedad.mixed_grad(f, G, z, y, v)
    assert_close(ours, double_backward_mixed_grad(f, G, z, y, v))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        report = mixedad.tangent_report(G, z, v)
    assert report.ops("local double-VJP") == ["Softsign2 (custom Function)"]


def test_a_rule_that_declines_leaves_the_op_its_usual_path(registered):
    W1, W2, z, y, v = problem(4)

    @registered(torch.sin, arguments=("input",))
    def only_for_float32(op):
        return NotImplemented if op.primals["input"].dtype == F64 else (op.primal(), None)

    def G(z):
        return torch.sin(z @ W1) @ W2

    assert "torch.sin" in mixedad.tangent_report(G, z, v).ops("forward AD")
    assert_close(mixedad.mixed_grad(f, G, z, y, v), double_backward_mixed_grad(f, G, z, y, v))


def test_a_rule_returning_the_wrong_shape_of_result_is_a_mixedad_error(registered):
    W1, W2, z, y, v = problem(5)

    @registered(torch.cos, arguments=("input",))
    def forgot_the_tangent(op):
        return op.primal()

    with pytest.raises(OpRuleError, match=r"forgot_the_tangent for torch.cos returned Tensor; a rule returns "
                                          r"\(output, output_tangent\)"):
        mixedad.mixed_grad(f, lambda z: torch.cos(z @ W1) @ W2, z, y, v)


def test_register_refuses_a_rule_that_is_not_callable():
    with pytest.raises(TypeError, match="expected a function rule"):
        register(torch.tan)(42)


def test_register_refuses_what_is_not_an_op():
    with pytest.raises(TypeError, match="Linear is a class but not a Function"):
        register(torch.nn.Linear)
    with pytest.raises(TypeError, match="expected a torch function, a torch.library op or a custom"):
        register("torch.erf")


def test_unregister_brings_mixedads_own_rule_back():
    import torch.nn.functional as F

    from mixedad.op_rules import TABLE

    own = TABLE[F.linear]

    @register(F.linear, arguments=("input", "weight", "bias"))
    def linear_tangent(op):
        return op.primal(), op.primal(input=op.tangents["input"], bias=None)

    try:
        assert TABLE[F.linear].path is Path.USER
        G = mixedad.zoo.mlp(2, 4, dtype=F64)
        z = torch.randn(3, 4, dtype=F64)
        assert "torch.nn.functional.linear" in mixedad.tangent_report(G, z).ops("user rule")
    finally:
        unregister(F.linear)
    assert TABLE[F.linear] is own
    unregister(F.linear)  # nothing of the user's left: mixedad's own rule stays
    assert TABLE[F.linear] is own


def _tanh_rule(scale, calls=None):
    def tanh_tangent(op):
        if calls is not None:
            calls.append(1)
        x, dx = op.primals["input"], op.tangents["input"]
        t = torch.tanh(x)
        return t, scale * (1 - t * t) * dx

    return tanh_tangent


def test_a_wrong_rule_for_a_torch_function_is_caught_outside_the_dispatch(registered):
    W1, W2, z, y, v = problem(6)
    wrong = _tanh_rule(0.5)
    wrong.__qualname__ = "half_tanh_tangent"
    registered(torch.tanh, arguments=("input",))(wrong)
    G = lambda z: torch.tanh(z @ W1) @ W2  # noqa: E731
    with pytest.warns(RuntimeWarning, match=r"half_tanh_tangent registered for torch.tanh disagrees with the "
                                            r"backward: .* = -?[0-9.e+-]+ but <t, backward\(u\)> = -?[0-9.e+-]+"):
        ours = mixedad.mixed_grad(f, G, z, y, v)
    assert_close(ours, double_backward_mixed_grad(f, G, z, y, v))
    report = mixedad.tangent_report(G, z, v)
    assert report.ops("local double-VJP") == ["torch.tanh"] and report.ops("user rule") == []


def test_a_rule_is_checked_again_for_each_pattern_of_arguments_with_tangents_and_each_op(registered):
    W1, W2, z, y, v = problem(7)
    c = torch.randn(5, dtype=F64)

    @registered(torch.mul, arguments=("input", "other"))
    def mul_wrong_in_other(op):
        a, b = op.primals["input"], op.primals["other"]
        da, db = op.tangents["input"], op.tangents["other"]
        tangent = (0 if da is None else da * b) + (0 if db is None else 5 * a * db)
        return op.primal(), tangent

    only_a = lambda z: torch.mul(z @ W1, c) @ W2  # noqa: E731  right for this pattern
    both = lambda z: torch.mul(z @ W1, torch.tanh(z @ W2)) @ W2  # noqa: E731  wrong for this one
    assert_close(mixedad.mixed_grad(f, only_a, z, y, v), double_backward_mixed_grad(f, only_a, z, y, v))
    with pytest.warns(RuntimeWarning, match="mul_wrong_in_other registered for torch.mul disagrees"):
        ours = mixedad.mixed_grad(f, both, z, y, v)
    assert_close(ours, double_backward_mixed_grad(f, both, z, y, v))

    def sin_tangent(op):  # right for sin, wrong for cos, which it is registered for too
        return op.primal(), torch.cos(op.primals["input"]) * op.tangents["input"]

    registered(torch.sin, arguments=("input",))(sin_tangent)
    registered(torch.cos, arguments=("input",))(sin_tangent)
    G = lambda z: (torch.sin(z @ W1) + torch.cos(z @ W2)) @ W2  # noqa: E731
    with pytest.warns(RuntimeWarning, match="sin_tangent registered for torch.cos disagrees"):
        ours = mixedad.mixed_grad(f, G, z, y, v)
    assert_close(ours, double_backward_mixed_grad(f, G, z, y, v))


def test_a_rule_runs_on_every_call_of_a_sequential_and_under_compile(registered):
    calls = []
    registered(torch.tanh, arguments=("input",))(_tanh_rule(1.0, calls))
    G = mixedad.zoo.mlp(2, 5, dtype=F64)  # an nn.Sequential: from its third call a program, but for the rule
    _, _, z, y, v = problem(8)
    expected = double_backward_mixed_grad(f, G, z, y, v)
    for _ in range(5):
        before = len(calls)
        assert_close(mixedad.mixed_grad(f, G, z, y, v), expected)
        assert len(calls) > before
    report = mixedad.tangent_report(G, z, v)
    assert report.route == "per-op pass" and report.ops("user rule") == ["torch.tanh"]
    with pytest.warns(RuntimeWarning, match=r"compile=True runs eager .*G runs the rule registered for torch.tanh"):
        for _ in range(2):
            before = len(calls)
            assert_close(mixedad.mixed_grad(f, G, z, y, v, compile=True), expected)
            assert len(calls) > before


def test_a_wrong_rule_for_f_linear_never_blames_mixedads_program(registered):
    G = mixedad.zoo.mlp(2, 5, dtype=F64)

    @registered(F.linear, arguments=("input", "weight", "bias"))
    def linear_half(op):
        return op.primal(), 0.5 * op.primal(input=op.tangents["input"], bias=None)

    _, _, z, y, v = problem(9)
    expected = double_backward_mixed_grad(f, G, z, y, v)
    with pytest.warns(RuntimeWarning) as caught:
        for _ in range(4):
            assert_close(mixedad.mixed_grad(f, G, z, y, v), expected)
    messages = [str(w.message) for w in caught]
    assert any("linear_half registered for torch.nn.functional.linear disagrees" in m for m in messages)
    assert not any("tangent program" in m or "program differs" in m for m in messages)


def test_a_rule_registered_after_a_program_was_written_is_used_from_the_next_call(registered):
    G = mixedad.zoo.mlp(2, 5, dtype=F64)
    _, _, z, y, v = problem(10)
    for _ in range(3):
        mixedad.mixed_grad(f, G, z, y, v)
    assert mixedad.tangent_report(G, z, v).route == "tangent program"
    calls = []
    registered(torch.tanh, arguments=("input",))(_tanh_rule(1.0, calls))
    assert_close(mixedad.mixed_grad(f, G, z, y, v), double_backward_mixed_grad(f, G, z, y, v))
    assert calls and mixedad.tangent_report(G, z, v).route == "per-op pass"


def test_an_operator_method_is_refused_with_the_form_that_reaches_the_dispatch():
    with pytest.raises(TypeError, match=r"register\(torch.Tensor.__mul__\): G's operator reaches mixedad as "
                                        r"torch.Tensor.mul, never as torch.Tensor.__mul__"):
        register(torch.Tensor.__mul__)


@pytest.mark.parametrize("returned, says", [
    (lambda op, out: out.sum(-1), r"returned a tangent of shape \(4,\) and dtype torch.float64 for an output of "
                                  r"shape \(4, 5\)"),
    (lambda op, out: out.float(), r"returned a tangent of shape \(4, 5\) and dtype torch.float32"),
    (lambda op, out: 1.0, r"returned a float for an output of shape \(4, 5\)"),
])
def test_a_rule_that_returns_what_is_not_its_outputs_tangent_is_a_mixedad_error(registered, returned, says):
    W1, W2, z, y, v = problem(11)

    @registered(torch.sinh, arguments=("input",))
    def sinh_tangent(op):
        out = op.primal()
        return out, returned(op, torch.cosh(op.primals["input"]) * op.tangents["input"])

    with pytest.raises(OpRuleError, match=r"mixed_grad\(f, G, z, y\): the tangent rule .*sinh_tangent registered for "
                                          r"torch.sinh " + says):
        mixedad.mixed_grad(f, lambda z: torch.sinh(z @ W1) @ W2, z, y, v)


@pytest.mark.parametrize("dual", ["output", "tangent"])
def test_a_rule_computed_from_the_dual_arguments_is_a_mixedad_error(registered, dual):
    """op.args hold G's dual tensors: an output or tangent computed from them carries a tangent of its own, which
    torch refused with "Making a dual Tensor based on a Tensor that already has a forward gradient"."""
    W1, W2, z, y, v = problem(13)

    @registered(torch.sinh, arguments=("input",))
    def sinh_from_args(op):
        x = op.args[0] if dual == "output" else op.primals["input"]
        tangent = torch.cosh(op.args[0] if dual == "tangent" else x) * op.tangents["input"]
        return torch.sinh(x), tangent

    with pytest.raises(OpRuleError, match=rf"sinh_from_args registered for torch.sinh returned an {dual} that "
                                          r"carries a tangent of its own: it was computed from op.args"):
        mixedad.mixed_grad(f, lambda z: torch.sinh(z @ W1) @ W2, z, y, v)


def test_a_rule_that_raises_is_a_mixedad_error_that_names_it(registered):
    W1, W2, z, y, v = problem(12)

    @registered(torch.sinh, arguments=("input",))
    def unfinished(op):
        raise ValueError("not written yet")

    with pytest.raises(OpRuleError, match=r"the tangent rule .*unfinished registered for torch.sinh raised "
                                          r"ValueError: not written yet"):
        mixedad.mixed_grad(f, lambda z: torch.sinh(z @ W1) @ W2, z, y, v)


def test_a_rule_for_a_random_op_is_checked_with_the_ops_own_draws(registered):
    W1, W2, z, y, v = problem(13)

    @registered(F.dropout, arguments=("input", "p", "training", "inplace"))
    def dropout_tangent(op):
        out = op.primal()
        return out, torch.where(out != 0, op.tangents["input"] / (1 - op.primals["p"]), 0.0)

    G = lambda z: F.dropout(torch.tanh(z @ W1), 0.3, training=True) @ W2  # noqa: E731
    torch.manual_seed(4)
    ours = mixedad.mixed_grad(f, G, z, y, v)  # no warning: the rule is right
    torch.manual_seed(4)
    assert_close(ours, double_backward_mixed_grad(f, G, z, y, v))
