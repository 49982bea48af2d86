"""Plain, readable references for the fast paths of this plugin (loops allowed).

Tests compare :mod:`kernelattn_prf.feature_maps` and :mod:`kernelattn_prf.sampling`
against these on outputs and gradients.
"""

from __future__ import annotations

import math

import torch


def features_naive(x: torch.Tensor, omega: torch.Tensor, a: torch.Tensor, two_sided: bool) -> torch.Tensor:
    """Features (not log-features) of ``x [n, d]`` with the matrix ``a [d, d]`` applied first,
    one random vector at a time:

    .. math:: \\phi(x)_i = \\frac{1}{\\sqrt{D}} \\exp\\big(\\pm\\omega_i^\\top (a x) - \\|a x\\|^2/2\\big).

    Returns ``[n, D]`` with ``D = m`` or ``2m`` (the ``+`` block, then the ``-`` block).
    """
    m = omega.shape[0]
    big_d = 2 * m if two_sided else m
    cols = []
    for sign in (1.0, -1.0) if two_sided else (1.0,):
        for i in range(m):
            u = x @ a.T  # [n, d]
            cols.append(torch.exp(sign * (u @ omega[i]) - 0.5 * (u * u).sum(-1)) / math.sqrt(big_d))
    return torch.stack(cols, dim=-1)


def kernel_estimate_naive(
    x: torch.Tensor, y: torch.Tensor, omega: torch.Tensor, a_q: torch.Tensor, a_k: torch.Tensor, two_sided: bool
) -> torch.Tensor:
    """The paired estimate :math:`\\widehat{\\mathrm{SM}}(x_j, y_j)` for ``x, y [n, d]`` straight
    from the estimator's formula:

    .. math:: \\frac1m\\sum_i e^{\\omega_i^\\top z - (\\|a_q x\\|^2 + \\|a_k y\\|^2)/2}
              \\quad\\text{or}\\quad
              \\frac1m\\sum_i \\cosh(\\omega_i^\\top z)\\, e^{-(\\|a_q x\\|^2 + \\|a_k y\\|^2)/2},

    with :math:`z = a_q x + a_k y`. Returns ``[n]``.
    """
    xp, yp = x @ a_q.T, y @ a_k.T
    z = xp + yp
    norm = 0.5 * ((xp * xp).sum(-1) + (yp * yp).sum(-1))
    total = torch.zeros(x.shape[0], dtype=x.dtype)
    for i in range(omega.shape[0]):
        s = z @ omega[i]
        total = total + (torch.cosh(s) if two_sided else torch.exp(s)) * torch.exp(-norm)
    return total / omega.shape[0]


def gram_schmidt_orthogonal(gaussian: torch.Tensor) -> torch.Tensor:
    """Haar orthogonal matrices by classical Gram-Schmidt on the columns of each
    ``[d, d]`` Gaussian block of ``gaussian [nb, d, d]`` (float64).

    Gram-Schmidt yields the QR factorisation whose :math:`R` has a positive
    diagonal, which is the sign-corrected (Haar) :math:`Q`.
    """
    out = torch.empty_like(gaussian, dtype=torch.float64)
    for b in range(gaussian.shape[0]):
        g = gaussian[b].double()
        for j in range(g.shape[1]):
            v = g[:, j].clone()
            for i in range(j):
                v = v - (out[b, :, i] @ g[:, j]) * out[b, :, i]
            out[b, :, j] = v / v.norm()
    return out
