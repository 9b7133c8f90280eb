"""Tracing G into a graph of known layers and ops, or saying why not.

A ``torch.fx`` trace records what G's Python code does with its input, module by module:
``torch.nn`` modules stay calls (leaves), the user's own modules are traced through. The trace
carries meta tensors of the inputs' shapes (``torch.fx.experimental.meta_tracer``), so code that
reads shapes (``x.reshape(*x.shape[:-1], 4, 4)``) traces, with those shapes fixed: a program
holds for one set of input shapes. Code that reads values (``if x.sum() > 0``) does not trace. What
a trace cannot see is refused here, rather than turned into a program that differs from what G
computes:

- random draws (dropout in training mode, noise): a compiled program draws other numbers, and a
  draw whose arguments are known at trace time would become a constant;
- grad mode, inference mode or autocast switched inside G (a ``torch.no_grad()`` block runs at
  trace time and leaves no node: its ops would get tangents that double backward never gives);
- custom ``torch.autograd.Function``\\ s (a trace sees their forward, never their backward, which
  is the meaning);
- hooks on any module, or in the process (a trace never runs them);
- a forward that sets its own attributes or writes into its parameters or buffers
  (``self.calls += 1``, a cache): the trace runs it once;
- in-place writes into tensors and random draws (:mod:`mixedad._programs.rules`);
- a G that is not an ``nn.Module``, data-dependent control flow, or any other failure of the trace.
"""
import inspect

import torch
import torch.fx as fx
from torch import nn

from mixedad._ground.state import plain_attributes
from mixedad._ground.forward_pass import FORWARD_PASS_LOCK
from mixedad._hooks.meta_trace import DTYPE, NDIM, MetaTrace, forward_on_meta, inside_function_apply
from mixedad._hooks.module_hooks import backward_hooks
from mixedad._hooks.sequential import forward_hooks
from mixedad._programs.rules import Unsupported, module_rule, no_rule

__all__ = ["Unsupported", "chain", "trace"]


def _before_each_node(tracer, kind, target):
    """Refuse what the graph would not show (the module docstring)."""
    if inside_function_apply(since=tracer.started):
        raise Unsupported("G calls a custom torch.autograd.Function, whose backward a trace cannot see")
    if kind == "in_place":
        raise Unsupported(f"G writes in place with an augmented assignment ({target}), which a trace records as a "
                          f"new tensor (an alias of the old one would keep its value)")
    if kind == "random":
        raise Unsupported(f"G draws random numbers ({target}), which a compiled program would draw otherwise")
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        raise Unsupported("G switches grad mode off inside its forward (torch.no_grad(), inference_mode)")
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        raise Unsupported("G runs part of its forward under autocast")


def _hooks(G):
    modules = list(G.modules())
    if forward_hooks(*modules) or backward_hooks(modules):
        return "G's modules (or the process) have forward or backward hooks, which a trace never runs"
    for name, m in G.named_modules():
        if "forward" in vars(m):
            return f"module {name or type(G).__name__} has its forward replaced on the instance"
    return None


def _attributes_written(snapshot):
    """The first plain attribute of G's modules that the trace set or replaced (``module.name``), or None."""
    for recorded in snapshot.attributes:
        module, before = recorded.module, recorded.values
        now = plain_attributes(module)
        for name in set(before) | set(now):
            old, new = before.get(name, _ABSENT), now.get(name, _ABSENT)
            if old is not new and not (type(old) is type(new) and not isinstance(old, torch.Tensor) and old == new):
                return f"{type(module).__name__}.{name}"
    return None


_ABSENT = object()


def _versions(G):
    """``{(module name, tensor name): (tensor, version)}`` of every parameter and buffer of G's modules."""
    return {(name, key): (t, t._version) for name, m in G.named_modules()
            for key, t in [*m._parameters.items(), *m._buffers.items()] if t is not None}


def _containers(G):
    """``[(name, container, copy)]`` of the lists, dicts and sets among G's modules' attributes."""
    return [(f"{type(m).__name__}.{name}", value, type(value)(value)) for m in G.modules()
            for name, value in vars(m).items() if type(value) in (list, dict, set)]


def _same(container, copy):
    if len(container) != len(copy):
        return False
    if isinstance(container, dict):
        return container.keys() == copy.keys() and all(container[k] is copy[k] for k in copy)
    if isinstance(container, set):
        return container == copy
    return all(a is b for a, b in zip(container, copy))


def _changed(containers):
    """The first list, dict or set attribute the trace changed in place (``self.feats.append(h)``), or None."""
    return next((name for name, container, copy in containers if not _same(container, copy)), None)


def _restore(containers):
    """Put back their contents: a trace's proxies appended to a user's list do not stay there."""
    for _, container, copy in containers:
        if not _same(container, copy):
            if isinstance(container, list):
                container[:] = copy
            else:
                container.clear()
                container.update(copy)


def _tensors_written(G, before):
    """The first parameter or buffer the trace replaced or wrote into (``self.calls += 1`` on a buffer, which
    the trace runs on the tensor itself), or None."""
    now = _versions(G)
    for (name, key), (t, version) in before.items():
        if (name, key) not in now or now[(name, key)][0] is not t or t._version != version:
            return f"{name or type(G).__name__}.{key}"
    for name, key in now.keys() - before.keys():
        return f"{name or type(G).__name__}.{key}"
    return None


