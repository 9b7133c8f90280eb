"""PyTorch's own OpInfo database: mixed_grad agrees with double backward on every op, or raises.

For every op in ``op_db`` that supports double backward in float64, over its sample inputs (all
of them, or the first N with ``MIXEDAD_OPINFO_SAMPLES=N``), G maps a flat z to the op applied to
the sample's differentiable tensors (all of them, then only the first, so the frozen-layer rules
on linear, convolution and batch norm are taken too), and f(y, g) = <y, g>, so that mixed_grad
is J_G v entry by entry.

One test per OpInfo entry, ``test_op_agrees_with_double_backward_or_raises[<name>]``, where
``<name>`` is the entry's full name (``op.name``, then ``.`` and ``op.variant_test_name`` when
there is one: ``linalg.cholesky``, ``nn.functional.conv2d``, ``mvlgamma.mvlgamma_p_1``). Each
runs every case of its op and fails listing that op's bad cases; an op whose sample generator
raises is skipped with the reason. The tests are marked ``slow``: ``make test-quick``
(``-m "not slow"``) leaves them out and keeps only the cheap check that the frozen-layer ops
pass; ``make test`` and CI run them all. To run one op::

    pytest tests/test_opinfo.py -k linalg.cholesky     # also linalg.cholesky_ex: -k matches substrings
    pytest tests/test_opinfo.py -k "linalg.cholesky]"  # that entry only (the id ends with "]")

Dots (and ``-``, ``[``, ``]``) are part of a ``-k`` name, so names need no quoting beyond the
shell's. Each case ends one way:

- ``pass``: mixed_grad equals double backward (relative error <= 1e-7, float64);
- ``refused``: mixedad raised an error of its own that names the call, and double backward
  fails on the case too (a refusal where double backward gives a number is a failure);
- ``finite differences``: double backward itself is off on this op (listed in
  :data:`DOUBLE_BACKWARD_OFF` with the reason) or fails, and mixed_grad agrees with finite
  differences;
- anything else is a failure, reported with the op, the sample and the error.

Cases whose G cannot run on a fresh z (a sample that depends on its input's storage) or has no
nonempty floating output are ``skipped`` and count as fine. Each case also records which path its
ops took (local rule, whole-G fallback); with ``-s`` the module prints a summary of the ops that
ran (outcome counts, and which ops took the local rule, the whole-G fallback, a refusal or
finite differences) when it ends.
"""
import math
import os
import warnings

import pytest
import torch

import mixedad
from mixedad._hooks.pytree import tree_flatten, tree_leaves, tree_unflatten
from mixedad.reference import double_backward_mixed_grad, finite_difference_mixed_grad

common = pytest.importorskip("torch.testing._internal.common_methods_invocations")

F64 = torch.float64
#: Sample inputs per op: all of them by default (the whole module takes about 1.5 minutes on 2
#: cores with torch 2.13); MIXEDAD_OPINFO_SAMPLES=N takes the first N of each op, for a quick run.
SAMPLES_PER_OP = int(os.environ.get("MIXEDAD_OPINFO_SAMPLES", "0")) or None
RTOL = 1e-7

#: Ops where double backward, not mixedad, is off, as PyTorch's own gradgrad tests skip them.
DOUBLE_BACKWARD_OFF = {
    # Duplicate indices: several outputs read one input; the reverse formula scatters with
    # overwrite instead of accumulation.
    "nn.functional.max_unpool1d": "duplicate indices",
    "nn.functional.max_unpool2d": "duplicate indices",
    "nn.functional.max_unpool3d": "duplicate indices",
    "nn.functional.max_unpool1d.grad": "duplicate indices",
    "nn.functional.max_unpool2d.grad": "duplicate indices",
    "nn.functional.max_unpool3d.grad": "duplicate indices",
    # Overlapping strided views: the scatter's backward does not sum overlapping elements.
    "as_strided_scatter": "overlapping strides",
    # padding_idx: the padding row gets no gradient in reverse mode, by definition of the op.
    "nn.functional.embedding": "padding row",
    # A zero vector: the reverse formula's second derivative blows up (entries near 1e290),
    # while forward mode and finite differences agree on the clamped norm.
    "nn.functional.cosine_similarity": "zero vector",
    # A zero input: the reverse formula's second derivative divides by the zero norm (inf), while
    # forward mode takes the subgradient 0, as finite differences do.
    "linalg.norm": "zero input",
}
#: Below this size an entry is round-off: some ops' Jacobians vanish exactly on their samples
#: (corrcoef of two observations, normalize over a dimension of size 1), and both sides then
#: hold noise near 1e-16 whose relative error means nothing.
FLOOR = 1e-6


