"""Choosing the matrix :math:`A` of CEXP / HCEXP from query and key statistics.

All rules work in the coordinates the feature map sees (after the :math:`d^{-1/4}`
scaling). Statistics are per component over every sample: a tensor ``[..., d]`` is
pooled over all its leading axes (batch, heads and positions).

Guards
------
Every rule divides by a statistic of the queries that can be zero. The guard is one
absolute floor ``eps`` (default ``1e-6``) applied to each statistic before the
division or the inverse: :math:`|\\mu| \\to \\max(|\\mu|, \\epsilon)`,
:math:`\\sigma^2 + \\mu^2 \\to \\max(\\sigma^2 + \\mu^2, \\epsilon)`, and the
eigenvalues of the second-moment matrices :math:`\\lambda \\to \\max(\\lambda,\\epsilon)`.
A component whose query *and* key statistics are both zero therefore gets
:math:`a_i = 1`, and no scale exceeds :math:`(\\max/\\epsilon)^{1/2}` (means rule) or
:math:`(\\max/\\epsilon)^{1/4}` (variance rule). Any :math:`A` keeps the estimator
unbiased; the guard only bounds how bad an :math:`A` a degenerate batch can produce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernelattn_core.toolkit import finite_rows

RULES = ("identity", "means", "variance", "full", "fixed")


@dataclass(frozen=True)
class Moments:
    """Per-component statistics of one side (queries or keys).

    Attributes
    ----------
    mean : Tensor ``[d]``
        Sample mean :math:`\\hat\\mu`.
    var : Tensor ``[d]``
        Unbiased sample variance :math:`\\hat\\sigma^2` (``ddof = 1``; ``ddof = 0`` when
        there is a single sample).
    second : Tensor ``[d, d]`` or None
        :math:`M = \\hat\\Sigma + \\hat\\mu\\hat\\mu^\\top` with the unbiased sample
        covariance :math:`\\hat\\Sigma` (only when requested).
    count : int
        Number of samples.
    """

    mean: torch.Tensor
    var: torch.Tensor
    second: torch.Tensor | None
    count: int


def moments(x: torch.Tensor, *, full: bool = False, padding: torch.Tensor | None = None) -> Moments:
    """Sample moments of ``x [..., d]`` pooled over all leading axes (float64 inside).

    Rows holding a non-finite value are left out (one NaN token must not poison
    statistics that every later batch uses). With no row left, ``count = 0`` and the
    moments are those of :math:`A = I` (mean 0, variance 1, :math:`M = I`): callers skip
    such a batch.

    Parameters
    ----------
    x : Tensor ``[..., d]``
    full : bool
        Also compute the second-moment matrix :math:`M = \\hat\\Sigma + \\hat\\mu\\hat\\mu^\\top`.
    padding : Tensor ``[B, M]`` of bool, optional
        For ``x [B, H, M, d]``: rows marked ``True`` (padded keys) are left out.
    """
    if padding is not None and x.dim() == 4:
        x = x[~padding[:, None, :].expand(x.shape[:3])]  # [n_valid, d]
    flat = x.detach().reshape(-1, x.shape[-1]).double()  # [n, d]
    flat = flat[finite_rows(flat)]
    n = flat.shape[0]
    if n == 0:
        d = flat.shape[-1]
        zeros, ones = flat.new_zeros(d), flat.new_ones(d)
        return Moments(zeros, ones, torch.eye(d, dtype=flat.dtype, device=flat.device) if full else None, 0)
    ddof = 1 if n > 1 else 0
    mean = flat.mean(0)  # [d]
    centred = flat - mean
    var = (centred * centred).sum(0) / (n - ddof)  # [d]
    second = None
    if full:
        second = centred.T @ centred / (n - ddof) + torch.outer(mean, mean)  # [d, d]
    return Moments(mean, var, second, n)


def means_scale(mu_x: torch.Tensor, mu_y: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The HRF means-only rule :math:`a_i = \\sqrt{|\\mu_{y,i}| / |\\mu_{x,i}|}` (guarded).

    .. math:: a_i = \\left(\\frac{\\max(|\\mu_{y,i}|, \\epsilon)}{\\max(|\\mu_{x,i}|, \\epsilon)}\\right)^{1/2}

    It minimises :math:`\\|A\\mu_x + A^{-T}\\mu_y\\|^2` over positive diagonal
    :math:`A`, i.e. the relative MSE at the pair of means.
    """
    return (mu_y.abs().clamp_min(eps) / mu_x.abs().clamp_min(eps)).sqrt()


