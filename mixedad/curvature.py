r"""Curvature in z through a frozen G: a matrix-free operator on z-space.

.. math::

    \mathrm{ggn}:\ J_G^\top\, \nabla^2_g f\, J_G + \lambda I \qquad
    \mathrm{hessian}:\ \nabla^2_z f(y, G(z)) + \lambda I
    = J_G^\top \nabla^2_g f\, J_G + \sum_k (\nabla_g f)_k\, \nabla^2_z G_k + \lambda I

For Laplace approximations in latent space, Newton and Gauss-Newton steps in inversion, latent
geometry, and the solve inside :func:`mixedad.implicit_grad`.
"""
import contextlib
import math
import numbers
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from mixedad import _checks
from mixedad._curvature.cg import CurvatureError, conjugate_gradient
from mixedad._curvature.segments import Chain, f_derivatives, push, split
from mixedad._entry import eager, frozen, public_call
from mixedad._backend import evaluate_f
from mixedad._ground import watch
from mixedad._ground.inputs import on_inputs, writable
from mixedad._ground.state import Snapshot
from mixedad._ground.versions import Versions, input_labels
from mixedad._hooks.attention_backends import differentiable_attention
from mixedad._hooks.pytree import differentiable, tree_flatten, tree_unflatten

__all__ = ["z_curvature", "ZCurvature", "CurvatureError", "KINDS"]

#: The curvatures :func:`z_curvature` offers.
KINDS = ("ggn", "hessian")
#: How many tangents (basis vectors, probes) one batched product pushes at most.
BATCH = 16


class SolveInfo(NamedTuple):
    """How the last :meth:`ZCurvature.solve` ended: CG iterations and the relative residual."""

    iterations: int
    residual: float


