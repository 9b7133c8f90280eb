"""What the two seams reviews share: the ground truth (double backward by hand), running mixedad on
a case, comparing, and the torch attributes whose identity must not change (patches left behind).

A case ``c`` has ``call`` ("mixed_grad", "mixed_jacobian" or "input_grad"), ``chunk`` and
optionally ``strategy``; its problem ``p`` has ``f, G, z, y, v`` (and ``y_user``, ``W`` for
input_grad), and may override the run (``p.run()``), the truth (``p.truth()``, ``p.truth_G``) or
allow unused inputs in the truth (``p.zero_ok``).
"""
import contextlib
import re
import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

import mixedad

DT = torch.float64


@contextlib.contextmanager
def math_attention():
    """Attention as double backward needs it: the math SDPA backend, no MHA fast path."""
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


@contextlib.contextmanager
def grad_mode_restored():
    previous = torch.is_grad_enabled()
    try:
        yield
    finally:
        torch.set_grad_enabled(previous)


def leaf_copies(y):
    return tree_map(lambda t: t.detach().clone().requires_grad_(), y)


def outer_loss(dfdz, W):
    return (W * dfdz).sum() + 0.5 * (dfdz ** 2).sum()


def truth_mixed_grad(f, G, z, y, v, zero_ok=False):
    with math_attention(), grad_mode_restored(), torch.enable_grad():
        zr, yr = z.detach().clone().requires_grad_(), leaf_copies(y)
        leaves, spec = tree_flatten(yr)
        (gz,) = torch.autograd.grad(f(yr, G(zr)), zr, create_graph=True, allow_unused=zero_ok)
        if gz is None:
            return tree_unflatten([torch.zeros_like(leaf) for leaf in leaves], spec)
        grads = torch.autograd.grad(gz, leaves, v, allow_unused=zero_ok)
        return tree_unflatten([torch.zeros_like(leaf) if g is None else g.detach() for g, leaf in zip(grads, leaves)],
                              spec)


def truth_mixed_jacobian(f, G, z, y):
    with math_attention(), grad_mode_restored(), torch.enable_grad():
        zr, yr = z.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
        (gz,) = torch.autograd.grad(f(yr, G(zr)), zr, create_graph=True)
        rows = []
        for i in range(z.numel()):
            e = torch.zeros(z.numel(), dtype=z.dtype)
            e[i] = 1
            rows.append(torch.autograd.grad(gz, yr, e.reshape(z.shape), retain_graph=True)[0].detach())
        return torch.stack(rows).reshape(*z.shape, *y.shape)


def truth_input_grad(f, G, z, y, W, chunk, zero_ok=False):
    with math_attention(), grad_mode_restored(), torch.enable_grad():
        zr, yr = z.detach().clone().requires_grad_(), leaf_copies(y)
        total = sum(f(yr, G(zr[i:i + chunk])) for i in range(0, z.shape[0], chunk))
        (gz,) = torch.autograd.grad(total, zr, create_graph=True)
        leaves = tree_leaves(yr)
        grads = torch.autograd.grad(outer_loss(gz, W), leaves, allow_unused=zero_ok)
        return [gz.detach()] + [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves)]


def truth(c, p):
    """Double backward's answer for the case, written by hand."""
    if hasattr(p, "truth"):
        return p.truth()
    G = getattr(p, "truth_G", p.G)
    zero_ok = getattr(p, "zero_ok", False)
    if c.call == "mixed_grad":
        return truth_mixed_grad(p.f, G, p.z, p.y, p.v, zero_ok)
    if c.call == "mixed_jacobian":
        return truth_mixed_jacobian(p.f, G, p.z, p.y)
    if c.call == "input_grad":
        return truth_input_grad(p.f, G, p.z, p.y, p.W, c.chunk, zero_ok)
    raise AssertionError(c.call)


def run_mixedad(c, p):
    """mixedad's answer for the case."""
    if hasattr(p, "run"):
        return p.run()
    strategy = getattr(c, "strategy", "auto")
    if c.call == "mixed_grad":
        return mixedad.mixed_grad(p.f, p.G, p.z, p.y, p.v, strategy=strategy)
    if c.call == "mixed_jacobian":
        return mixedad.mixed_jacobian(p.f, p.G, p.z, p.y, chunk_size=c.chunk, strategy=strategy)
    if c.call == "input_grad":
        dfdz = mixedad.input_grad(p.f, p.G, p.z, p.y_user, chunk_size=c.chunk, strategy=strategy)
        leaves = tree_leaves(p.y_user)
        grads = torch.autograd.grad(outer_loss(dfdz, p.W), leaves, allow_unused=True)
        return [dfdz.detach()] + [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves)]
    raise AssertionError(c.call)


def as_list(x):
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def rel_error(actual, expected, atol=0.0):
    """max |a - e| / max |e| over all leaves (beyond atol); NaN where the NaN patterns differ."""
    a_list, e_list = as_list(actual), as_list(expected)
    if len(a_list) != len(e_list):
        return float("inf")
    worst, scale = 0.0, 0.0
    for a, e in zip(a_list, e_list):
        if a.shape != e.shape:
            return float("inf")
        a, e = a.detach().to(torch.complex128 if a.is_complex() else DT), e.detach().to(
            torch.complex128 if e.is_complex() else DT)
        if not torch.equal(torch.isnan(a), torch.isnan(e)):
            return float("nan")
        keep = ~torch.isnan(e)
        if keep.any():
            worst = max(worst, (a[keep] - e[keep]).abs().max().item())
            scale = max(scale, e[keep].abs().max().item())
    worst = max(worst - atol, 0.0)
    if scale == 0:
        return 0.0 if worst == 0 else float("inf")
    return worst / scale


