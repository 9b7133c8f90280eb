"""Tangent programs: G's tangent written out as one graph, run eagerly by the default and compiled by ``compile=True``.

Where G's forward can be traced in full (``torch.fx``, with the inputs' shapes) and every op
whose input carries a tangent has a rule here, mixedad writes one program that computes G(z) and
its tangent together, from G's own calls and the tangent rules of
:mod:`mixedad._programs.functions`. ``mixed_grad`` and ``input_grad``'s backward run it eagerly
where G is an ``nn.Sequential`` chain of ``torch.nn`` layers (written from the layers, without a
trace), from the third call with the same inputs' layouts, after checking it against mixedad's
per-op pass on the second; ``compile=True`` (on ``mixed_grad``, ``input_grad`` and ``mixed_jacobian``) compiles
it with ``torch.compile``, checks it on its first call, and runs it from then on
(:mod:`mixedad._programs.cache`).

What a program covers: ``nn.Linear``, convolutions and transposed convolutions (frozen),
batch norm (eval and training), instance, group and layer norm, pointwise activations (ReLU,
LeakyReLU, tanh, sigmoid, GELU, SiLU, ELU, softplus, hardtanh), dropout in eval mode, padding,
upsampling and shape ops, sums, products, quotients, matrix products (``addmm`` too),
``F.linear`` / ``F.conv*`` with weights that carry tangents (modulated convolutions), ``cat`` /
``stack`` / ``where``, ``detach``, and ``F.scaled_dot_product_attention`` (the eager rule's
blockwise tangent). What it refuses, so that G runs on the per-op pass instead (with ``compile=True``, with a warning):
an op with no rule on the tangent's way (cdist feeding the output, ``nn.MultiheadAttention`` and
other layers torch.fx keeps whole without a rule), custom ``autograd.Function``\\ s, grad mode or
autocast switched inside G, hooks, random draws, in-place writes, a forward that sets its own
attributes or writes into its buffers, and control flow on values.

Layout: :mod:`~mixedad._programs.trace` (the trace and what it refuses),
:mod:`~mixedad._programs.rules` (node -> tangent), :mod:`~mixedad._programs.functions` (the
functions a program calls), :mod:`~mixedad._programs.program` (writing it),
:mod:`~mixedad._programs.key` (what a program is written for),
:mod:`~mixedad._programs.cache` (running, compiling, checking, caching, falling back).
"""
