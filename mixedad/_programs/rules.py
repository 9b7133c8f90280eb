"""Which node of G's traced graph gets which tangent, when the program is written.

Each rule takes the :class:`Emit` of one node (the primal node already written) and writes the
node(s) that compute its tangent, calling :mod:`mixedad._programs.functions`. A node whose inputs
carry no tangent is copied as it is and has none. A node with a tangent input and no rule here
makes the whole program :class:`Unsupported` (G then runs on mixedad's
per-op pass): a program never guesses.
"""
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from mixedad._ground.fingerprints import own_attributes
from mixedad._hooks.meta_trace import NDIM
from mixedad._programs import functions as T

__all__ = ["MODULES", "FUNCTIONS", "METHODS", "NOT_TENSORS", "Emit", "Missing", "Unsupported", "carries", "draws",
           "module_rule", "no_rule", "writes_in_place"]


class Unsupported(Exception):
    """G, or an op of G, has no tangent program; the message says which and why."""


class Emit:
    """One node being written: its primal arguments, their tangents, and the graph to write into.

    ``args``/``kwargs``: the node's arguments with nodes replaced by their primal nodes;
    ``targs``/``tkwargs``: the same with nodes replaced by their tangent nodes (None: constant).
    ``y``: the node's primal node in the program; ``module``: the called module, if any.
    """

    def __init__(self, builder, node, y, args, kwargs, targs, tkwargs, module=None):
        self.builder, self.node, self.y, self.module = builder, node, y, module
        self.args, self.kwargs, self.targs, self.tkwargs = args, kwargs, targs, tkwargs

    def call(self, fn, *args, **kwargs):
        return self.builder.graph.call_function(fn, args, kwargs)

    def replace_primal(self, node):
        """Compute the node's primal by ``node`` instead of G's own call (a call that hands out more)."""
        self.builder.graph.erase_node(self.y)
        self.y = self.builder.primal[self.node] = node

    def module_node(self):
        return self.builder.graph.get_attr(self.node.target)

    def input(self):
        """The primal of the op's input: its first argument, or the keyword ``input``."""
        return self.args[0] if self.args else self.kwargs["input"]

    def arg(self, i, name, default=None):
        """The primal argument at position i or keyword name."""
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default)

    def targ(self, i, name):
        """The tangent of the argument at position i or keyword name (None: constant)."""
        if i < len(self.targs):
            return self.targs[i]
        return self.tkwargs.get(name)

    def only_first(self):
        """The tangent of the first argument, refusing ops where another argument carries one."""
        rest = [t for name, t in [*enumerate(self.targs[1:]), *self.tkwargs.items()]
                if carries(t) and not (name == "input" and not self.targs)]
        if rest:
            raise Unsupported(f"{describe(self.node)} with a tangent in an argument other than its input")
        return self.targs[0] if self.targs else self.tkwargs.get("input")

    def same_op_on_tangent(self, **replace):
        """The node's own op applied to the tangent of its input (ops linear in their input)."""
        t = self.only_first()
        node = self.node
        args = (t, *self.args[1:]) if self.targs else self.args
        kwargs = dict(self.kwargs, **replace)
        if not self.targs:
            kwargs["input"] = t
        if node.op == "call_method":  # a tangent may be a broadcast view, which view() refuses: reshape is view's
            name = _TANGENT_METHOD.get(node.target, node.target)  # value wherever view works
            return self.builder.graph.call_method(name, args, kwargs)
        if node.op == "call_module":
            return self.builder.graph.call_module(node.target, args, kwargs)
        return self.builder.graph.call_function(node.target, args, kwargs)


class Missing:
    """The tangent of a node no rule covers: an error only if something downstream needs it."""

    def __init__(self, reason):
        self.reason = reason


_TANGENT_METHOD = {"view": "reshape", "view_as": "reshape_as"}