def linear_f(y, g):
    return sum((yi * gi).sum() for yi, gi in zip(y, g))


def _case(op, sample, first_only):
    """(G, z) for one sample: G(z) is the op's floating outputs, z the flat differentiable inputs."""
    leaves, spec = tree_flatten((sample.input, list(sample.args), dict(sample.kwargs)))
    diff = [i for i, leaf in enumerate(leaves)
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.dtype == F64
            and leaf.layout == torch.strided]
    if first_only:
        diff = diff[:1]
    if not diff:
        return None
    consts = [leaf.detach() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    shapes = [leaves[i].shape for i in diff]
    z = torch.cat([leaves[i].detach().reshape(-1) for i in diff])
    if z.numel() == 0:
        return None

    def G(z):
        values, offset = list(consts), 0
        for i, shape in zip(diff, shapes):
            n = math.prod(shape)
            values[i] = z[offset:offset + n].reshape(shape)
            offset += n
        inp, args, kwargs = tree_unflatten(values, spec)
        out = sample.output_process_fn_grad(op.gradcheck_wrapper(op.get_op(), inp, *args, **kwargs))
        return [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.is_floating_point()]

    return G, z


def _error(actual, expected):
    """Largest relative error, with entries below FLOOR in size compared absolutely."""
    worst = 0.0
    for a, e in zip(actual, expected):
        if a.numel():
            if not torch.equal(a.isfinite(), e.isfinite()):
                return float("inf")
            finite = e.isfinite()
            diff = (a[finite] - e[finite]).abs().max().item() if finite.any() else 0.0
            worst = max(worst, diff / max(e[finite].abs().max().item() if finite.any() else 0.0, FLOOR))
    return worst


def _ours_error(error):
    return str(error).startswith(("mixed_grad(f, G, z, y):", "tangent_report(G, z):"))


def _run_case(op, G, z):
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    try:
        with torch.no_grad():
            outputs = G(z)
    except RuntimeError:  # the sample depends on its input's storage (as_strided with an offset)
        return "skipped", None
    if not outputs or all(o.numel() == 0 for o in outputs):
        return "skipped", None
    y = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outputs]
    v = torch.randn(z.shape, generator=gen, dtype=F64)
    paths = {}
    try:
        torch.manual_seed(0)
        report = mixedad.tangent_report(G, z, v)
        paths = {"local": report.calls("local double-VJP") > 0, "whole-G": not report.flat}
        torch.manual_seed(0)
        ours = mixedad.mixed_grad(linear_f, G, z, y, v)
    except Exception as error:  # noqa: BLE001  (classified below)
        if not _ours_error(error):
            return f"crash: {type(error).__name__}: {error}", paths
        try:  # a refusal is fair only where double backward cannot give a number either
            torch.manual_seed(0)
            double_backward_mixed_grad(linear_f, G, z, y, v)
        except Exception:  # noqa: BLE001
            return "refused", paths
        return f"refused where double backward works: {error}", paths
    try:
        torch.manual_seed(0)
        expected = double_backward_mixed_grad(linear_f, G, z, y, v)
    except Exception as error:  # noqa: BLE001  (mixedad gives a number double backward cannot)
        if _error(ours, finite_difference_mixed_grad(linear_f, G, z, y, v)) <= 1e-5:
            return "finite differences", paths
        return f"double backward failed and finite differences disagree: {str(error)[:120]}", paths
    err = _error(ours, expected)
    if err <= RTOL:
        return "pass", paths
    fd = finite_difference_mixed_grad(linear_f, G, z, y, v)
    fd_err = _error(ours, fd)
    if op.name in DOUBLE_BACKWARD_OFF and fd_err <= 1e-5:
        return "finite differences", paths
    return (f"mismatch: relative error {err:.2e} against double backward, {fd_err:.2e} against finite "
            f"differences (double backward against them: {_error(expected, fd):.2e})"), paths


