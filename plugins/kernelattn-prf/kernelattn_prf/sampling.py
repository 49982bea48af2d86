"""Random directions for positive random features: iid Gaussian and block-orthogonal rows.

Only *deterministic* transforms of draws live here; the draws themselves are made by
:meth:`kernelattn_core.FeatureMap._draw` inside ``_redraw`` (the one place where
randomness happens).
"""

from __future__ import annotations

import torch


def num_blocks(num_features: int, head_dim: int) -> int:
    """Number of ``d x d`` orthogonal blocks needed for ``num_features`` rows: :math:`\\lceil m / d \\rceil`."""
    return -(-num_features // head_dim)


def haar_orthogonal(gaussian: torch.Tensor) -> torch.Tensor:
    """Haar-distributed orthogonal matrices from Gaussian matrices, batched.

    For :math:`G = QR` (QR decomposition of a matrix with iid standard normal entries),
    :math:`Q\\,\\mathrm{diag}(\\mathrm{sign}(R_{ii}))` is Haar-distributed on the
    orthogonal group. Without the sign correction :math:`Q` is *not* Haar (LAPACK's
    convention biases the signs of its columns; PITFALLS.md item 9).

    Parameters
    ----------
    gaussian : Tensor ``[nb, d, d]``
        iid standard normal entries.

    Returns
    -------
    Tensor ``[nb, d, d]``
        Orthogonal matrices (rows and columns orthonormal), computed in float64 and
        returned in the dtype of ``gaussian``.
    """
    q, r = torch.linalg.qr(gaussian.double())  # [nb, d, d] each
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))  # [nb, d]
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return (q * signs.unsqueeze(-2)).to(gaussian.dtype)  # scale column j by sign(R_jj)


def block_orthogonal_rows(
    gaussian: torch.Tensor,
    num_features: int,
    norms: torch.Tensor | float,
) -> torch.Tensor:
    """Block-orthogonal random rows :math:`\\omega_1..\\omega_m`.

    The rows of each ``d x d`` Haar block are orthonormal directions; they are scaled
    by ``norms`` (chi-distributed norms make every row marginally :math:`N(0, I_d)`,
    so the estimator stays unbiased; the fixed norm :math:`\\sqrt d` does not) and
    the blocks are stacked and truncated to ``num_features`` rows.

    Parameters
    ----------
    gaussian : Tensor ``[nb, d, d]``
        iid standard normal entries (``nb = ceil(m / d)``).
    num_features : int
        ``m``.
    norms : Tensor ``[nb, d]`` or float
        Row norms.

    Returns
    -------
    Tensor ``[m, d]``
    """
    nb, d, _ = gaussian.shape
    q = haar_orthogonal(gaussian)  # [nb, d, d]
    if isinstance(norms, torch.Tensor):
        rows = q * norms.unsqueeze(-1)  # row i of block b scaled by norms[b, i]
    else:
        rows = q * norms
    return rows.reshape(nb * d, d)[:num_features]


def chi_norms(gaussian: torch.Tensor) -> torch.Tensor:
    """Chi-distributed norms (``d`` degrees of freedom): the Euclidean norms of the
    last axis of ``gaussian [nb, d, d]``, giving ``[nb, d]``."""
    return gaussian.norm(dim=-1)
