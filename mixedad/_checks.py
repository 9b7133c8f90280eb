"""Argument validation shared by mixedad's public functions.

Every message opens with the call it belongs to (``mixed_grad(f, G, z, y): ...``), says what
was expected and what came in, and the fix where there is one. Wrong kinds raise TypeError,
wrong shapes or values ValueError.
"""
import itertools
import operator

import torch
from torch import nn

from mixedad._hooks.dual_level import dual_level_open, tangent_of
from mixedad._hooks.functorch import in_functorch_transform
from mixedad._hooks.pytree import describe, keystr, tree_flatten, tree_flatten_with_path


def check_callable(call, name, obj):
    if not callable(obj):
        raise TypeError(
            f"{call}: expected {name} to be callable (a function or nn.Module), "
            f"got {describe(obj)}."
        )


def check_float_tensor(call, name, obj):
    if not isinstance(obj, torch.Tensor):
        raise TypeError(f"{call}: expected {name} to be a tensor, got {describe(obj)}.")
    if not obj.is_floating_point():
        if not obj.is_complex() and obj.dtype != torch.bool and name.startswith("z"):
            raise TypeError(
                f"{call}: expected {name} to be a real floating-point tensor, got dtype {obj.dtype}. "
                f"There is no derivative with respect to integer indices (an nn.Embedding's input, "
                f"say), so converting them would not help: differentiate with respect to the "
                f"floating-point vectors instead, e.g. G = lambda e: rest_of_G(e) with "
                f"z = embedding(indices).detach()."
            )
        raise TypeError(
            f"{call}: expected {name} to be a real floating-point tensor, got dtype "
            f"{obj.dtype}. Convert it, e.g. {name}.to(torch.float32)."
        )


def flatten_y(call, y):
    """Flatten y (a tensor or a pytree of tensors) and check every leaf is floating point."""
    leaves, spec = tree_flatten(y)
    if not leaves:
        raise ValueError(f"{call}: expected y to hold at least one tensor, got an empty {describe(y)}.")
    for path, leaf in tree_flatten_with_path(y)[0]:
        check_float_tensor(call, "y" + keystr(path), leaf)  # y['k'], y[0][1]: names that are Python
    return leaves, spec


def check_like(call, name, obj, like, like_name):
    """Check that obj is a tensor with like's shape, dtype and device."""
    if not isinstance(obj, torch.Tensor):
        raise TypeError(f"{call}: expected {name} to be a tensor, got {describe(obj)}.")
    if obj.shape != like.shape:
        raise ValueError(
            f"{call}: {name} must have {like_name}'s shape {tuple(like.shape)}, "
            f"got {tuple(obj.shape)}."
        )
    if obj.dtype != like.dtype:
        raise TypeError(
            f"{call}: {name} must have {like_name}'s dtype {like.dtype}, got {obj.dtype}."
        )
    if obj.device != like.device:
        raise ValueError(
            f"{call}: {name} must be on {like_name}'s device {like.device}, got {obj.device}."
        )