def first_line(error, limit=220):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:limit]


#: Torch namespaces whose attributes must keep their identity across a call (no patch left behind).
NAMESPACES = {
    "torch": torch, "torch.Tensor": torch.Tensor, "torch._C.TensorBase": torch._C.TensorBase, "F": F,
    "torch.autograd": torch.autograd, "torch.autograd.grad_mode": torch.autograd.grad_mode,
    "no_grad": torch.no_grad, "enable_grad": torch.enable_grad, "set_grad_enabled": torch.set_grad_enabled,
    "inference_mode": torch.inference_mode, "torch.autograd.Function": torch.autograd.Function,
    "forward_ad": forward_ad, "torch.func": torch.func, "nn.Module": nn.Module,
    "nn.MultiheadAttention": nn.MultiheadAttention, "nn.LSTM": nn.LSTM, "nn.RNNBase": nn.RNNBase,
    "torch.utils.checkpoint": torch.utils.checkpoint, "torch._C": torch._C, "torch._VF": torch._VF,
    "torch.backends.mha": torch.backends.mha,
}


def attributes():
    """id() of every non-module attribute of :data:`NAMESPACES`, and of Function.apply's code."""
    found = {}
    for label, ns in NAMESPACES.items():
        for key, value in list(vars(ns).items()):
            if not isinstance(value, types.ModuleType):
                found[f"{label}.{key}"] = id(value)
    found["Function.apply.__code__"] = id(torch.autograd.Function.__dict__["apply"].__func__.__code__)
    return found


def check(c, evaluate):
    """Fail the test unless ``evaluate(c)`` gave a verdict ``c`` expects, with no leak."""
    import pytest

    verdict, detail, leaks, messages, text = evaluate(c)
    problems = []
    if verdict not in c.expect.split("|"):
        problems.append(f"expected {c.expect}, got {verdict}: {detail}")
    elif verdict == "refused" and c.match and not re.search(c.match, text, re.S):
        problems.append(f"refused, but the message does not match {c.match!r}: {detail}")
    if leaks:
        problems.append("leaked: " + "; ".join(leaks))
    if problems:
        pytest.fail(f"[{c.area}] {c.name}: " + " | ".join(problems) + (f" (warnings: {messages})" if messages else ""))


def cases_with_open_marked(cases, open_cases):
    """The cases as pytest params; those in ``open_cases`` (name: reason) as strict xfails."""
    import pytest

    return [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=open_cases[c.name]))
            if c.name in open_cases else c for c in cases]


def print_table(cases, evaluate):
    """``python -m tests.test_seams`` (or ``tests.test_seams_more``): a table of the verdicts now, one row a case."""
    counts = {}
    print("| area | case | verdict now | expected | detail |")
    print("|---|---|---|---|---|")
    for c in cases:
        verdict, detail, leaks, messages, text = evaluate(c)
        label = verdict
        if verdict == "refused" and c.match and not re.search(c.match, text, re.S):
            label = "refused (unmatched)"
        if leaks:
            label += " + leak"
            detail += " | LEAK: " + "; ".join(leaks)
        if messages:
            detail += " | warned: " + "; ".join(messages)
        ok = verdict in c.expect.split("|") and not leaks and label.split(" +")[0] != "refused (unmatched)"
        counts[label] = counts.get(label, 0) + 1
        expect = c.expect.replace("|", " or ")
        print(f"| {c.area} | {c.name} | {label} | {expect} | {'ok' if ok else 'FAIL'}: {detail.replace('|', '/')} |",
              flush=True)
    print()
    print(counts, len(cases))


def truth_or_error(c, p):
    """(double backward's answer, None), or (None, the error it raised: then only a refusal is right)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return truth(c, p), None
    except Exception as error:  # noqa: BLE001
        return None, error


def run_recording(c, p):
    """(result, error, caught warnings) of mixedad on the case."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return run_mixedad(c, p), None, caught
        except Exception as error:  # noqa: BLE001  (classified by verdict)
            return None, error, caught


def verdict(result, error, expected, truth_error, leaks, caught, *, own_error, rtol, atol=0.0):
    """(verdict, detail, leaks, warnings, error text or None) of one case.

    Verdicts: ``exact``, ``wrong``, ``NaN``, ``refused`` (an error of mixedad's own: the message
    matches ``own_error``), ``crash`` (any other error), ``answered`` (a number where double
    backward raises).
    """
    messages = [str(w.message).splitlines()[0][:120] for w in caught if "mixedad" in str(w.message)]
    if error is not None:
        text = str(error).strip()
        name = "refused" if own_error(error, text) else "crash"
        detail = first_line(error)
        if truth_error is not None:
            detail += f" (double backward raises too: {first_line(truth_error)})"
        return name, detail, leaks, messages, text
    if truth_error is not None:
        return "answered", f"double backward raises ({first_line(truth_error)})", leaks, messages, None
    err = rel_error(result, expected, atol)
    if err != err:
        ours_nan = any(torch.isnan(t).any().item() for t in as_list(result))
        where = "mixedad's result has NaN, double backward's is finite" if ours_nan else \
            "double backward has NaN where mixedad's result has none"
        return "NaN", where, leaks, messages, None
    if err < rtol:
        return "exact", f"rel err {err:.1e}", leaks, messages, None
    return "wrong", f"rel err {err:.2e} (rtol {rtol:.0e})", leaks, messages, None