def carries(t):
    """Whether a (possibly nested) tangent argument holds a tangent: a node, or a :class:`Missing` one."""
    if isinstance(t, (list, tuple)):
        return any(carries(x) for x in t)
    if isinstance(t, dict):
        return any(carries(x) for x in t.values())
    if isinstance(t, slice):
        return any(carries(x) for x in (t.start, t.stop, t.step))
    return isinstance(t, (fx.Node, Missing))


def describe(node):
    if node.op == "call_module":
        return f"module {node.target}"
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    return getattr(node.target, "__qualname__", None) or str(node.target)


# --- modules ------------------------------------------------------------------------------------

def _linear_module(e):
    return e.call(T.linear, e.only_first(), e.builder.graph.get_attr(f"{e.node.target}.weight"))


def _conv_module(e):
    if len(e.args) > 1 or e.kwargs:  # ConvTranspose's output_size
        raise Unsupported(f"{describe(e.node)} called with output_size")
    return e.call(T.conv, e.module_node(), e.only_first())


def _batch_norm_module(e):
    m = e.module
    t = e.only_first()
    if m.training or m.running_mean is None or m.running_var is None:
        if type(m) in _BATCH_NORMS and "forward" not in vars(m) and len(e.args) == 1 and not e.kwargs:
            pair = e.call(T.batch_norm_module_train, e.module_node(), e.input(), t)
            e.replace_primal(e.call(operator.getitem, pair, 0))
            return e.call(operator.getitem, pair, 1)
        return e.call(T.batch_norm_train, e.module_node(), e.input(), t)
    folded = _fold_into_conv(e, t)
    if folded is not None:
        return folded
    return e.call(T.batch_norm_eval, e.module_node(), t)


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_FOLDABLE = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _fold_into_conv(e, t):
    """An eval batch norm whose input's tangent is a convolution module's (that module's output: a
    batched input, one group): the convolution with the scale folded in, beside the unscaled one, which
    the program drops if nothing else reads it; or None."""
    if not (isinstance(t, fx.Node) and t.op == "call_function" and t.target is T.conv and len(t.args) == 2):
        return None
    conv_node = e.node.args[0] if e.node.args else None
    conv = e.builder.traced.get_submodule(conv_node.target) if isinstance(conv_node, fx.Node) and \
        conv_node.op == "call_module" else None
    m = e.module
    if type(conv) not in _FOLDABLE or conv.groups != 1 or type(m) not in _BATCH_NORMS:
        return None
    if conv_node.meta.get(NDIM) != conv.weight.dim():  # unbatched: channels first, not where the norm reads them
        return None
    e.builder.drop_if_unused(t)
    return e.call(T.conv_batch_norm_eval, t.args[0], e.module_node(), t.args[1])


def _instance_norm_module(e):
    m = e.module
    if m.track_running_stats and not m.training:
        raise Unsupported(f"{describe(e.node)}: instance norm with running statistics in eval mode")
    return e.call(T.instance_norm, e.module_node(), e.input(), e.only_first())


#: Pointwise tangents that read the op's input x, not only its output y: an op that overwrote x
#: in place (``inplace=True``) leaves them without it.
_READS_INPUT = {T.gelu, T.silu, T.elu, T.softplus, T.absolute, T.power}


def _fresh(node):
    """Whether a node's value is a tensor of its own (not a view or the very input of another value), so
    that writing into it changes nothing else: the output of a layer or an arithmetic op that allocates."""
    if node.op == "call_module":
        return node.meta.get("mixedad_fresh", False)
    if node.op == "call_function":
        return node.target in _ALLOCATING
    return node.op == "call_method" and node.target in _ALLOCATING_METHODS


_ALLOCATING = {operator.add, operator.sub, operator.mul, operator.truediv, operator.matmul, operator.neg, torch.add,
               torch.sub, torch.mul, torch.div, torch.matmul, torch.cat, torch.stack, F.linear, F.conv1d, F.conv2d,
               F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, F.interpolate, F.pad}
