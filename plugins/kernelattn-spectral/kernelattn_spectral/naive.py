"""Plain, readable references for the fast paths (used by the tests only).

Each function spells out the math with explicit matrices or loops over components, so
the vectorised implementations can be compared with it on outputs and gradients.
"""

from __future__ import annotations

import math

import torch


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The unnormalised Sylvester–Hadamard matrix :math:`H_d` (``d`` a power of two), ``[d, d]``:
    :math:`H_1 = [1]`, :math:`H_{2n} = [[H_n, H_n], [H_n, -H_n]]`."""
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return h


def permutation_matrix(perm: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """:math:`\\Pi` with :math:`(\\Pi z)_i = z_{\\mathrm{perm}_i}`: ``P[i, perm[i]] = 1``, ``[d, d]``."""
    d = perm.shape[0]
    p = torch.zeros(d, d, dtype=dtype)
    p[torch.arange(d), perm] = 1.0
    return p


def fastfood_matrix(
    s: torch.Tensor, g: torch.Tensor, b: torch.Tensor, perm: torch.Tensor, bandwidth: float
) -> torch.Tensor:
    """FastFood frequencies built from explicit matrices, ``[blocks * d, d]``:

    .. math:: V_b = \\frac{1}{\\sigma \\sqrt d}\\,\\mathrm{diag}(s_b/\\|G_b\\|)\\, H\\,
              \\mathrm{diag}(G_b)\\, \\Pi_b\\, H\\, \\mathrm{diag}(B_b),

    stacked over blocks.
    """
    nb, d = g.shape
    dtype = g.dtype
    h = hadamard_matrix(d, dtype)
    blocks = []
    for i in range(nb):
        scale = torch.diag(s[i] / g[i].norm())
        v = scale @ h @ torch.diag(g[i]) @ permutation_matrix(perm[i], dtype) @ h @ torch.diag(b[i])
        blocks.append(v / (bandwidth * math.sqrt(d)))
    return torch.cat(blocks, dim=0)


def gmm_frequencies(means: torch.Tensor, factors: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """:math:`\\omega_{c,m} = A_c n_m + \\mu_c` by explicit loops, ``[C * M, d]``.

    ``factors`` is ``[C, d, d]`` (full) or ``[C, d]`` (diagonal); ``noise`` is ``[1 or C, M, d]``.
    """
    out = []
    for c in range(means.shape[0]):
        a = factors[c] if factors.dim() == 3 else torch.diag(factors[c])
        n = noise[0] if noise.shape[0] == 1 else noise[c]
        for m in range(n.shape[0]):
            out.append(a @ n[m] + means[c])
    return torch.stack(out)


def rks_kernel_estimate(omega: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """RKS estimate for single points ``x, y [d]``:

    .. math:: \\frac1m \\sum_i [\\cos(\\omega_i^\\top x)\\cos(\\omega_i^\\top y)
              + \\sin(\\omega_i^\\top x)\\sin(\\omega_i^\\top y)]
    """
    total = torch.zeros((), dtype=x.dtype)
    for w in omega:
        total = total + torch.cos(w @ x) * torch.cos(w @ y) + torch.sin(w @ x) * torch.sin(w @ y)
    return total / omega.shape[0]


def prf_kernel_estimate(omega: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """PRF estimate for single points ``x, y [d]``:

    .. math:: \\frac1m \\sum_i e^{\\omega_i^\\top x - \\|x\\|^2/2} e^{\\omega_i^\\top y - \\|y\\|^2/2}
    """
    total = torch.zeros((), dtype=x.dtype)
    for w in omega:
        total = total + torch.exp(w @ x - x @ x / 2) * torch.exp(w @ y - y @ y / 2)
    return total / omega.shape[0]