def _ops():
    return [op for op in common.op_db
            if op.supports_autograd and op.supports_gradgrad and F64 in op.supported_dtypes("cpu")]


def _op_id(op):
    """The op's full OpInfo name: ``linalg.cholesky``, ``nn.functional.conv2d``, or ``name.variant``."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


OPS = _ops()


@pytest.fixture(autouse=True)
def fresh_state():
    """Each op starts with no remembered formula failures, as the first call in a process does.

    (tests/conftest.py clears mixedad's warn-once memory around every test as well.)
    """
    mixedad.op_rules.forget_failures()
    yield
    mixedad.op_rules.forget_failures()


FINE = ("pass", "refused", "finite differences", "skipped")


def outcomes_of(op):
    """[(sample index, first input only, outcome, paths)] for every sample of ``op``."""
    results = []
    with warnings.catch_warnings():
        # Deprecations and beta notices in samples (pytest makes warnings errors; the sparse CSR
        # beta warning would otherwise fail sparse.sampled_addmm's generator); the whole-G
        # fallback's warning.
        warnings.simplefilter("ignore")
        try:
            samples = list(op.sample_inputs("cpu", F64, requires_grad=True))[:SAMPLES_PER_OP]
        except Exception as error:  # noqa: BLE001  (a sample generator that needs something we lack)
            pytest.skip(f"{_op_id(op)}: its sample generator raises {type(error).__name__}: {error}")
        for k, sample in enumerate(samples):
            for first_only in (False, True):
                case = _case(op, sample, first_only)
                if case is None or (first_only and _case(op, sample, False)[1].numel() == case[1].numel()):
                    continue
                outcome, paths = _run_case(op, *case)
                results.append((k, first_only, outcome, paths or {}))
    return results


def _summary(swept):
    """The sweep in a few lines: counts by outcome, and the ops on each path (``{op id: outcomes}``)."""
    cases = [(name, *case) for name, results in swept.items() for case in results]
    counts = {}
    for *_, outcome, _ in cases:
        key = outcome.split(":")[0]
        counts[key] = counts.get(key, 0) + 1
    local = sum(1 for *_, o, p in cases if p.get("local") and o in ("pass", "finite differences"))
    whole = sum(1 for *_, o, p in cases if p.get("whole-G") and o in ("pass", "finite differences"))
    samples = len({(name, k) for name, k, *_ in cases})
    lines = [f"OpInfo: {len(swept)} ops, {samples} samples, {len(cases)} cases; {counts}; "
             f"local rule in {local} passing cases, whole-G fallback in {whole}"]
    for label, pick in [("local rule", lambda o, p: p.get("local")),
                        ("whole-G fallback", lambda o, p: p.get("whole-G")),
                        ("refused", lambda o, p: o == "refused"),
                        ("finite differences", lambda o, p: o == "finite differences")]:
        lines.append(f"  {label}: {sorted({name for name, _, _, o, p in cases if pick(o, p)})}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def swept():
    """{op id: outcomes} of the per-op tests that ran; its summary is printed when the module ends."""
    results = {}
    yield results
    if results:
        print("\n" + _summary(results))


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS, ids=_op_id)
def test_op_agrees_with_double_backward_or_raises(op, swept):
    results = swept[_op_id(op)] = outcomes_of(op)
    bad = [(k, first, outcome) for k, first, outcome, _ in results if outcome not in FINE]
    assert not bad, "\n".join(f"{_op_id(op)} sample {k} (first input only: {first}): {outcome}"
                              for k, first, outcome in bad[:40])


@pytest.mark.parametrize("name", ["nn.functional.linear", "nn.functional.conv2d", "nn.functional.batch_norm"])
def test_frozen_layer_rules_are_among_the_cases(name):
    """Cheap (not slow): the frozen-layer ops pass with their weights frozen (first input only)."""
    op = next(op for op in OPS if _op_id(op) == name)
    results = outcomes_of(op)
    assert any(first and outcome == "pass" for _, first, outcome, _ in results)
    assert all(outcome in FINE for _, _, outcome, _ in results)