def trace(G, zs):
    """G's ``torch.fx.GraphModule`` for inputs shaped as ``zs`` (sharing G's modules and parameters).

    G's buffers and attributes are left as they were (a module's forward runs on meta tensors
    while traced, and may count calls). Raises :class:`Unsupported`.
    """
    from mixedad._ground.state import Snapshot
    if not isinstance(G, nn.Module) or isinstance(G, (torch.jit.ScriptModule, fx.GraphModule)):
        raise Unsupported(f"G is a {type(G).__name__}; tangent programs take an nn.Module")
    hooked = _hooks(G)
    if hooked:
        raise Unsupported(hooked)
    parameters = [p for p in inspect.signature(G.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(parameters) < len(zs):
        raise Unsupported(f"G's forward takes {len(parameters)} named positional inputs, {len(zs)} given")
    rest = [p for p in inspect.signature(G.forward).parameters.values() if p.name not in
            {q.name for q in parameters[:len(zs)]} and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if any(p.default is p.empty for p in rest):
        raise Unsupported(f"G's forward needs more inputs than the {len(zs)} given")
    meta = {p.name: torch.empty_strided(z.shape, z.stride(), dtype=z.dtype, device="meta")
            for p, z in zip(parameters, zs)}
    concrete = {p.name: p.default for p in rest}  # the defaults G runs with: fixed, not traced as inputs
    # torch.fx patches torch while it traces (nn.Module.__call__ among others): mixedad's passes in other
    # threads wait for the trace, as they wait for each other's forward-AD level.
    with FORWARD_PASS_LOCK:
        own = {m: set(vars(m)) for m in G.modules()}
        snapshot = Snapshot(G)
        versions = _versions(G)
        containers = _containers(G)
        try:
            with torch.enable_grad(), torch.inference_mode(False):
                graph = MetaTrace(_before_each_node, lambda m: module_rule(m) is not None).run(G, meta, concrete)
            written = _attributes_written(snapshot) or _tensors_written(G, versions) or _changed(containers)
            if written:
                raise Unsupported(f"G's forward sets or changes the attribute {written} (a counter, a cache), which a program, "
                                  f"written once, would not set again")
            return fx.GraphModule(G, graph)
        except Unsupported:
            raise
        except Exception as error:  # a trace fails in many ways: data-dependent control flow, iteration, ...
            raise Unsupported(f"torch.fx cannot trace G ({type(error).__name__}: "
                              f"{str(error).splitlines()[0][:200]})") from error
        finally:
            snapshot.restore()  # and every random source: G's forward may draw host-side random numbers
            _restore(containers)
            # The trace keeps tensors G makes as attributes of G (the program holds its own copies of them), and a
            # forward that stores a value on a module (a cache) stores the trace's proxy: neither stays.
            for m, names in own.items():
                for name in set(vars(m)) - names:
                    delattr(m, name)


def chain(G, zs):
    """G's graph without a trace, where G is an ``nn.Sequential`` (nested ones flattened) of ``torch.nn`` layers that
    have program rules, each called on the output of the one before.

    What such a G computes is its layers' own code with their attributes, all of which the key sees: no
    code of the user's runs (no globals read, no side effects, no proxies left behind) and ``torch.fx``
    patches nothing (other threads run on). Each layer's output dtype and number of dimensions come
    from its forward on meta tensors. Raises :class:`Unsupported`.
    """
    if type(G) is not nn.Sequential:
        raise Unsupported(f"G is a {type(G).__name__}, not an nn.Sequential of torch.nn layers")
    if len(zs) != 1:
        raise Unsupported(f"an nn.Sequential takes one input, {len(zs)} given")
    hooked = _hooks(G)
    if hooked:
        raise Unsupported(hooked)
    layers = []

    def flatten(sequential, prefix):
        for name, child in sequential._modules.items():
            if child is None:
                continue
            if type(child) is nn.Sequential:
                flatten(child, f"{prefix}{name}.")
            elif module_rule(child) is not None:
                layers.append((f"{prefix}{name}", child))
            else:
                raise Unsupported(f"layer {prefix}{name} is {no_rule(child)}")

    flatten(G, "")
    if layers and getattr(layers[0][1], "inplace", False) is True:
        # it writes G's input, the caller's z (and a program's tangent rule, v): mixedad's per-op pass copies them
        raise Unsupported(f"layer {layers[0][0]} writes G's input in place (inplace=True)")
    graph = fx.Graph()
    x = graph.placeholder("z")
    z = zs[0]
    meta = torch.empty_strided(z.shape, z.stride(), dtype=z.dtype, device="meta")
    for name, layer in layers:
        x = graph.call_module(name, (x,))
        meta = None if meta is None else forward_on_meta(layer, (meta,))
        if isinstance(meta, torch.Tensor):
            x.meta[DTYPE], x.meta[NDIM] = meta.dtype, meta.dim()
        else:
            meta = None
    graph.output(x)
    return fx.GraphModule(G, graph)