_ALLOCATING_METHODS = {"add", "sub", "mul", "div", "matmul", "neg"}
#: Layers whose output is a tensor of its own (``mixedad_fresh`` on their nodes, set when the program is written).
FRESH_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                 nn.ConvTranspose3d, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d,
                 nn.InstanceNorm2d, nn.InstanceNorm3d, nn.GroupNorm, nn.LayerNorm, nn.Upsample)


def _in_place_check(e, fn, values, inplace):
    """Refuse an in-place activation unless it writes into a tensor of its own that nothing else uses, and its
    tangent needs only the output."""
    if not inplace:
        return
    node_input = e.node.args[0] if e.node.args else e.node.kwargs.get("input")
    if not isinstance(node_input, fx.Node) or len(node_input.users) > 1 or not _fresh(node_input):
        raise Unsupported(f"{describe(e.node)} writes in place into a tensor that is used again or shares memory "
                          f"with one (a view, a layer's input)")
    if fn in _READS_INPUT or (fn is T.leaky_relu and values["negative_slope"] < 0):
        raise Unsupported(f"{describe(e.node)} in place: its tangent needs the input the activation overwrites")


def _pointwise_module(fn, params):
    def rule(e):
        values = {name: getattr(e.module, name) for name in params}
        inplace = getattr(e.module, "inplace", False)
        _in_place_check(e, fn, values, inplace)
        t, tangent_fn = e.only_first(), fn
        if not inplace and e.builder.eager and _read_once(e, fn, values):  # no tensors of their own
            primal_in_place, tangent_in_place = T.IN_PLACE[fn]
            if _fresh(e.node.args[0]):
                e.replace_primal(e.call(primal_in_place, e.input(), values))
            if _fresh_tangent(t):
                tangent_fn = tangent_in_place
        return e.call(tangent_fn, t, e.input(), e.y, values)
    return rule


def _read_once(e, fn, values):
    """Whether an activation module in a program run eagerly may overwrite its input or its incoming tangent: its
    tangent reads its output alone (:data:`T.IN_PLACE`), it runs its class's forward on one input, and nothing else
    reads that input (nor, then, its tangent)."""
    node_input = e.node.args[0] if len(e.node.args) == 1 and not e.node.kwargs else None
    return (fn in T.IN_PLACE and not (fn is T.leaky_relu and values["negative_slope"] < 0)
            and isinstance(node_input, fx.Node) and len(node_input.users) == 1 and "forward" not in vars(e.module))


def _fresh_tangent(t):
    """Whether a tangent node's value is a tensor of the program's own (:data:`T.FRESH`, or the tangent a pair
    call hands out), not the caller's v or a view of it."""
    if not isinstance(t, fx.Node) or t.op != "call_function":
        return False
    if t.target is operator.getitem:
        pair = t.args[0]
        return (t.args[1] == 1 and isinstance(pair, fx.Node) and pair.op == "call_function"
                and pair.target is T.batch_norm_module_train)
    return t.target in T.FRESH


def _linear_module_without_weights(e):
    if isinstance(e.module, (nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d)):
        return e.call(F.pad, e.only_first(), e.module.padding, "constant", 0.0)
    return e.same_op_on_tangent()


MODULES = {nn.Linear: _linear_module, nn.Identity: lambda e: e.only_first()}
for _type in (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d):
    MODULES[_type] = _conv_module
for _type in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
    MODULES[_type] = _batch_norm_module
for _type in (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d):
    MODULES[_type] = _instance_norm_module
