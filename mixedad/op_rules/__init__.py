r"""Per-op tangent rules: what happens to each op of G in mixedad's forward pass.

mixedad's per-op pass pushes :math:`\dot g = J_G(z)\, v` through G one op at a time. In that
pass, every op that receives a tangent takes one of the paths of :class:`Path`, decided by one
dispatch (:class:`OpRules`, in :mod:`mixedad.op_rules._dispatch`, for torch functions and custom
``autograd.Function``\ s alike). The default's tangent programs (:mod:`mixedad.programs`), for
``nn.Sequential`` chains of ``torch.nn`` layers from a key's third call, and ``compile=True`` run
G's tangent from a program instead, checked against this pass before it is used. The paths:

=======================  ====================================================================
path                     used for
=======================  ====================================================================
``frozen layer``         ``F.linear``, ``F.conv{1,2,3}d``, ``F.conv_transpose{1,2,3}d`` and
                         ``F.batch_norm`` whose weights carry no tangent: one plain
                         call for the primal, one for the tangent (batch statistics: a short
                         written formula)
``blockwise attention``  ``F.scaled_dot_product_attention``: the user's fused kernel for the
                         primal, the tangent a block of queries at a time, never the whole
                         :math:`T \times T` matrix
``written formula``      ``torch.cdist`` and ``F.group_norm``, whose PyTorch formulas are
                         missing or raise on channels-last input; fused multi-layer
                         ``nn.LSTM``/``GRU``/``RNN`` calls, split into one call per layer that
                         goes through this dispatch again; conversions to channels-last memory
                         formats
``user rule``            a rule registered with :func:`register` (a third-party CUDA op, a
                         compiled ``upfirdn2d``), checked against the op's backward
``local double-VJP``     ops in ``KNOWN_WRONG``, ``DROPS_TANGENT`` and ``NO_FORMULA``, library
                         ops (``torch.library``), custom Functions without ``jvp``, and any op
                         whose forward-AD formula raises:
                         :math:`J_{op} v = \partial_u \langle J_{op}^\top u, v\rangle` for
                         that op alone
``forward AD``           everything else: PyTorch's own formula; custom Functions with ``jvp``
``whole-G fallback``     the last resort: two reverse passes through all of G. Memory grows
                         with G's depth; it always warns
=======================  ====================================================================

All paths but the last keep memory flat in G's depth. An op whose formula raises is found at run
time: the pass stops, G's random state and buffers are restored, the op is remembered (an op
without a formula, which PyTorch signals with ``NotImplementedError``, per dtype and device of its
floating-point inputs; another failure per input signature: dtypes, shapes, strides) and the pass
starts again, with that op on the local rule from then on. Failures are told apart by the
exception's type, never by matching its text. A reentrant ``torch.utils.checkpoint`` block runs
directly: mixedad's pass builds no reverse graph through G, so there is nothing to recompute.

Only calls that pass through ``__torch_function__`` are seen. Ops inside a torch function that
has been let through run there as plain ops, except inside the Python composites of
``mixedad._hooks.composites.COMPOSITES`` (``F.multi_head_attention_forward``, which
``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` call), whose bodies run with the
dispatch active, so their projections take the frozen-layer rule and their attention the
attention rule. :func:`mixedad.tangent_report` shows, for a given G and z, which op took which
path.

Users give a tangent rule to an op mixedad does not know with :func:`register`.
"""
from mixedad.op_rules._attention import attention_blocks
from mixedad.op_rules._dispatch import PATHS, SKIPPABLE, OpRules, PathRecorder, op_name, skipped_paths, skipping
from mixedad._ground.errors import FunctionUnderTransformError, OpRuleError, UnderTransformError
from mixedad.op_rules._local import DROPS_TANGENT, KNOWN_WRONG, NO_FORMULA, forget_failures
from mixedad.op_rules._table import TABLE, OpCall, Path, Rule
from mixedad.op_rules._user import register, unregister

__all__ = [
    "Path", "PATHS", "SKIPPABLE", "Rule", "OpCall", "TABLE", "register", "unregister", "skipping", "skipped_paths",
    "op_name",
    "OpRules", "PathRecorder", "OpRuleError", "UnderTransformError", "FunctionUnderTransformError",
    "KNOWN_WRONG", "DROPS_TANGENT", "NO_FORMULA", "forget_failures", "attention_blocks",
]