def variance_scale(
    mu_x: torch.Tensor, var_x: torch.Tensor, mu_y: torch.Tensor, var_y: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """The variance-adjusted rule of Lemma 3.4 (guarded).

    .. math:: a_i = \\left(\\frac{\\max(\\sigma_{y,i}^2 + \\mu_{y,i}^2, \\epsilon)}
              {\\max(\\sigma_{x,i}^2 + \\mu_{x,i}^2, \\epsilon)}\\right)^{1/4}

    It minimises :math:`\\mathbb{E}\\|Ax\\|^2 + \\mathbb{E}\\|A^{-T}y\\|^2` over positive
    diagonal :math:`A`; with :math:`\\sigma^2 = 0` it is the means-only rule.
    """
    sx = (var_x + mu_x * mu_x).clamp_min(eps)
    sy = (var_y + mu_y * mu_y).clamp_min(eps)
    return (sy / sx).pow(0.25)


def _sym_fn(m: torch.Tensor, fn, eps: float) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """``fn`` applied to the (floored) eigenvalues of the symmetric matrix ``m``."""
    m = 0.5 * (m + m.mT)
    lam, u = torch.linalg.eigh(m)
    return (u * fn(lam.clamp_min(eps)).unsqueeze(-2)) @ u.mT


def geometric_mean_matrix(m_x: torch.Tensor, m_y: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """:math:`B^\\star = M_x^{-1} \\# M_y`, the minimiser of
    :math:`\\mathrm{tr}(M_x B) + \\mathrm{tr}(M_y B^{-1})` over positive-definite :math:`B`.

    .. math:: B^\\star = M_x^{-1/2}\\big(M_x^{1/2} M_y M_x^{1/2}\\big)^{1/2} M_x^{-1/2},
              \\qquad B^\\star M_x B^\\star = M_y .

    Eigenvalues of :math:`M_x` and :math:`M_y` are floored at ``eps`` (so a direction in
    which both are zero gets :math:`B^\\star = 1` there); those of the inner matrix at 0.
    """
    m_x = 0.5 * (m_x + m_x.mT)
    m_y = 0.5 * (m_y + m_y.mT)
    root_x = _sym_fn(m_x, torch.sqrt, eps)  # M_x^{1/2}
    inv_root_x = _sym_fn(m_x, torch.rsqrt, eps)  # M_x^{-1/2}
    m_y = _sym_fn(m_y, lambda t: t, eps)  # floored M_y
    inner = _sym_fn(root_x @ m_y @ root_x, torch.sqrt, 0.0)  # PSD by construction: clip rounding only
    return inv_root_x @ inner @ inv_root_x


def full_matrices(m_x: torch.Tensor, m_y: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The full-matrix rule: the symmetric root :math:`A = (B^\\star)^{1/2}` and :math:`A^{-T} = (B^\\star)^{-1/2}`.

    Returns
    -------
    (A, A_inv_T) : Tensors ``[d, d]``
        :math:`A^\\top A = B^\\star` (up to the eigenvalue floor).
    """
    b = geometric_mean_matrix(m_x, m_y, eps)
    return _sym_fn(b, torch.sqrt, eps), _sym_fn(b, torch.rsqrt, eps)


def surrogate_objective(a_q: torch.Tensor, a_k: torch.Tensor, m_x: torch.Tensor, m_y: torch.Tensor) -> torch.Tensor:
    """The surrogate objective of Lemma 3.4 for the query matrix ``a_q = A`` and key matrix
    ``a_k = A^{-T}`` (both ``[d, d]``):

    .. math:: \\mathbb{E}\\|Ax\\|^2 + \\mathbb{E}\\|A^{-T}y\\|^2
              = \\mathrm{tr}(A M_x A^\\top) + \\mathrm{tr}(A^{-T} M_y A^{-1}).
    """
    return torch.trace(a_q @ m_x @ a_q.mT) + torch.trace(a_k @ m_y @ a_k.mT)