class ZCurvature:
    r"""A linear operator on z-space: ``op @ u`` is :math:`(H + \lambda I)\,u` (see :func:`z_curvature`).

    .. math::

        u \mapsto (H + \lambda I)\, u, \qquad H = J_G^\top \nabla^2_g f\, J_G \ \text{(ggn)} \ \text{or}\
        \nabla^2_z f(y, G(z)) \ \text{(hessian)}

    Vectors have z's structure (a tensor, or a tuple of tensors). ``dense()`` orders a tuple z
    by concatenating the flattened tensors in order.

    Attributes:
        kind: "ggn" or "hessian".
        damping: :math:`\lambda`.
        size: the dimension of z-space (``z.numel()``, summed over a tuple).
        segments: the number of segments G is swept in.
        last_solve: None, or how the last :meth:`solve` ended (:class:`SolveInfo`).

    Example:
        >>> import torch, mixedad
        >>> G = torch.nn.Linear(3, 4).double()
        >>> f = lambda y, g: ((g - y) ** 2).sum()
        >>> op = mixedad.z_curvature(f, G, torch.randn(3, dtype=torch.float64), torch.randn(4, dtype=torch.float64))
        >>> H = 2 * G.weight.T @ G.weight
        >>> torch.allclose(op.dense(), H)
        True
    """

    def __init__(self, call: str, f: Callable[..., torch.Tensor], G: Callable[..., Any], z: Any, y: Any, *,
                 kind: str, damping: float, segments: Any, keep_graph: bool) -> None:
        self._call = call
        self._zs, self._y_leaves, self._y_spec, _ = _checks.mixed_args(call, f, G, z, y, None)
        self._tuple = isinstance(z, (tuple, list))
        self._f, self._G = f, eager(G)
        self.kind, self.damping = kind, float(damping)
        self.last_solve: Optional[SolveInfo] = None
        self.size = sum(t.numel() for t in self._zs)
        self._versions: Optional[Versions] = None  # set once constructed; checked before every use
        self._replayed = False  # whether a product ran, watching every op for the random sources G draws from
        self._snapshot = Snapshot(self._G, call=call)
        try:
            with self._snapshot.watching(reads=True, mode=False):  # watched where G and f run
                sliced = isinstance(segments, (str, int)) and isinstance(self._G, torch.nn.Sequential)
                self._chain = Chain(call, split(call, self._G, segments), self._zs, whole=self._G if sliced else None,
                                    snapshot=self._snapshot)
                if not isinstance(segments, str) and not isinstance(segments, int):
                    self._check_composition()
                self._lam = None
                self._f_gradient()  # f evaluated once here: a non-scalar f fails at construction, not at the first product
                if kind == "ggn":
                    self._lam = None  # the GGN's products do not use f's gradient
                self._chain.output = None  # the products recompute G's output; the boundaries stay
                self._kept: Optional[Tuple[List[torch.Tensor], List[Any]]] = self._keep_graph() if keep_graph else None
        finally:
            self._snapshot.restore()
        self.segments = len(self._chain.segments)
        self._versions = Versions(call, self._G, [self._snapshot, *self._chain.snapshots],
                                  list(zip(input_labels("z", z) + input_labels("y", y), [*self._zs, *self._y_leaves])),
                                  after="z_curvature built this operator",
                                  fix="Build a new operator with z_curvature after the change.")

    def _check_composition(self):
        with torch.no_grad():
            self._snapshot.restore()
            with watch.ops():
                leaves = tree_flatten(self._G(*writable(self._zs)))[0]  # G may write its input: not the caller's z
        ours = self._chain.output
        assert ours is not None  # checked before the output is dropped
        if len(leaves) != len(ours) or any(
                isinstance(a, torch.Tensor) and not (a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=1e-12))
                for a, b in zip(leaves, ours)):
            raise ValueError(f"{self._call}: the segments given do not compose to G: applied in order to z, they give "
                             f"another output than G(z).")

    def _wrote_z(self, i):
        label = "z" if not self._tuple else f"z[{i}]"
        raise RuntimeError(f"{self._call}: G wrote its input {label} in place with grad enabled, which it did not do "
                           f"under torch.no_grad() when the operator's segments ran; it may have changed the caller's "
                           f"{label}. Make G write its input in both grad modes or in neither.")

    def _keep_graph(self):
        z_work = [z.detach().requires_grad_() for z in self._zs]
        self._snapshot.restore()  # the random state and buffers of the call: the masks every product sees
        # G runs on copies of its buffers: the kept graph saves them (BatchNorm saves its running statistics), and
        # the user's own buffers, restored in place afterwards, must not be the tensors it saved.
        with self._snapshot.private_buffers(), torch.enable_grad(), differentiable_attention():
            # G takes copies of z only where it wrote its input when the chain ran it (a copy its first op saves
            # would stay in the kept graph).
            out = tree_flatten(on_inputs(frozen(self._G), z_work, copies=self._chain.writes[0], refuse=self._wrote_z))[0]
            if self.kind == "ggn":
                return z_work, [o if differentiable(o) and o.requires_grad else None for o in out]
            g_in = [o for o in out]
            y_tree = tree_unflatten([t.detach() for t in self._y_leaves], self._y_spec)
            loss = evaluate_f(self._call, self._f, self._y_leaves, y_tree, tree_unflatten(g_in, self._chain.spec))
            _checks.check_scalar_output(self._call, loss)
            grads = torch.autograd.grad(loss.reshape(()), z_work, create_graph=True, allow_unused=True)
            return z_work, list(grads)

    # -- products ---------------------------------------------------------------------------

    def _as_list(self, u, name="u"):
        """u (z's structure) as a list of tensors; constants here: the products carry no graph to u."""
        if u is None:
            return None
        return [t.detach() for t in _checks.flatten_v(self._call, self._zs if self._tuple else self._zs[0], self._zs, u)]

    def _structure(self, leaves):
        return tuple(leaves) if self._tuple else leaves[0]

    @contextlib.contextmanager
    def _replaying(self):
        """G as at construction inside the block, as the caller had it after.

        The random state, the buffers the snapshot copied and the modules' modes are replayed from
        construction; what is read again without a copy (G's parameters, buffers too large to copy,
        z and y) is checked against its version then, so a product never mixes the cached
        boundaries with new state.
        """
        assert self._versions is not None  # constructed
        every_op = not self._replayed  # later products replay the same state, so draw from the sources it saw
        with self._versions.replaying(self._snapshot, every_op=every_op), \
                self._snapshot.watching(mode=every_op):
            self._snapshot.restore()
            yield
        self._replayed = True

    def _products(self, us):
        """:math:`(H + \\lambda I) u_j` for k tangents (each leaf with a leading k)."""
        with self._replaying():
            out = self._curvature(us)
        if self.damping:
            out = [o + self.damping * u for o, u in zip(out, us)]
        return out

    def _curvature(self, us):
        k = us[0].shape[0]
        if self._kept is not None and self.kind == "hessian":
            z_work, grads = self._kept
            live = [(g, j) for j, g in enumerate(grads) if g is not None and g.requires_grad]
            rows = []
            for i in range(k):
                row = torch.autograd.grad([g for g, _ in live], z_work, [us[j][i] for _, j in live], retain_graph=True,
                                          allow_unused=True) if live else [None] * len(z_work)
                rows.append([torch.zeros_like(z) if r is None else r for r, z in zip(row, z_work)])
            return [torch.stack([row[m] for row in rows]) for m in range(len(z_work))]
        if self.kind == "ggn":
            g_leaves, g_dots, spec = push(self._call, self._G, self._zs, us, self._snapshot)  # restored by _replaying
            _, mu = f_derivatives(self._call, self._f, self._y_leaves, self._y_spec, g_leaves, spec, g_dots)
            del g_leaves, g_dots  # the sweep below needs only mu
            if self._kept is not None:
                return self._pull_kept(mu, k)
            return self._chain.pull(mu)
        tangents, g_leaves = self._chain.tangents(us)
        _, mu = f_derivatives(self._call, self._f, self._y_leaves, self._y_spec, g_leaves, self._chain.spec,
                              tangents[-1])
        del g_leaves
        return self._chain.hessian(self._f_gradient(), mu, tangents)[1]

    def f_gradient(self):
        r""":math:`\nabla_g f` at G's output (computed once, on first use), one entry per leaf of g."""
        if self._versions is not None:
            self._versions.check()  # a cached gradient is the state at construction's too
        return self._f_gradient()

    def _f_gradient(self):
        """:meth:`f_gradient` inside a replay, where mixedad's own restores may have written buffers."""
        if self._lam is None:
            output = self._chain.output
            if output is None:  # dropped after construction: one forward pass of G again
                with torch.no_grad(), self._replaying():
                    output = [t.detach() if isinstance(t, torch.Tensor) else t for t in tree_flatten(self._G(*self._zs))[0]]
            self._lam, _ = f_derivatives(self._call, self._f, self._y_leaves, self._y_spec, output, self._chain.spec)
        return self._lam

    def _pull_kept(self, mu, k):
        assert self._kept is not None
        z_work, out = self._kept
        live = [(o, m) for o, m in zip(out, mu) if o is not None and m is not None]
        rows = []
        for i in range(k):
            row = torch.autograd.grad([o for o, _ in live], z_work, [m[i] for _, m in live], retain_graph=True,
                                      allow_unused=True) if live else [None] * len(z_work)
            rows.append([torch.zeros_like(z) if r is None else r for r, z in zip(row, z_work)])
        return [torch.stack([row[m] for row in rows]) for m in range(len(z_work))]

    @public_call
    def matvec(self, u: Any) -> Any:
        r""":math:`(H + \lambda I)\, u`, with z's structure.

        .. math::

            u \mapsto (H + \lambda I)\, u

        Example:
            >>> import torch, mixedad
            >>> G = torch.nn.Linear(2, 2).double()
            >>> op = mixedad.z_curvature(lambda y, g: (g * y).sum() ** 2, G, torch.ones(2).double(), torch.ones(2).double())
            >>> op.matvec(torch.ones(2).double()).shape
            torch.Size([2])
        """
        us = self._as_list(u)
        return self._structure([o[0] for o in self._products([t.unsqueeze(0) for t in us])])

    def __matmul__(self, u: Any) -> Any:
        return self.matvec(u)

    @public_call
    def matmat(self, U: Any) -> Any:
        r"""The product with k vectors at once: U has z's structure with a leading dimension k.

        .. math::

            [u_1, \ldots, u_k] \mapsto [(H + \lambda I) u_1, \ldots, (H + \lambda I) u_k]

        The forward tangents of the k vectors go through G as one batch; each reverse segment is
        recomputed once for all k.

        Example:
            >>> import torch, mixedad
            >>> G = torch.nn.Linear(2, 2).double()
            >>> op = mixedad.z_curvature(lambda y, g: (g * y).sum() ** 2, G, torch.ones(2).double(), torch.ones(2).double())
            >>> op.matmat(torch.eye(2).double()).shape
            torch.Size([2, 2])
        """
        leaves = list(U) if self._tuple else [U]
        if len(leaves) != len(self._zs) or not all(isinstance(t, torch.Tensor) and t.dim() == z.dim() + 1
                                                     and t.shape[1:] == z.shape for t, z in zip(leaves, self._zs)):
            raise ValueError(f"{self._call}: matmat expects z's structure with one leading dimension (k, *z.shape).")
        for t, z in zip(leaves, self._zs):
            if t.dtype != z.dtype or t.device != z.device:
                raise ValueError(f"{self._call}: matmat expects z's dtype and device ({z.dtype}, {z.device}), got "
                                 f"{t.dtype} on {t.device}.")
        if leaves[0].shape[0] == 0:
            return self._structure([t.detach().clone() for t in leaves])  # no vector: no product
        return self._structure(self._products([t.detach() for t in leaves]))

    def _flat_products(self, vectors):
        """Products with rows of ``vectors`` (m, size), BATCH at a time; returns (m, size)."""
        out = []
        for start in range(0, vectors.shape[0], BATCH):
            block = vectors[start:start + BATCH]
            us, offset = [], 0
            for z in self._zs:
                us.append(block[:, offset:offset + z.numel()].reshape(block.shape[0], *z.shape))
                offset += z.numel()
            products = self._products(us)
            out.append(torch.cat([p.reshape(block.shape[0], -1) for p in products], dim=1))
        return torch.cat(out)

    @public_call
    def dense(self) -> torch.Tensor:
        r"""The whole matrix :math:`H + \lambda I`, of shape (size, size), for small z.

        .. math::

            (H + \lambda I)_{ij} = e_i^\top (H + \lambda I)\, e_j

        Costs size products (in batches of :data:`BATCH` tangents).

        Example:
            >>> import torch, mixedad
            >>> G = torch.nn.Linear(2, 3).double()
            >>> mixedad.z_curvature(lambda y, g: (g ** 2).sum(), G, torch.ones(2).double(), torch.ones(3).double()).dense().shape
            torch.Size([2, 2])
        """
        z = self._zs[0]
        return self._flat_products(torch.eye(self.size, dtype=z.dtype, device=z.device)).T.contiguous()

    def _probes(self, samples, generator):
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"{self._call}: expected samples to be None or a positive int, got {samples!r}.")
        if generator is not None and (not isinstance(generator, torch.Generator) or generator.device.type == "meta"):
            raise TypeError(f"{self._call}: expected generator to be None or a torch.Generator on a real device, got "
                            f"{generator!r}.")
        z = self._zs[0]
        signs = torch.randint(0, 2, (samples, self.size), generator=generator, device=generator.device
                              if generator is not None else "cpu")
        return signs.to(device=z.device, dtype=z.dtype).mul_(2).sub_(1)

    def _diagonal_flat(self, samples, generator):
        if samples is None:
            return self.dense().diagonal()
        probes = self._probes(samples, generator)
        return (probes * self._flat_products(probes)).mean(0)

    @public_call
    def diagonal(self, samples: Optional[int] = None, generator: Optional[torch.Generator] = None) -> Any:
        r"""The diagonal of :math:`H + \lambda I`, with z's structure.

        .. math::

            \mathrm{diag}(H) = \mathbb{E}_p\,[\,p \odot H p\,], \quad p_i = \pm 1

        Exact (``samples=None``: size products), or estimated from ``samples`` Rademacher probes
        (drawn from ``generator``), pushed through G in batches.

        Example:
            >>> import torch, mixedad
            >>> G = torch.nn.Linear(2, 3).double()
            >>> mixedad.z_curvature(lambda y, g: (g ** 2).sum(), G, torch.ones(2).double(), torch.ones(3).double()).diagonal().shape
            torch.Size([2])
        """
        flat, offset, leaves = self._diagonal_flat(samples, generator), 0, []
        for z in self._zs:
            leaves.append(flat[offset:offset + z.numel()].reshape(z.shape))
            offset += z.numel()
        return self._structure(leaves)

    @public_call
    def trace(self, samples: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        r"""The trace of :math:`H + \lambda I`, a 0-d tensor: exact, or Hutchinson's estimate from ``samples`` probes.

        .. math::

            \mathrm{tr}(H) = \mathbb{E}_p\,[\,p^\top H p\,], \quad p_i = \pm 1

        Example:
            >>> import torch, mixedad
            >>> G = torch.nn.Linear(2, 3).double()
            >>> mixedad.z_curvature(lambda y, g: (g ** 2).sum(), G, torch.ones(2).double(), torch.ones(3).double()).trace().dim()
            0
        """
        return self._diagonal_flat(samples, generator).sum()

    @public_call
    def solve(self, b: Any, *, tol: float = 1e-6, maxiter: Optional[int] = None) -> Any:
        r"""x with :math:`(H + \lambda I)\, x = b`, by conjugate gradients, with z's structure.

        .. math::

            \lVert b - (H + \lambda I)\, x \rVert \le \mathrm{tol}\cdot\lVert b \rVert

        One product per iteration. ``maxiter`` defaults to twice the dimension of z-space; ending
        above ``tol`` (maxiter reached, or the residual stalled where the dtype's rounding
        dominates) warns (RuntimeWarning) and returns the best iterate, and ending the default
        budget no nearer b than x = 0 (a singular operator) raises :class:`CurvatureError`. A direction of non-positive curvature raises
        :class:`CurvatureError` (the Hessian is indefinite there: add damping, or use the GGN).
        :attr:`last_solve` records the iterations and the residual.

        Example:
            >>> import torch, mixedad
            >>> G = torch.nn.Linear(2, 3).double()
            >>> op = mixedad.z_curvature(lambda y, g: (g ** 2).sum(), G, torch.ones(2).double(), torch.ones(3).double())
            >>> x = op.solve(torch.ones(2).double())
            >>> torch.allclose(op @ x, torch.ones(2).double())
            True
        """
        _check_settings(self._call + ".solve", kind=self.kind, damping=0.0, keep_graph=False, tol=tol, maxiter=maxiter)
        bs = self._as_list(b, "b")
        x, iterations, residual = conjugate_gradient(
            self._call + ".solve", lambda p: [o[0] for o in self._products([t.unsqueeze(0) for t in p])], bs,
            tol=tol, maxiter=maxiter, kind=self.kind)
        self.last_solve = SolveInfo(iterations, residual)
        return self._structure(x)

    def __repr__(self) -> str:
        return (f"ZCurvature(kind={self.kind!r}, damping={self.damping}, size={self.size}, "
                f"segments={self.segments})")


@public_call
def z_curvature(f: Callable[..., torch.Tensor], G: Callable[..., Any], z: Union[torch.Tensor, Sequence[torch.Tensor]],
                y: Any, *, kind: str = "ggn", damping: float = 0.0, segments: Any = "auto",
                keep_graph: bool = False) -> ZCurvature:
    r"""The curvature of :math:`L(z) = f(y, G(z))` in z at the point (z, y), as a linear operator.

    .. math::

        \mathrm{ggn} = J_G^\top\, \nabla^2_g f\, J_G + \lambda I, \qquad
        \mathrm{hessian} = \nabla^2_z f(y, G(z)) + \lambda I

    The GGN drops G's own curvature :math:`\sum_k (\nabla_g f)_k \nabla^2 G_k`: exact at a
    perfect fit, and positive semi-definite for a convex f (sound for Gauss-Newton steps near a
    good fit); implicit differentiation needs the full Hessian.

    How each product is computed, and what it costs (d: G's depth; :math:`\sqrt d` segments):

    - ``ggn``: :math:`J_G u` by mixedad's forward pass (flat in depth), :math:`\nabla^2_g f`
      by double backward through f only, :math:`J_G^\top w` by one backward through G, one
      segment at a time from the cached segment boundaries (each segment recomputed once).
      Time: about one forward with tangent plus one forward and one backward of G. Memory: the
      boundaries plus one segment's graph, growing as :math:`\sqrt d`.
    - ``hessian``: the tangents at every boundary by mixedad's forward pass, one segment at a
      time, then a second-order adjoint sweep that double-backwards one recomputed segment at
      a time (:mod:`mixedad._curvature.segments`). Time: about one forward with tangent plus one
      forward, one backward and one double backward of G. Memory: boundaries and tangents plus
      one segment's double-backward graph, growing as :math:`\sqrt d`.
    - ``keep_graph=True`` trades memory for speed: G's graph (for the Hessian, the graph of
      :math:`\nabla_z L` with ``create_graph``) is built once and kept alive for the operator's
      lifetime, and each product is one backward through it, as torchopt's and JAXopt's solvers
      do. Memory then grows with depth like double backward's.

    Segments: an ``nn.Sequential`` G is split into :math:`\sqrt{n/2}` slices (rounded) of its n
    modules; any other G is one segment (memory then as double backward's, never more) unless
    ``segments`` lists callables whose composition is G (checked once against G(z)).

    G's random state, buffers and module modes are replayed from the call's state for every
    product (dropout draws the same masks each time: the operator is one linear map), and left as
    the caller had them. What the products read again without a copy (G's parameters, eval-mode
    buffers too large to copy, z and y's leaves) is checked against its version at this call
    before every method runs (``tensor._version``, as autograd does): a change in place, or a
    replaced parameter, raises :class:`mixedad.StateChangedError`; build a new operator instead.

    Args:
        f: ``f(y, g)`` returning a scalar; y is a constant here.
        G: the generator, as for :func:`mixedad.mixed_grad`.
        z: floating-point tensor, or a tuple of them (``G(*z)``).
        y: tensor or pytree of tensors.
        kind: keyword-only; "ggn" (default) or "hessian".
        damping: keyword-only; :math:`\lambda \ge 0`.
        segments: keyword-only; "auto", an int (slices of an ``nn.Sequential``), or a list of
            callables whose composition is G (each but the last returns a tensor or a tuple of
            tensors, which the next takes positionally).
        keep_graph: keyword-only; keep G's graph alive for speed (memory grows with depth).

    Returns:
        A :class:`ZCurvature`.

    Raises:
        ValueError: an unknown kind, a negative damping, segments that do not compose to G.
        TypeError: as for :func:`mixedad.mixed_grad`; segments that are not callables.

    Example:
        >>> import torch, mixedad
        >>> G = mixedad.zoo.mlp(2, 4, dtype=torch.float64)
        >>> f = lambda y, g: ((g - y) ** 2).sum()
        >>> z, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
        >>> op = mixedad.z_curvature(f, G, z, y, kind="hessian", damping=0.1)
        >>> (op @ torch.ones_like(z)).shape
        torch.Size([3, 4])
    """
    call = "z_curvature(f, G, z, y)"
    damping = _check_settings(call, kind=kind, damping=damping, keep_graph=keep_graph)
    return ZCurvature(call, f, G, z, y, kind=kind, damping=damping, segments=segments, keep_graph=keep_graph)


def _check_settings(call, *, kind, damping, keep_graph, tol=1e-6, maxiter=None, solve=None):
    """Check the keywords of the curvature calls up front; returns the damping as a float.

    Numbers may be Python, NumPy or 0-d torch numbers; damping is finite and >= 0, tol finite and > 0.
    """
    if kind not in KINDS:
        raise ValueError(f"{call}: expected kind in {KINDS}, got {kind!r}.")
    lam = _real(damping)
    if lam is None or not 0 <= lam < math.inf:
        raise ValueError(f"{call}: expected damping to be a finite number >= 0, got {damping!r}.")
    if not isinstance(keep_graph, bool):
        raise TypeError(f"{call}: expected keep_graph to be True or False, got {keep_graph!r}.")
    t = _real(tol)
    if t is None or not 0 < t < math.inf:
        raise ValueError(f"{call}: expected tol to be a finite number > 0, got {tol!r}.")
    if maxiter is not None and (isinstance(maxiter, bool) or not isinstance(maxiter, int) or maxiter < 1):
        raise ValueError(f"{call}: expected maxiter to be a positive int or None, got {maxiter!r}.")
    if solve is not None and not callable(solve):
        raise TypeError(f"{call}: expected solve to be None or a callable solve(matvec, b) -> x, got {solve!r}.")
    return lam


def _real(x):
    """``x`` as a float if it is a real number (Python, NumPy, a 0-d real torch tensor), else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, torch.Tensor):
        return float(x) if x.dim() == 0 and not x.is_complex() and x.dtype != torch.bool else None
    if isinstance(x, numbers.Real):
        return float(x)
    return None