MODULES[nn.GroupNorm] = lambda e: e.call(T.group_norm, e.module_node(), e.input(), e.only_first())
MODULES[nn.LayerNorm] = lambda e: e.call(T.layer_norm, e.module_node(), e.input(), e.only_first())
MODULES.update({
    nn.ReLU: _pointwise_module(T.relu, ()),
    nn.LeakyReLU: _pointwise_module(T.leaky_relu, ("negative_slope",)),
    nn.Tanh: _pointwise_module(T.tanh, ()),
    nn.Sigmoid: _pointwise_module(T.sigmoid, ()),
    nn.GELU: _pointwise_module(T.gelu, ("approximate",)),
    nn.SiLU: _pointwise_module(T.silu, ()),
    nn.ELU: _pointwise_module(T.elu, ("alpha",)),
    nn.Softplus: _pointwise_module(T.softplus, ("beta", "threshold")),
    nn.Hardtanh: _pointwise_module(T.hardtanh, ("min_val", "max_val")),
    nn.ReLU6: _pointwise_module(T.hardtanh, ("min_val", "max_val")),
})
for _type in (nn.Flatten, nn.Unflatten, nn.Upsample, nn.UpsamplingNearest2d, nn.UpsamplingBilinear2d,
              nn.PixelShuffle, nn.PixelUnshuffle, nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d, nn.ReflectionPad1d,
              nn.ReflectionPad2d, nn.ReflectionPad3d, nn.ReplicationPad1d, nn.ReplicationPad2d, nn.ReplicationPad3d,
              nn.CircularPad1d, nn.CircularPad2d, nn.CircularPad3d, nn.ConstantPad1d, nn.ConstantPad2d,
              nn.ConstantPad3d, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout):
    MODULES[_type] = _linear_module_without_weights


#: Each layer class of MODULES with its attributes as mixedad found them (the values held: an identity compared is
#: never reused).
_AS_FOUND = {cls: own_attributes(cls) for cls in MODULES}


def module_rule(module):
    """The program rule of ``module``'s layer class, or None: where its class is in MODULES and is as mixedad found it.

    A rule holds for a layer's own code. A class whose method or attribute was replaced since mixedad was imported
    (``nn.Hardtanh.forward = ...``) has none: its program is refused, and the call takes the per-op pass."""
    cls = type(module)
    rule = MODULES.get(cls)
    if rule is None:
        return None
    now, found = own_attributes(cls), _AS_FOUND[cls]
    if len(now) != len(found) or any(a is not b or m != n for (m, a), (n, b) in zip(now, found)):
        return None
    return rule


def no_rule(module):
    """Why ``module`` has no program rule (for :func:`module_rule` None), as a phrase: "a ReLU whose class ..." """
    name = type(module).__name__
    if type(module) in MODULES:
        return (f"a {name} whose class was changed after mixedad was imported (a method or attribute replaced), so "
                f"its program rule may not hold")
    return f"a {name}, which has no program rule"

# --- functions and methods ----------------------------------------------------------------------

def _pointwise_function(fn, defaults, inplace_at=None):
    """A functional activation ``f(input, *params)``; ``defaults`` name its parameters in order, and
    ``inplace_at`` is the position of its ``inplace`` argument (after them, if None)."""
    def rule(e):
        values = {}
        for i, (name, default) in enumerate(defaults, start=1):
            values[name] = e.arg(i, name, default)
        inplace = e.arg(len(defaults) + 1 if inplace_at is None else inplace_at, "inplace", False)
        _in_place_check(e, fn, values, inplace)
        return e.call(fn, e.only_first(), e.input(), e.y, values)
    return rule


def _binary(fn):
    def rule(e):
        ta, tb = e.targ(0, "input"), e.targ(1, "other")
        if "alpha" in e.kwargs or "rounding_mode" in e.kwargs or len(e.args) > 2:
            raise Unsupported(f"{describe(e.node)} with alpha or rounding_mode")
        if fn in (T.add, T.sub):
            return e.call(fn, e.y, ta, tb)
        return e.call(fn, e.y, e.arg(0, "input"), e.arg(1, "other"), ta, tb)
    return rule


