"""The :class:`Kernel` interface: the exact target that feature maps estimate.

A kernel evaluates :math:`K(q_i, k_j)` for batched inputs ``q [B, H, N, d]`` and
``k [B, H, M, d]``, giving ``[B, H, N, M]``. Three families are distinguished:

* dot-product kernels :math:`K(q, k) = f(\\langle q, k \\rangle)` with a Maclaurin
  expansion :math:`f(t) = \\sum_n a_n t^n` (:class:`DotProductKernel`);
* shift-invariant kernels :math:`K(q, k) = g(q - k)` (:class:`ShiftInvariantKernel`);
* anything else (``family = "general"``).
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from fractions import Fraction
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..errors import DomainError, InputError
from ..validation import check_tensor

if TYPE_CHECKING:  # sympy is imported lazily: it is slow to import and only the checkers need it
    import sympy


class KernelFamily(str, enum.Enum):
    """Which structure a kernel has; decides which claims and checkers apply."""

    DOT_PRODUCT = "dot-product"
    SHIFT_INVARIANT = "shift-invariant"
    GENERAL = "general"


class Kernel(ABC):
    """Abstract exact kernel :math:`K: \\mathbb{R}^d \\times \\mathbb{R}^d \\to \\mathbb{R}`.

    Subclasses set the class attributes and implement :meth:`_evaluate`. The public
    call (:meth:`__call__`) validates shapes and dtypes first (template method).

    Attributes
    ----------
    name : str
        Unique registry name (lower case, digits and ``-``).
    family : KernelFamily
        The kernel's structure.
    positive : bool
        Whether :math:`K(q, k) > 0` for every input in the domain (needed for the
        row normalisation of attention to be well defined).
    claims : tuple
        Machine-checkable claims (see ``spec/``).
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    family: ClassVar[KernelFamily] = KernelFamily.GENERAL
    positive: ClassVar[bool] = False
    claims: ClassVar[tuple[Any, ...]] = ()

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Evaluate the kernel matrix.

        Parameters
        ----------
        q : Tensor ``[..., N, d]``
        k : Tensor ``[..., M, d]``

        Returns
        -------
        Tensor ``[..., N, M]`` with entries :math:`K(q_i, k_j)`.
        """
        check_tensor("q", q)
        check_tensor("k", k)
        if q.dim() < 2 or k.dim() < 2:
            raise InputError(
                f"q, k: expected tensors [..., N, d] and [..., M, d], got shapes {tuple(q.shape)}, {tuple(k.shape)}"
            )
        if q.shape[-1] != k.shape[-1]:
            raise InputError(f"k: expected last dimension d = {q.shape[-1]} as in q, got {k.shape[-1]}")
        if q.dtype != k.dtype:
            raise InputError(f"k: expected the dtype of q ({q.dtype}), got {k.dtype}")
        return self._evaluate(q, k)

    @abstractmethod
    def _evaluate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Compute ``[..., N, M]`` kernel values for validated inputs."""

    def masked_matrix(self, q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """The kernel matrix ``[..., N, M]`` with every pair outside ``allowed`` set to 0.

        ``allowed`` (bool, broadcastable to ``[..., N, M]``) marks the pairs that may
        interact (causal and padding masks). Disallowed pairs are *replaced*, never
        multiplied by zero, so whatever a padded or future key holds (NaN, inf, a value
        outside the kernel's domain) never reaches an allowed entry. Dot-product kernels
        also check their domain on the allowed pairs only.
        """
        if allowed is None:
            return self(q, k)
        return self(q, k).masked_fill(~allowed, 0.0)

    def row_scaled_matrix(self, q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """:meth:`masked_matrix` up to a positive factor per query row, which cancels in
        attention: :math:`K(q_i, k_j)\\,c_i`, 0 outside ``allowed``.

        Exact attention of kernels without :meth:`log_evaluate` uses it. The default is
        :meth:`masked_matrix` (:math:`c_i = 1`); a kernel whose rows can underflow as a
        whole (so that the row sum's reciprocal overflows in the backward pass) overrides
        it to state each row near its largest entry.
        """
        return self.masked_matrix(q, k, allowed)

    def log_evaluate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
        """:math:`\\log K(q_i, k_j)` when it is cheap and stable to compute, else ``None``.

        Exact attention uses it to form the row normalisation in log space.
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class DotProductKernel(Kernel):
    """A dot-product kernel :math:`K(q, k) = f(\\langle q, k\\rangle)` with
    :math:`f(t) = \\sum_{n \\ge 0} a_n t^n`, :math:`a_n \\ge 0`.

    Subclasses implement :meth:`f` (torch), :meth:`sympy_expr` (the same function in
    SymPy, used to check coefficients exactly) and :meth:`coefficient`.

    Attributes
    ----------
    radius : float
        Radius of convergence of the Maclaurin series (``math.inf`` for entire
        functions). Inputs with :math:`|\\langle q, k\\rangle| \\ge` ``radius`` are
        rejected by :meth:`check_domain`.
    """

    family: ClassVar[KernelFamily] = KernelFamily.DOT_PRODUCT
    radius: ClassVar[float] = math.inf

    @abstractmethod
    def f(self, t: torch.Tensor) -> torch.Tensor:
        """The scalar function :math:`f(t)` applied elementwise."""

    @abstractmethod
    def sympy_expr(self, t: sympy.Symbol) -> sympy.Expr:
        """:math:`f` as a SymPy expression in the symbol ``t``."""

    @abstractmethod
    def coefficient(self, n: int) -> Fraction | float:
        """The Maclaurin coefficient :math:`a_n` (a :class:`fractions.Fraction` when exact)."""

    def coefficients(self, n_max: int) -> list[Fraction | float]:
        """:math:`[a_0, \\dots, a_{n_{max}}]`."""
        return [self.coefficient(n) for n in range(n_max + 1)]

    def check_domain(self, t: torch.Tensor) -> None:
        """Raise :class:`~kernelattn_core.errors.DomainError` when some finite
        :math:`|t| \\ge` ``radius`` (the series, and so the random features, diverge).

        A non-finite :math:`t` comes from a non-finite q or k, not from leaving the
        domain: it is not checked here and stays in the rows that see it (as in exact
        attention), so a NaN or inf at a later position cannot raise for a causal prefix
        that is in range."""
        if math.isfinite(self.radius):
            a = t.detach().abs()
            a = a[torch.isfinite(a)]
            worst = float(a.max()) if a.numel() else 0.0
            if worst >= self.radius:
                raise DomainError(
                    f"<q, k>: kernel {self.name!r} needs |<q, k>| < {self.radius} (radius of convergence), "
                    f"got max |<q, k>| = {worst:.6g}; normalise q and k (e.g. the ppSBN pre-scaling)"
                )

    def _evaluate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        t = q @ k.transpose(-1, -2)  # [..., N, M]
        self.check_domain(t)
        return self.f(t)

    def masked_matrix(self, q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """See :meth:`Kernel.masked_matrix`; :math:`t = \\langle q, k\\rangle` is set to 0 at
        disallowed pairs before the domain check and :math:`f`."""
        if allowed is None:
            return self(q, k)
        self(q[..., :0, :], k[..., :0, :])  # argument checks only (no pair)
        t = (q @ k.transpose(-1, -2)).masked_fill(~allowed, 0.0)  # [..., N, M]
        self.check_domain(t)
        return self.f(t).masked_fill(~allowed, 0.0)


class ShiftInvariantKernel(Kernel):
    """A shift-invariant kernel :math:`K(q, k) = g(q - k)`.

    Subclasses implement :meth:`g` on differences ``delta [..., d]``. By Bochner's
    theorem a continuous positive-definite :math:`g` with :math:`g(0) = 1` is the
    characteristic function of a spectral density :math:`p(\\omega)`, which random
    Fourier features sample.
    """

    family: ClassVar[KernelFamily] = KernelFamily.SHIFT_INVARIANT

    @abstractmethod
    def g(self, delta: torch.Tensor) -> torch.Tensor:
        """:math:`g(\\delta)` for ``delta [..., d]``, giving ``[...]``."""

    def _evaluate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        delta = q.unsqueeze(-2) - k.unsqueeze(-3)  # [..., N, M, d]
        return self.g(delta)

    def masked_matrix(self, q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """See :meth:`Kernel.masked_matrix`; the difference :math:`q - k` is set to 0 at
        disallowed pairs before :math:`g` (a future key of 1e30 gives :math:`g = \\infty
        \\cdot 0` there, whose backward would reach the query's gradient)."""
        if allowed is None:
            return self(q, k)
        self(q[..., :0, :], k[..., :0, :])  # argument checks only (no pair)
        delta = (q.unsqueeze(-2) - k.unsqueeze(-3)).masked_fill(~allowed.unsqueeze(-1), 0.0)  # [..., N, M, d]
        return self.g(delta).masked_fill(~allowed, 0.0)
