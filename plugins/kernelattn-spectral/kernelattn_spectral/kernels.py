"""Closed-form target kernels of the learned spectral feature maps.

Both kernels are parameterised by a Gaussian mixture with equal weights
:math:`\\pi_c = 1/C` and components :math:`\\mathcal N(\\mu_c, A_c A_c^\\top)` (the
reparameterisation :math:`\\omega = A_c n + \\mu_c`, :math:`n \\sim \\mathcal N(0, I)`; the
paper calls :math:`A_c` "Σ_c", but the covariance it implies is :math:`A_c A_c^\\top`).
With no parameters they reduce to the kernels the maps target at initialisation.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from kernelattn_core.toolkit import (
    InputError,
    Kernel,
    KernelFamily,
    QuadratureIdentity,
    ShiftInvariantKernel,
    finite_rows,
)

from . import theory as _theory


def _check_bandwidth(bandwidth: float) -> float:
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not math.isfinite(bandwidth):
        raise InputError(f"bandwidth: expected a finite positive number, got {bandwidth!r}")
    if bandwidth <= 0:
        raise InputError(f"bandwidth: expected a finite positive number, got {bandwidth!r}")
    return float(bandwidth)


def _mixture(
    means: torch.Tensor | None, factors: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Validate ``means [C, d]`` and ``factors [C, d, d]`` (full) or ``[C, d]`` (diagonal)."""
    if means is not None:
        if not isinstance(means, torch.Tensor) or means.dim() != 2:
            raise InputError(f"means: expected a tensor [C, d], got {getattr(means, 'shape', type(means).__name__)}")
    if factors is not None:
        if not isinstance(factors, torch.Tensor) or factors.dim() not in (2, 3):
            raise InputError(
                "factors: expected a tensor [C, d, d] (full) or [C, d] (diagonal), "
                f"got {getattr(factors, 'shape', type(factors).__name__)}"
            )
        if factors.dim() == 3 and factors.shape[-1] != factors.shape[-2]:
            raise InputError(f"factors: expected square matrices [C, d, d], got shape {tuple(factors.shape)}")
        if means is not None and (factors.shape[0] != means.shape[0] or factors.shape[1] != means.shape[1]):
            raise InputError(
                f"factors: expected C = {means.shape[0]} components of dimension d = {means.shape[1]} as in means, "
                f"got shape {tuple(factors.shape)}"
            )
    return means, factors


def _transpose_apply(factors: torch.Tensor | None, v: torch.Tensor, bandwidth: float) -> torch.Tensor:
    """:math:`A_c^\\top v` for every component: ``v [..., d]`` to ``[..., C, d]``."""
    if factors is None:
        return (v / bandwidth).unsqueeze(-2)  # A = I / sigma, C = 1
    f = factors.to(v.dtype)
    if f.dim() == 2:  # diagonal factors [C, d]
        return v.unsqueeze(-2) * f  # [..., C, d]
    return torch.einsum("...i,cij->...cj", v, f)  # (A_c^T v)_j = sum_i A_ij v_i


def _components(means: torch.Tensor | None, factors: torch.Tensor | None) -> int:
    if means is not None:
        return int(means.shape[0])
    return 1 if factors is None else int(factors.shape[0])


def _pairwise_quad(
    q: torch.Tensor, k: torch.Tensor, factors: torch.Tensor | None, bandwidth: float, sign: float
) -> torch.Tensor:
    """:math:`\\|A_c^\\top (q_i + \\text{sign}\\, k_j)\\|^2` ``[..., N, M, C]``, expanded as
    :math:`\\|A_c^\\top q_i\\|^2 + \\|A_c^\\top k_j\\|^2 + 2\\,\\text{sign}\\,(A_c^\\top q_i)^\\top (A_c^\\top k_j)`
    (one batched product per component) instead of forming the ``[..., N, M, d]``
    differences: memory :math:`O(N M C)` instead of :math:`O(N M d)` (at N = M = 4096,
    d = 64, four heads in float64 the differences alone needed 32 GiB). Clamped at 0
    against round-off."""
    pq = _transpose_apply(factors, q, bandwidth)  # [..., N, C, d]
    pk = _transpose_apply(factors, k, bandwidth)  # [..., M, C, d]
    cross = torch.einsum("...ncd,...mcd->...nmc", pq, pk)  # [..., N, M, C]
    qq = pq.pow(2).sum(-1).unsqueeze(-2)  # [..., N, 1, C]
    kk = pk.pow(2).sum(-1).unsqueeze(-3)  # [..., 1, M, C]
    return (qq + kk + (2.0 * sign) * cross).clamp_min(0.0)


