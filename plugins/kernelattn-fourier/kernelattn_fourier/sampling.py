"""Frequency samplers: i.i.d. from a spectral density, or orthogonal (Haar) blocks.

Orthogonal random features (Yu et al., 2016) replace the i.i.d. directions of
:math:`\\omega_1, \\dots, \\omega_m` by the rows of independent Haar-distributed
orthogonal matrices (blocks of ``d`` rows) and give each row an independent length
drawn from the radial law of the spectral density :math:`p`. For an *isotropic*
:math:`p` each row is then marginally distributed as :math:`p`, so the kernel
estimate stays unbiased; rows within a block are exactly orthogonal.

**Haar correctness.** ``Q, R = qr(G)`` of a Gaussian matrix ``G`` is not Haar
distributed: LAPACK's Householder QR fixes the signs of ``diag(R)`` by a convention
(for example :math:`Q_{11} < 0` always for ``d = 2``). Multiplying column ``j`` of ``Q``
by :math:`\\operatorname{sign}(R_{jj})` makes ``Q R`` the unique decomposition with a
positive diagonal, and then ``Q`` is Haar (Mezzadri, 2007).
"""

from __future__ import annotations

import torch

from .kernels import Draw, SpectralKernel


def haar_orthogonal(gaussian: torch.Tensor, *, sign_correction: bool = True) -> torch.Tensor:
    """Haar-distributed orthogonal matrices from Gaussian ones.

    Parameters
    ----------
    gaussian : Tensor ``[..., d, d]``
        i.i.d. standard normal entries.
    sign_correction : bool
        Apply the :math:`\\operatorname{sign}(\\operatorname{diag} R)` correction (leave
        ``True``; ``False`` exists only for the negative-control test).

    Returns
    -------
    Tensor ``[..., d, d]``, orthogonal.
    """
    q, r = torch.linalg.qr(gaussian)  # [..., d, d] each
    if sign_correction:
        sign = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))  # [..., d]
        sign = torch.where(sign == 0, torch.ones_like(sign), sign)
        q = q * sign.unsqueeze(-2)  # scales column j by sign(R_jj)
    return q


def iid_frequencies(kernel: SpectralKernel, num: int, dim: int, draw: Draw) -> torch.Tensor:
    """``num`` i.i.d. frequencies from the kernel's spectral density, ``[num, dim]``."""
    return kernel.sample_frequencies(num, dim, draw)


def orthogonal_frequencies(kernel: SpectralKernel, num: int, dim: int, draw: Draw) -> torch.Tensor:
    """Block-orthogonal frequencies with radial lengths from the spectral density.

    .. math:: \\omega_i = \\rho_i\\, u_i, \\qquad u_i = \\text{row } i \\text{ of }
              [Q_1; Q_2; \\dots], \\quad Q_b \\text{ Haar}, \\qquad
              \\rho_i = \\|\\tilde\\omega_i\\|, \\ \\tilde\\omega_i \\sim p \\text{ i.i.d.}

    Returns ``[num, dim]``; the last block is truncated when ``dim`` does not divide
    ``num``. Valid for isotropic kernels only (the caller checks).
    """
    blocks = -(-num // dim)
    q = haar_orthogonal(draw("normal", (blocks, dim, dim)))  # [blocks, d, d]
    directions = q.reshape(blocks * dim, dim)[:num]  # [num, d], unit rows
    lengths = kernel.sample_frequencies(num, dim, draw).norm(dim=-1, keepdim=True)  # [num, 1]
    return directions * lengths