def _power(e):
    exponent = e.arg(1, "exponent")
    if carries(e.targ(1, "exponent")) or not isinstance(exponent, (int, float)):
        raise Unsupported(f"{describe(e.node)} with an exponent that is not a constant number")
    return e.call(T.power, e.only_first(), e.arg(0, "input"), e.y, {"exponent": exponent})


def _joined(how):
    def rule(e):
        tensors, dim = e.arg(0, "tensors"), e.arg(1, "dim", 0)
        return e.call(T.joined, how, tensors, e.targ(0, "tensors"), dim)
    return rule


def _attribute(e):
    """``x.T`` and ``x.mT`` (transposes); other attributes with a tangent have no rule."""
    if e.args[1] not in ("T", "mT"):
        raise Unsupported(f"the attribute {e.args[1]!r} of a tensor that carries a tangent")
    return e.call(getattr, e.only_first(), e.args[1])


def _getitem(e):
    if e.builder.tuple_valued(e.node.args[0]):
        return e.call(operator.getitem, e.targs[0], e.args[1])
    return e.same_op_on_tangent()


def _tuple_valued(e):
    e.builder.mark_tuple(e.node)
    return e.same_op_on_tangent()


def _where(e):
    condition = e.arg(0, "condition")
    if carries(e.targ(0, "condition")):
        raise Unsupported("torch.where with a condition that carries a tangent")
    return e.call(T.where, e.y, condition, e.targ(1, "input"), e.targ(2, "other"), e.arg(1, "input"),
                  e.arg(2, "other"))


def _addmm(e):
    beta, alpha = e.kwargs.get("beta", 1), e.kwargs.get("alpha", 1)
    if len(e.args) > 3 or any(carries(e.tkwargs.get(k)) for k in ("beta", "alpha")):
        raise Unsupported(f"{describe(e.node)} called in a form its rule does not take")
    return e.call(T.addmm, e.y, e.arg(1, "mat1"), e.arg(2, "mat2"), e.targ(0, "input"), e.targ(1, "mat1"),
                  e.targ(2, "mat2"), beta, alpha)


def _attention(e):
    """``F.scaled_dot_product_attention``: the kernel's primal and mixedad's blockwise tangent, as the eager rule."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    values = [e.arg(i, name, default) for i, (name, default) in
              enumerate(zip(names, (None, None, None, None, 0.0, False, None, False)))]
    if carries(e.targ(3, "attn_mask")) or any(carries(e.targ(i, names[i])) for i in range(4, 8)):
        raise Unsupported("scaled_dot_product_attention with a mask or a setting that carries a tangent")
    if not isinstance(values[4], (int, float)) or values[4] > 0:
        raise Unsupported("scaled_dot_product_attention with dropout draws random numbers")
    q, k, v, mask, _, is_causal, scale, gqa = values
    pair = e.call(T.attention, q, k, v, e.targ(0, "query"), e.targ(1, "key"), e.targ(2, "value"), mask, is_causal,
                  scale, gqa)
    e.replace_primal(e.call(operator.getitem, pair, 0))
    return e.call(operator.getitem, pair, 1)


def _pad(e):
    mode = e.arg(2, "mode", "constant")
    return e.same_op_on_tangent(value=0.0) if mode == "constant" else e.same_op_on_tangent()


def _weighted(spatial):
    """F.linear / F.conv* as functions: bilinear in (input, weight), affine in bias."""
    def rule(e):
        x, w = e.arg(0, "input"), e.arg(1, "weight")
        tx, tw, tb = e.targ(0, "input"), e.targ(1, "weight"), e.targ(2, "bias")
        rest_args, rest_kwargs = list(e.args[3:]), {k: v for k, v in e.kwargs.items()
                                                     if k not in ("input", "weight", "bias")}
        if any(carries(t) for t in list(e.targs[3:]) + [e.tkwargs.get(k) for k in rest_kwargs]):
            raise Unsupported(f"{describe(e.node)} with a tangent in a hyperparameter")
        parts = []
        if tx is not None:
            parts.append(e.call(e.node.target, tx, w, None, *rest_args, **rest_kwargs))
        if tw is not None:
            parts.append(e.call(e.node.target, x, tw, None, *rest_args, **rest_kwargs))
        total = None if not parts else parts[0] if len(parts) == 1 else e.call(operator.add, *parts)
        return e.call(T.add, e.y, total, e.call(T.bias, tb, spatial))
    return rule


#: Ops that draw random numbers: a compiled program need not draw them as eager code does.
RANDOM = {torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like,
          torch.bernoulli, torch.multinomial, torch.normal, torch.randperm, torch.poisson, F.rrelu}
#: Dropout functions ``f(input, p=0.5, training=..., inplace=False)``: random only in training with p > 0.
DROPOUTS = {F.dropout: True, F.dropout1d: True, F.dropout2d: True, F.dropout3d: True, F.alpha_dropout: False,
            F.feature_alpha_dropout: False}  # function: its default for training
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
#: In-place operators (``x += y``, ``x[i] = y``): a program refuses them (a write into a tensor of G's).
IN_PLACE = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.ipow,
            operator.imod, operator.iand, operator.ior, operator.ixor, operator.imatmul, operator.setitem}


def draws(node, module):
    """Whether a node of G's graph draws random numbers (a compiled program would draw others)."""
    if module is not None:
        if isinstance(module, _DROPOUT_MODULES):
            return module.training and module.p > 0
        return isinstance(module, nn.RReLU) and module.training
    if node.op == "call_method":
        return node.target in ("normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_",
                               "cauchy_", "log_normal_", "bernoulli", "multinomial")
    if node.op != "call_function":
        return False
    if node.target in DROPOUTS:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", DROPOUTS[node.target])
        return training is not False and not (isinstance(p, (int, float)) and p == 0)
    return node.target in RANDOM