def _pairwise_phase(q: torch.Tensor, k: torch.Tensor, means: torch.Tensor, sign: float) -> torch.Tensor:
    """:math:`\\mu_c^\\top (q_i + \\text{sign}\\, k_j)` ``[..., N, M, C]``."""
    mu = means.to(q.dtype).transpose(0, 1)  # [d, C]
    return (q @ mu).unsqueeze(-2) + sign * (k @ mu).unsqueeze(-3)


def _check_dim(name: str, t: torch.Tensor | None, d: int) -> None:
    if t is not None and t.shape[1] != d:
        raise InputError(f"{name}: expected dimension d = {d} (the inputs' last dimension), got shape {tuple(t.shape)}")


class SpectralMixtureKernel(ShiftInvariantKernel):
    """The GMM-RKS kernel (a spectral mixture with equal weights):

    .. math::
        K(q, k) = \\frac{1}{C} \\sum_{c=1}^{C}
        \\exp\\!\\left(-\\tfrac12 \\delta^\\top A_c A_c^\\top \\delta\\right) \\cos(\\mu_c^\\top \\delta),
        \\qquad \\delta = q - k,

    the characteristic function (real part) of the mixture
    :math:`\\frac1C \\sum_c \\mathcal N(\\mu_c, A_c A_c^\\top)`. With no parameters
    (``C = 1``, :math:`\\mu = 0`, :math:`A = I/\\sigma`) it is the RBF kernel
    :math:`\\exp(-\\|\\delta\\|^2 / (2\\sigma^2))`, the target of GMM-RKS with ``mean_init_std=0``
    and of fixed FastFood-RKS.

    Parameters
    ----------
    means : Tensor ``[C, d]``, optional
        :math:`\\mu_c`; zero when ``None``.
    factors : Tensor ``[C, d, d]`` or ``[C, d]``, optional
        Full factors :math:`A_c`, or the diagonals of diagonal factors; :math:`I/\\sigma` when ``None``.
    bandwidth : float
        :math:`\\sigma`, used only when ``factors`` is ``None``.

    Notes
    -----
    Not positive in general (the cosine changes sign), so exact attention with it can
    have negative weights; it is positive definite.
    """

    name: ClassVar[str] = "spectral-gmm"
    positive: ClassVar[bool] = False
    claims: ClassVar[tuple[object, ...]] = (
        QuadratureIdentity(evaluate=_theory.hp_eq34_corrected, label="KL-Transformer Eq. 34, corrected"),
        QuadratureIdentity(evaluate=_theory.hp_eq34_printed, label="KL-Transformer Eq. 34 as printed", expect="fail"),
    )

    def __init__(
        self,
        means: torch.Tensor | None = None,
        factors: torch.Tensor | None = None,
        *,
        bandwidth: float = 1.0,
    ) -> None:
        self.means, self.factors = _mixture(means, factors)
        self.bandwidth = _check_bandwidth(bandwidth)

    def g(self, delta: torch.Tensor) -> torch.Tensor:
        d = delta.shape[-1]
        _check_dim("means", self.means, d)
        _check_dim("factors", self.factors, d)
        quad = _transpose_apply(self.factors, delta, self.bandwidth).pow(2).sum(-1)  # [..., C]
        out = torch.exp(-0.5 * quad)
        if self.means is not None:
            out = out * torch.cos(delta @ self.means.to(delta.dtype).transpose(0, 1))  # [..., C]
        return out.mean(-1)

    def row_scaled_matrix(self, q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """:math:`K(q_i, k_j)\\,e^{-m_i}` ``[..., N, M]``, 0 outside ``allowed``: the kernel
        matrix up to a positive per-query factor, which cancels in attention.

        .. math:: m_i = \\max_{j \\text{ allowed}, c} -\\tfrac12 \\delta_{ij}^\\top A_c A_c^\\top \\delta_{ij}

        (detached). At large :math:`\\|q - k\\|` every :math:`K(q_i, k_j)` underflows; the
        plain matrix then gives a subnormal row sum whose reciprocal overflows in the
        backward pass (NaN gradients at scaled norm 10). Here the largest magnitude of a
        row is :math:`\\approx 1`, so outputs and gradients stay finite. Disallowed pairs
        (``allowed``, bool broadcastable to ``[..., N, M]``: causal and padding masks) are
        *replaced* before any arithmetic, so a later or padded key (NaN, inf) reaches no
        allowed entry, in the backward pass either.
        """
        d = q.shape[-1]
        _check_dim("means", self.means, d)
        _check_dim("factors", self.factors, d)
        # a non-finite q_i or k_j enters no product (in the pairwise expansion it would
        # reach every gradient through 0 * NaN); the pairs that see it are set to NaN below
        bad_q, bad_k = ~finite_rows(q), ~finite_rows(k)  # [..., N], [..., M]
        hit = None
        if bool(bad_q.any()) or bool(bad_k.any()):
            q = q.masked_fill(bad_q.unsqueeze(-1), 0.0)
            k = k.masked_fill(bad_k.unsqueeze(-1), 0.0)
            hit = bad_q.unsqueeze(-1) | bad_k.unsqueeze(-2)  # [..., N, M]
            if allowed is not None:
                hit = hit & allowed
        expo = -0.5 * _pairwise_quad(q, k, self.factors, self.bandwidth, -1.0)  # [..., N, M, C]
        if allowed is not None:
            expo = expo.masked_fill(~allowed.unsqueeze(-1), float("-inf"))
        top = expo.detach().amax(dim=(-2, -1), keepdim=True)  # [..., N, 1, 1]
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        out = torch.exp(expo - top)
        if self.means is not None:
            out = out * torch.cos(_pairwise_phase(q, k, self.means, -1.0))  # [..., N, M, C]
        out = out.mean(-1)
        return out if hit is None else out.masked_fill(hit, float("nan"))

    def _evaluate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``[..., N, M]`` without forming the pairwise differences (see :func:`_pairwise_quad`)."""
        d = q.shape[-1]
        _check_dim("means", self.means, d)
        _check_dim("factors", self.factors, d)
        out = torch.exp(-0.5 * _pairwise_quad(q, k, self.factors, self.bandwidth, -1.0))  # [..., N, M, C]
        if self.means is not None:
            out = out * torch.cos(_pairwise_phase(q, k, self.means, -1.0))
        return out.mean(-1)

    def __repr__(self) -> str:
        return f"SpectralMixtureKernel(C={_components(self.means, self.factors)}, bandwidth={self.bandwidth})"


class GaussianPRFKernel(Kernel):
    """The kernel of positive random features with Gaussian-mixture frequencies (GMM-PRF):

    .. math::
        K(q, k) = \\frac{1}{C} \\sum_{c=1}^{C}
        \\exp\\!\\left(\\mu_c^\\top s + \\tfrac12 s^\\top A_c A_c^\\top s
        - \\tfrac12 \\|q\\|^2 - \\tfrac12 \\|k\\|^2\\right), \\qquad s = q + k,

    which is :math:`\\mathbb{E}_\\omega[e^{\\omega^\\top q - \\|q\\|^2/2} e^{\\omega^\\top k - \\|k\\|^2/2}]`
    for :math:`\\omega \\sim \\frac1C \\sum_c \\mathcal N(\\mu_c, A_c A_c^\\top)`. Not
    shift-invariant. With no parameters (``C = 1``, :math:`\\mu = 0`, :math:`A = I/\\sigma`)
    and :math:`\\sigma = 1` it is the softmax kernel :math:`e^{q^\\top k}`.

    Parameters
    ----------
    means : Tensor ``[C, d]``, optional
    factors : Tensor ``[C, d, d]`` or ``[C, d]`` (diagonal, as GMM-PRF uses), optional
    bandwidth : float
        :math:`\\sigma` when ``factors`` is ``None``.
    """

    name: ClassVar[str] = "spectral-prf"
    family: ClassVar[KernelFamily] = KernelFamily.GENERAL
    positive: ClassVar[bool] = True

    def __init__(
        self,
        means: torch.Tensor | None = None,
        factors: torch.Tensor | None = None,
        *,
        bandwidth: float = 1.0,
    ) -> None:
        self.means, self.factors = _mixture(means, factors)
        self.bandwidth = _check_bandwidth(bandwidth)

    def log_evaluate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """:math:`\\log K(q_i, k_j)` by a log-sum-exp over components, ``[..., N, M]``."""
        d = q.shape[-1]
        _check_dim("means", self.means, d)
        _check_dim("factors", self.factors, d)
        expo = 0.5 * _pairwise_quad(q, k, self.factors, self.bandwidth, 1.0)  # [..., N, M, C]: s = q + k
        if self.means is not None:
            expo = expo + _pairwise_phase(q, k, self.means, 1.0)
        norms = 0.5 * (q.pow(2).sum(-1).unsqueeze(-1) + k.pow(2).sum(-1).unsqueeze(-2))  # [..., N, M]
        return torch.logsumexp(expo, dim=-1) - math.log(expo.shape[-1]) - norms

    def _evaluate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self.log_evaluate(q, k).exp()

    def __repr__(self) -> str:
        return f"GaussianPRFKernel(C={_components(self.means, self.factors)}, bandwidth={self.bandwidth})"
