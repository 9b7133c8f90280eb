"""A ``torch.fx`` trace that carries meta tensors, for writing tangent programs.

What this relies on in torch (pinned by ``tests/_hooks/test_meta_trace.py``):

- ``torch.fx.experimental.meta_tracer.MetaTracer.trace(root, meta_args)`` traces with a meta
  tensor per placeholder name and installs, on each proxy it creates, the meta value of the op
  (``proxy._tensor_meta``; ``proxy.install_tensor_meta(value)``), so that traced code may read
  shapes; ``proxys_to_metas`` maps proxies in arguments to their meta values;
- while tracing, ``MetaTracer._disable_module_getattr`` set to True makes module attributes read
  as they are (not as proxies);
- ``MetaTracer.proxy(node)`` makes the tracer's proxies (``MetaProxy``, which answers ``dim()``,
  ``size()`` and ``shape`` from the meta value but not ``ndim`` or ``numel()``), and ``torch.fx.Proxy`` has no in-place
  operators: ``x += y`` in traced code falls back to ``x = x + y``, which leaves an alias of x
  unchanged where eager code changes it;
- a module's parameters and buffers live in its ``_parameters`` and ``_buffers`` dicts, so a
  shallow copy of a leaf module with those two dicts replaced runs on other tensors;
- ``torch.fx``'s tracer sets the tensors traced code makes (constants) as attributes of the root;
- a custom ``torch.autograd.Function`` runs its forward below the frame of ``Function.apply`` in
  ``torch/autograd/function.py``;
- tensor factories and random draws are torch functions, which a ``TorchFunctionMode`` sees even
  where a trace records nothing (arguments without proxies: the result becomes a constant);
- ``torch._C._is_torch_function_mode_enabled()`` and ``torch._C._len_torch_dispatch_stack()`` say
  whether a torch function mode or a dispatch mode is active.
"""
import copy
import sys
import warnings

import torch
import torch.fx as fx
from torch.fx.experimental.meta_tracer import MetaProxy, MetaTracer, proxys_to_metas
from torch.overrides import TorchFunctionMode

__all__ = ["MetaTrace", "forward_on_meta", "inside_function_apply", "modes_active", "DTYPE", "NDIM"]

#: ``node.meta[DTYPE]``: the dtype of the node's value where it is a tensor, None where it is a
#: size or a number; absent where the trace could not tell (tuples, modules run without meta).
DTYPE = "mixedad_dtype"
#: ``node.meta[NDIM]``: the number of dimensions of the node's value where it is a tensor.
NDIM = "mixedad_ndim"
_NOT_TENSORS = (bool, int, float, str, torch.Size, torch.dtype, torch.device, torch.memory_format)
_FUNCTION_APPLY = sys.modules["torch.autograd.function"].__file__


#: Names of the torch functions and Tensor methods that draw random numbers.
RANDOM = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli", "multinomial", "normal",
          "poisson", "randperm", "normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_",
          "cauchy_", "log_normal_", "dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d",
          "dropout3d", "rrelu", "rrelu_", "native_dropout"}


class _Draws(TorchFunctionMode):
    """Calls ``before(trace, "random", name)`` for every random draw of the traced code (not of meta runs)."""

    def __init__(self, trace):
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in RANDOM and not self.trace._meta_run and (kwargs or {}).get("training", True) is not False:
            self.trace._before(self.trace, "random", name)
        return func(*args, **(kwargs or {}))


def inside_function_apply(since=None):
    """Whether the caller runs inside a custom ``autograd.Function``'s ``apply`` (its forward).

    ``since``: a frame of the caller's stack; only frames called from it are looked at (a trace
    that itself runs inside a Function's backward is not refused for that).
    """
    frame = sys._getframe(1)
    while frame is not None and frame is not since:
        if frame.f_code.co_filename == _FUNCTION_APPLY and frame.f_code.co_name == "apply":
            return True
        frame = frame.f_back
    return False


def modes_active():
    """Whether a torch function mode or a dispatch mode is active on this thread."""
    return torch._C._is_torch_function_mode_enabled() or bool(torch._C._len_torch_dispatch_stack())


def forward_on_meta(module, args, kwargs=None):
    """``module``'s forward on meta ``args``, or None where it fails: run on a shallow copy with meta parameters and
    buffers, so that G's module, which other threads may run, is not touched."""
    clone = copy.copy(module)
    clone.__dict__["_parameters"] = {n: None if t is None else t.to("meta") for n, t in module._parameters.items()}
    clone.__dict__["_buffers"] = {n: None if t is None else t.to("meta") for n, t in module._buffers.items()}
    try:
        return type(module).forward(clone, *args, **(kwargs or {}))
    except Exception:  # noqa: BLE001 - no meta value: the node's dtype stays unknown
        return None