def check_scalar_output(call, out):
    """Check that f returned a floating-point tensor with one element."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"{call}: expected f(y, g) to return a scalar tensor, got {describe(out)}."
        )
    if out.numel() != 1:
        raise ValueError(
            f"{call}: expected f(y, g) to return a scalar tensor, got shape "
            f"{tuple(out.shape)}. Reduce it, e.g. with .sum()."
        )
    if not out.is_floating_point():
        raise TypeError(
            f"{call}: expected f(y, g) to return a floating-point scalar, got dtype {out.dtype}."
        )


def flatten_z(call, z):
    """z as a tuple of floating-point tensors: a tensor gives (z,); a tuple or list is G(*z)."""
    if isinstance(z, (tuple, list)):
        if not z:
            raise ValueError(f"{call}: expected z to hold at least one tensor, got an empty {type(z).__name__}.")
        for i, zi in enumerate(z):
            check_float_tensor(call, f"z[{i}]", zi)
        devices = {zi.device for zi in z}
        if len(devices) > 1:
            raise ValueError(f"{call}: expected every z[i] on one device, got {sorted(map(str, devices))}.")
        return tuple(z)
    check_float_tensor(call, "z", z)
    return (z,)


def mixed_args(call, f, G, z, y, v):
    """Validate the ``f, G, z, y, v`` arguments shared by mixedad's mixed derivatives.

    z is a tensor, or a tuple/list of tensors that G takes positionally (``G(*z)``); v then has
    the same structure. Returns ``(zs, y_leaves, y_spec, vs)``: z and v as tuples of tensors,
    v defaulted to ones.
    """
    check_callable(call, "f", f)
    check_callable(call, "G", G)
    zs = flatten_z(call, z)
    y_leaves, y_spec = flatten_y(call, y)
    return zs, y_leaves, y_spec, flatten_v(call, z, zs, v)


def flatten_v(call, z, zs, v):
    """v as a tuple of tensors matching ``zs`` (z flattened by :func:`flatten_z`); None gives ones."""
    if v is None:
        return tuple(torch.ones_like(zi) for zi in zs)
    if len(zs) == 1 and not isinstance(z, (tuple, list)):
        check_like(call, "v", v, z, "z")
        return (v,)
    if not isinstance(v, (tuple, list)) or len(v) != len(zs):
        raise TypeError(f"{call}: expected v to be a tuple of {len(zs)} tensors like z, got {describe(v)}.")
    for i, (vi, zi) in enumerate(zip(v, zs)):
        check_like(call, f"v[{i}]", vi, zi, f"z[{i}]")
    return tuple(v)


#: The strategies a call takes: the forward pass with the whole-G fallback where it cannot go on, the forward pass
#: alone, or the whole-G fallback (:mod:`mixedad._frontend.tangents`).
STRATEGIES = ("auto", "forward", "reverse")


def check_strategy(call, strategy):
    if strategy not in STRATEGIES:
        raise ValueError(f"{call}: expected strategy in {STRATEGIES}, got {strategy!r}.")
    return strategy


def check_compile(call, compile, strategy):
    """``compile`` as a bool; it asks for the forward pass, so strategy="reverse" refuses it."""
    if not isinstance(compile, bool):
        raise TypeError(f"{call}: expected compile to be True or False, got {describe(compile)}.")
    if compile and strategy == "reverse":
        raise ValueError(f"{call}: compile=True compiles the forward tangent pass, which strategy='reverse' never "
                         f"runs; use strategy='auto' or 'forward' with it.")
    return compile


def check_chunk_size(call, chunk_size):
    """Check that chunk_size is None or a positive integer (``operator.index``), and return it as an int."""
    original = chunk_size
    if chunk_size is None:
        return None
    try:  # ints, numpy integers and integer 0-d tensors alike
        chunk_size = operator.index(chunk_size) if not isinstance(chunk_size, bool) else None
    except TypeError:
        chunk_size = None
    if chunk_size is None:
        raise TypeError(f"{call}: expected chunk_size to be None or a positive int, got {original!r}.")
    if chunk_size < 1:
        raise ValueError(f"{call}: expected chunk_size to be None or a positive int, got {original!r}.")
    return chunk_size


def chunk_slices(call, z, chunk_size):
    """Slices of z's leading dimension, ``chunk_size`` codes each; one slice of all if None."""
    chunk_size = check_chunk_size(call, chunk_size)
    if chunk_size is None:
        return [slice(None)]
    zs = z if isinstance(z, tuple) else (z,)
    if any(zi.dim() == 0 for zi in zs):
        raise ValueError(
            f"{call}: chunk_size needs z's leading dimension to index latent codes, got a 0-d z."
        )
    sizes = {zi.shape[0] for zi in zs}
    if len(sizes) > 1:
        raise ValueError(
            f"{call}: chunk_size needs every z[i] to index the same latent codes along dim 0, "
            f"got leading sizes {sorted(sizes)}."
        )
    n = zs[0].shape[0]
    # No latent codes: one empty chunk, so the result is an empty gradient, not an error.
    return [slice(start, min(start + chunk_size, n)) for start in range(0, n, chunk_size)] or [slice(0, 0)]


def check_z_constant(call, zs):
    """Refuse a z that requires grad where the result cannot be differentiated in z."""
    if any(zi.requires_grad for zi in zs):
        raise ValueError(
            f"{call}: z requires grad, but the result cannot be differentiated with respect to z: "
            f"that is a second derivative through G (its curvature), which this method avoids. "
            f"Pass z.detach() if you need derivatives in y only, or use "
            f"mixedad.reference.double_backward_input_grad for derivatives in z."
        )