def writes_in_place(node):
    """Whether a node of G's graph writes into a tensor (an in-place method, ``x += y``, ``x[i] = y``);
    in-place activations (``inplace=True``) are their rules' to judge."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("__")
    if node.op == "call_function":
        if node.target in IN_PLACE:
            return True
        schema = getattr(node.target, "_schema", None)  # an op overload, torch.ops.aten.hardtanh_.default
        if schema is not None and schema.is_mutable:
            return True
        # By name, wherever the function lives (F.leaky_relu_ is torch._C._nn's, torch.ops.aten.hardtanh_ a packet):
        # a function of G's own so named is refused too, which costs speed only.
        name = getattr(node.target, "__name__", "").split(".")[0]
        return name.endswith("_") and not name.startswith("_")
    return False

_LINEAR_FUNCTIONS = (torch.flatten, torch.reshape, torch.permute, torch.transpose, torch.squeeze, torch.unsqueeze,
                     torch.roll, torch.flip, torch.narrow, torch.movedim, torch.swapaxes, torch.sum, torch.mean,
                     F.interpolate, F.pixel_shuffle, F.pixel_unshuffle, torch.clone, torch.unflatten)
FUNCTIONS = {fn: lambda e: e.same_op_on_tangent() for fn in _LINEAR_FUNCTIONS}
FUNCTIONS.update({
    operator.add: _binary(T.add), torch.add: _binary(T.add), operator.sub: _binary(T.sub),
    torch.sub: _binary(T.sub), operator.mul: _binary(T.mul), torch.mul: _binary(T.mul),
    operator.truediv: _binary(T.div), torch.div: _binary(T.div), operator.matmul: _binary(T.matmul),
    torch.matmul: _binary(T.matmul),
    operator.neg: lambda e: e.call(operator.neg, e.only_first()), torch.neg: lambda e: e.call(operator.neg, e.only_first()),
    operator.pos: lambda e: e.only_first(),
    operator.getitem: _getitem,
    torch.cat: _joined("cat"), torch.concat: _joined("cat"), torch.stack: _joined("stack"),
    torch.chunk: _tuple_valued, torch.split: _tuple_valued, torch.unbind: _tuple_valued,
    torch.where: _where, torch.detach: lambda e: None, getattr: _attribute,
    F.scaled_dot_product_attention: _attention, torch.addmm: _addmm,
    **{fn: lambda e: e.only_first() for fn in DROPOUTS},  # not training (draws() refused the others)
    torch.zeros_like: lambda e: None, torch.ones_like: lambda e: None, torch.full_like: lambda e: None,
    torch.empty_like: lambda e: None, F.pad: _pad, operator.pow: _power, torch.pow: _power,
    F.linear: _weighted(0), F.conv1d: _weighted(1), F.conv2d: _weighted(2), F.conv3d: _weighted(3),
    F.conv_transpose1d: _weighted(1), F.conv_transpose2d: _weighted(2), F.conv_transpose3d: _weighted(3),
    torch.relu: _pointwise_function(T.relu, ()), F.relu: _pointwise_function(T.relu, ()),
    torch.tanh: _pointwise_function(T.tanh, ()), F.tanh: _pointwise_function(T.tanh, ()),
    torch.sigmoid: _pointwise_function(T.sigmoid, ()), F.sigmoid: _pointwise_function(T.sigmoid, ()),
    F.leaky_relu: _pointwise_function(T.leaky_relu, (("negative_slope", 0.01),)),
    F.gelu: _pointwise_function(T.gelu, (("approximate", "none"),)),
    F.silu: _pointwise_function(T.silu, ()),
    F.elu: _pointwise_function(T.elu, (("alpha", 1.0),)),
    F.softplus: _pointwise_function(T.softplus, (("beta", 1.0), ("threshold", 20.0))),
    F.hardtanh: _pointwise_function(T.hardtanh, (("min_val", -1.0), ("max_val", 1.0))),
    torch.exp: _pointwise_function(T.exp, ()), torch.sqrt: _pointwise_function(T.sqrt, ()),
    torch.rsqrt: _pointwise_function(T.rsqrt, ()), torch.abs: _pointwise_function(T.absolute, ()),
})

_LINEAR_METHODS = ("view", "reshape", "flatten", "unflatten", "permute", "transpose", "squeeze", "unsqueeze",
                   "contiguous", "expand", "expand_as", "repeat", "clone", "narrow", "roll", "flip", "sum", "mean",
                   "movedim", "swapaxes", "float", "double", "half", "bfloat16", "to", "type_as", "view_as",
                   "reshape_as")
METHODS = {name: lambda e: e.same_op_on_tangent() for name in _LINEAR_METHODS}
METHODS.update({
    "add": _binary(T.add), "sub": _binary(T.sub), "mul": _binary(T.mul), "div": _binary(T.div),
    "matmul": _binary(T.matmul), "neg": lambda e: e.call(operator.neg, e.only_first()),
    "detach": lambda e: None, "new_zeros": lambda e: None, "new_ones": lambda e: None, "new_full": lambda e: None,
    "new_empty": lambda e: None, "new_tensor": lambda e: None, "chunk": _tuple_valued, "split": _tuple_valued, "unbind": _tuple_valued,
    "relu": _pointwise_function(T.relu, ()), "tanh": _pointwise_function(T.tanh, ()),
    "sigmoid": _pointwise_function(T.sigmoid, ()), "exp": _pointwise_function(T.exp, ()),
    "sqrt": _pointwise_function(T.sqrt, ()), "rsqrt": _pointwise_function(T.rsqrt, ()), "pow": _power,
    "abs": _pointwise_function(T.absolute, ()),
})
#: Methods and attributes whose value is not a tensor: no tangent.
NOT_TENSORS = {"size", "dim", "numel", "ndimension", "nelement", "stride", "is_contiguous", "shape", "dtype",
               "device", "ndim", "is_cuda", "layout", "requires_grad", "is_floating_point"}
