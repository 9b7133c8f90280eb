"""Writing G's tangent program: one ``torch.fx`` graph computing G(z) and its tangent together.

From G's traced graph (:mod:`mixedad._programs.trace`) the program copies every node as it is (the
primal: G's own calls, so G(z) is what a plain forward computes and buffers are updated as it
updates them) and, after each node whose inputs carry a tangent, writes that node's tangent by the
rules of :mod:`mixedad._programs.rules`. The program takes ``(*zs, *vs)`` and returns
``(primal leaves, tangent leaves)`` of G's output. ``torch.fx`` frees each value after its last
use, so the program holds what a forward pass holding primal and tangent holds.
"""
import torch.fx as fx
from torch.fx.node import map_aggregate, map_arg
from mixedad._hooks.pytree import tree_flatten

from mixedad._hooks.meta_trace import DTYPE
from mixedad._programs import functions as T
from mixedad._programs.rules import (FRESH_MODULES, FUNCTIONS, METHODS, NOT_TENSORS, Emit, Missing, carries, describe, draws,
                                     module_rule, no_rule, writes_in_place)
from mixedad._programs.rules import Unsupported
from mixedad._programs.trace import chain, trace

__all__ = ["Program", "write"]


class Program:
    """A written tangent program: ``module(*zs, *vs) -> (primals, tangents)`` and G's output spec."""

    def __init__(self, module, spec, n_inputs):
        self.module, self.spec, self.n_inputs = module, spec, n_inputs

    def __call__(self, *args):
        return self.module(*args)


def _has_tangent(node):
    """Whether the node's value can carry a tangent: a floating-point tensor, or not known (a tuple)."""
    if DTYPE not in node.meta:
        return True
    dtype = node.meta[DTYPE]
    return dtype is not None and dtype.is_floating_point


class _Builder:
    """Writes a program node by node. ``eager``: the program runs without a compiler (a chain's), so its rules may
    save passes and tensors a compiler would save by itself (activations in place). No rule changes G's primal:
    it is G's own calls, so a ReLU input within round-off of zero takes the side of its kink a plain forward (and
    double backward) takes, and running statistics stay a plain forward's, bit for bit."""

    def __init__(self, traced, eager=False):
        self.traced, self.eager = traced, eager
        self.graph = fx.Graph()
        self.primal, self.tangent = {}, {}
        self._tuples = set()
        self._droppable = []

    def drop_if_unused(self, node):
        """Erase ``node`` (and the nodes only it read) from the program if nothing reads it once written."""
        self._droppable.append(node)

    def drop_unused(self):
        for node in reversed(self._droppable):
            self._erase_unused(node)

    def _erase_unused(self, node):
        if node.users or node.op in ("placeholder", "output"):
            return
        inputs = [n for n in node.all_input_nodes]
        self.graph.erase_node(node)
        for n in inputs:
            if n.op == "get_attr":
                self._erase_unused(n)

    def mark_tuple(self, node):
        self._tuples.add(node)

    def tuple_valued(self, node):
        return node in self._tuples

    def _tangent_of(self, arg):
        return self.tangent.get(arg) if isinstance(arg, fx.Node) else None

    def copy(self, node):
        return self.graph.node_copy(node, lambda n: self.primal[n])

    def emit(self, node):
        targs = map_aggregate(node.args, self._tangent_of)
        tkwargs = map_aggregate(node.kwargs, self._tangent_of)
        carried = carries(targs) or carries(tkwargs)
        module = self.traced.get_submodule(node.target) if node.op == "call_module" else None
        if draws(node, module):
            raise Unsupported(f"{describe(node)} draws random numbers, which a compiled program would draw otherwise")
        if writes_in_place(node):
            raise Unsupported(f"{describe(node)} ({node.name}) writes in place into a tensor, which a program does "
                              f"not follow")
        y = self.copy(node)
        self.primal[node] = y
        if module is not None:
            node.meta["mixedad_fresh"] = isinstance(module, FRESH_MODULES) and not getattr(module, "inplace", False)
        if not carried or not _has_tangent(node):
            return  # a constant, or a value that is no floating-point tensor (indices, sizes, masks)
        missing = [t for t in tree_flatten((targs, tkwargs))[0] if isinstance(t, Missing)]
        if missing:
            raise Unsupported(missing[0].reason)
        if node.op == "call_function" and node.target is getattr and node.args[1] in NOT_TENSORS:
            return
        if node.op == "call_method" and node.target in NOT_TENSORS:
            return
        if node.op == "call_module":
            rule = module_rule(module)
        elif node.op == "call_method":
            rule = METHODS.get(node.target)
            if node.target.endswith("_"):
                rule = None
        elif node.op == "call_function":
            rule = FUNCTIONS.get(node.target)
        else:
            rule = None
        if rule is None:
            self.tangent[node] = Missing(
                f"module {node.target} is {no_rule(module)}" if node.op == "call_module" else
                f"{describe(node)} ({node.name}) has no tangent rule in mixedad's tangent programs")
            return
        args = map_arg(node.args, lambda n: self.primal[n])
        kwargs = map_arg(node.kwargs, lambda n: self.primal[n])
        try:
            tangent = rule(Emit(self, node, y, args, kwargs, targs, tkwargs, module))
        except Unsupported:
            raise
        except Exception as error:  # noqa: BLE001 - a call the rule did not foresee: no program, never a crash
            raise Unsupported(f"{describe(node)} ({node.name}) called in a form its rule does not take "
                              f"({type(error).__name__}: {error})") from error
        if tangent is not None:
            self.tangent[node] = tangent


def write(G, zs, *, trace_code=True):
    """G's tangent :class:`Program` for inputs shaped as the tensors ``zs``, or raise :class:`Unsupported`.

    With ``trace_code`` G's forward is traced (:func:`~mixedad._programs.trace.trace`: the user's modules
    are traced through); without, G must be an ``nn.Sequential`` chain of ``torch.nn`` layers
    (:func:`~mixedad._programs.trace.chain`), whose graph is written without running any code of G's.
    """
    n_inputs = len(zs)
    traced = trace(G, zs) if trace_code else chain(G, zs)
    builder = _Builder(traced, eager=not trace_code)
    graph = builder.graph
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    if len(placeholders) < n_inputs or any(not n.args for n in placeholders[n_inputs:]):
        raise Unsupported(f"G's forward takes {len(placeholders)} inputs, {n_inputs} given")
    zs = [graph.placeholder(f"z{i}") for i in range(n_inputs)]
    vs = [graph.placeholder(f"v{i}") for i in range(n_inputs)]
    output = None
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            i = placeholders.index(node)
            if i < n_inputs:
                builder.primal[node], builder.tangent[node] = zs[i], vs[i]
            else:  # a keyword with a default: a constant
                builder.primal[node] = node.args[0]
        elif node.op == "output":
            output = node
        elif node.op == "get_attr":
            builder.primal[node] = builder.copy(node)
        else:
            builder.emit(node)
    leaves, spec = tree_flatten(output.args[0])
    primals, tangents = [], []
    for leaf in leaves:
        if isinstance(leaf, fx.Node):
            y = builder.primal[leaf]
            t = builder.tangent.get(leaf)
            if isinstance(t, Missing):
                raise Unsupported(t.reason)
            primals.append(y)
            tangents.append(t if t is not None else graph.call_function(T.constant, (y,)))
        else:
            primals.append(leaf)
            tangents.append(None)
    graph.output((tuple(primals), tuple(tangents)))
    builder.drop_unused()
    return Program(fx.GraphModule(traced, graph), spec, n_inputs)