def check_no_forward_tangents(call, tensors):
    """Refuse inputs carrying the caller's own forward-mode tangents, which mixedad would drop.

    Only possible inside the caller's ``forward_ad.dual_level()``; PyTorch cannot nest forward
    mode, so mixedad cannot carry such tangents through its own pass.
    """
    # torch.func.jvp opens a dual level too, and mixedad composes with it (its own pass then
    # runs as a nested torch.func.jvp): only a plain dual_level() outside transforms is refused.
    if not dual_level_open() or in_functorch_transform():
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and tangent_of(t) is not None:
            raise ValueError(
                f"{call}: an input is a forward-mode dual tensor of the caller's dual_level(). mixedad "
                f"cannot propagate forward-mode tangents through its result (PyTorch cannot nest forward "
                f"mode), so they would be lost silently. Pass forward_ad.unpack_dual(x).primal, or use "
                f"mixedad.reference for derivatives of higher order."
            )


def check_no_foreign_leaves(call, outs, allowed, *, who="f"):
    """Raise if the graph of ``outs`` (a tensor or a list of them) reaches a leaf that requires grad other than
    those in ``allowed``.

    Such a leaf is a tensor f (or G, ``who``) closes over; input_grad's backward produces gradients
    for y's leaves only, so its gradient would be silently lost where double backward gives one.
    G's parameters (each an ``nn.Parameter``, of the modules a function G calls too) are frozen by design.
    """
    allowed_ids = {id(t) for t in allowed}
    outs = [outs] if isinstance(outs, torch.Tensor) else outs
    seen, stack = set(), [o.grad_fn for o in outs if isinstance(o, torch.Tensor)]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if leaf is not None and id(leaf) not in allowed_ids and not (who == "G" and isinstance(leaf, nn.Parameter)):
            fix = ("Pass it inside y (y may be a tuple, list or dict of tensors; for an nn.Module inside f, pass "
                   "dict(module.named_parameters()) and call it with torch.func.functional_call), or detach it if "
                   "it is a constant" if who == "f" else
                   "G is frozen: detach it (a constant, as G's parameters are), or compute what depends on it in f "
                   "from a leaf of y")
            raise ValueError(f"{call}: {who} reads {describe(leaf)} that requires grad but is not part of y; its "
                             f"gradient would be lost. {fix}.")
        stack.extend(next_node for next_node, _ in node.next_functions)


def leaf_names(prefix, spec):
    """Python names of a pytree's leaves: ``y``, ``y[1]``, ``y['k']`` (for messages)."""
    from mixedad._hooks.pytree import tree_unflatten

    indexed = tree_unflatten(list(range(spec.num_leaves)), spec)
    return [prefix + keystr(path) for path, _ in tree_flatten_with_path(indexed)[0]]


def check_devices(call, G, zs, y_leaves, y_spec):
    """z, y's leaves and G's parameters and buffers must share a device (0-d CPU tensors aside)."""
    from torch import nn

    device = zs[0].device
    for name, leaf in zip(leaf_names("y", y_spec), y_leaves):
        if leaf.device != device and not (leaf.dim() == 0 and leaf.device.type == "cpu"):
            raise ValueError(
                f"{call}: {name} is on {leaf.device} but z is on {device}; move them to one device."
            )
    if isinstance(G, nn.Module):
        # One tensor tells where the module lives; mixed placements are G's own business.
        first = next(itertools.chain(G.named_parameters(), G.named_buffers()), None)
        if first is not None and first[1].device != device:
            name, t = first
            raise ValueError(
                f"{call}: G's {name} is on {t.device} but z is on {device}; move G with "
                f"G.to({str(device)!r}) or z with z.to({str(t.device)!r})."
            )


def y_aliases(y_leaves):
    """One tensor per leaf of y to differentiate f with: each leaf is an argument of its own.

    Where y holds one tensor twice, each position gets the partial derivative through that
    position, whether the tensor requires grad or not (as ``torch.func.grad`` treats arguments).
    A leaf that requires grad is used through a view, so a result taken with ``create_graph``
    stays connected to its history.
    """
    return [leaf.view_as(leaf) if leaf.requires_grad else leaf.detach().requires_grad_() for leaf in y_leaves]


def check_v_constant(call, vs, create_graph):
    """Refuse a v that requires grad when the result is to carry a graph: its dependence on v would be lost."""
    if create_graph and not in_functorch_transform() and any(vi.requires_grad for vi in vs):
        raise ValueError(
            f"{call}: v requires grad and create_graph=True, but mixedad's result is not differentiable "
            f"with respect to v: that would need a reverse pass through G, which this method avoids. "
            f"Pass v.detach(), or use mixedad.reference.double_backward_mixed_grad for derivatives in v."
        )