class _Proxy(MetaProxy):
    """The trace's proxies: an augmented assignment (``x += y``) calls ``before(trace, "in_place", name)``;
    ``ndim``, ``numel()`` and ``nelement()`` read the meta value, as ``dim()`` and ``shape`` do."""

    def _meta(self):
        meta = getattr(self, "_tensor_meta", None)
        return meta if isinstance(meta, torch.Tensor) else None

    @property
    def ndim(self):
        meta = self._meta()
        return meta.dim() if meta is not None else self.tracer.create_proxy("call_function", getattr,
                                                                             (self, "ndim"), {})

    def numel(self):
        meta = self._meta()
        return meta.numel() if meta is not None else self.tracer.create_proxy("call_method", "numel", (self,), {})

    nelement = numel


def _augmented(name):
    def refuse(self, other):
        self.tracer._before(self.tracer, "in_place", f"x {name}= ...")
        return NotImplemented
    return refuse


for _op, _symbol in (("iadd", "+"), ("isub", "-"), ("imul", "*"), ("itruediv", "/"), ("ifloordiv", "//"),
                     ("imod", "%"), ("ipow", "**"), ("imatmul", "@"), ("iand", "&"), ("ior", "|"), ("ixor", "^"),
                     ("ilshift", "<<"), ("irshift", ">>")):
    setattr(_Proxy, f"__{_op}__", _augmented(_symbol))


class MetaTrace(MetaTracer):
    """A meta-carrying trace. ``before(trace, kind, target)`` runs before each node is recorded, with
    kind "in_place" at each augmented assignment (``x += y``), and with kind "random" before each
    random draw of the traced code (a draw without proxies leaves no
    node: its value would become a constant of the graph); it may
    raise to refuse); leaf modules for which ``meta_modules(module)`` is true get a meta value by
    running their own ``forward`` on a shallow copy of the module with meta parameters and buffers
    (G's module is never touched)."""

    def __init__(self, before, meta_modules):
        super().__init__()
        self._before, self._meta_modules = before, meta_modules
        self.started = None
        self._meta_run = False

    def run(self, root, meta_args, concrete_args=None):
        """The traced ``fx.Graph`` of ``root`` at the meta tensors ``meta_args`` (by parameter name), with
        the values ``concrete_args`` (by name) fixed (``torch.fx``'s ``concrete_args``).

        :attr:`started` is the caller's frame meanwhile, for :func:`inside_function_apply`. Nodes
        without a meta value (an op with no meta kernel) are left without one, silently.
        """
        self.started = sys._getframe(1)
        try:
            with warnings.catch_warnings(), _Draws(self):  # MetaTracer warns for each node without a meta value
                warnings.simplefilter("ignore")
                return self.trace(root, meta_args, concrete_args)
        finally:
            # Nothing of G's stays reachable from this tracer (torch may keep a reference to it).
            self.started = self.root = self.meta_args = self._before = self._meta_modules = None

    def proxy(self, node):
        return _Proxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, *rest, **more):
        self._before(self, kind, target)
        if kind == "call_module":
            # Not MetaTracer's own meta run of a module: it would record the module's inner calls as nodes.
            proxy = fx.Tracer.create_proxy(self, kind, target, args, kwargs, *rest, **more)
            meta = self._module_on_meta(target, args, kwargs)
            if meta is not None:
                proxy.install_tensor_meta(meta)
        else:
            proxy = super().create_proxy(kind, target, args, kwargs, *rest, **more)
            meta = getattr(proxy, "_tensor_meta", None)
        if isinstance(meta, torch.Tensor):
            proxy.node.meta[DTYPE], proxy.node.meta[NDIM] = meta.dtype, meta.dim()
        elif isinstance(meta, _NOT_TENSORS):
            proxy.node.meta[DTYPE] = None
        return proxy

    def _module_on_meta(self, target, args, kwargs):
        module = self.root.get_submodule(target)
        if not self._meta_modules(module):
            return None
        self._disable_module_getattr = self._meta_run = True
        try:
            metas = fx.node.map_aggregate(args, proxys_to_metas), fx.node.map_aggregate(kwargs, proxys_to_metas)
        except Exception:  # noqa: BLE001 - an argument without a meta value: the node's dtype stays unknown
            metas = None
        try:
            return None if metas is None else forward_on_meta(module, *metas)
        finally:
            self._disable_module_getattr = self._meta_run = False
