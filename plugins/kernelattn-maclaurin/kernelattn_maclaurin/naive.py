"""Plain references, written to be read, not to be fast.

The fast paths (degree-grouped features, linear-time RMFA, vectorised ppSBN) are
tested against these on outputs and gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .feature_maps import RandomMaclaurinFeatures


def rmf_features_naive(fm: RandomMaclaurinFeatures, x: torch.Tensor) -> torch.Tensor:
    """Random Maclaurin features of ``x [..., d]`` one feature at a time (``[..., D]``).

    .. math:: \\Phi_i(x) = w_i \\prod_{j=1}^{N_i} \\langle \\omega_{ij}, x\\rangle

    with the weights :math:`w_i` and projections :math:`\\omega_{ij}` of ``fm``.
    """
    weights = fm.weights.to(x.dtype)
    columns = []
    if fm.mode == "released":
        columns.append(torch.ones(x.shape[:-1], dtype=x.dtype) * weights[0])  # the constant sqrt(a_0)
    offset = 1 if fm.mode == "released" else 0
    for i, omegas in enumerate(fm.projections()):  # omegas: [N_i, d]
        value = torch.ones(x.shape[:-1], dtype=x.dtype)
        for omega in omegas.to(x.dtype):  # one factor <omega_ij, x> at a time
            value = value * (x * omega).sum(-1)
        columns.append(value * weights[offset + i])
    return torch.stack(columns, dim=-1)


def rmfa_naive(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMFA in its explicit quadratic form.

    .. math:: \\hat A = (\\Phi_Q \\Phi_K^\\top) \\odot M', \\qquad
              \\mathrm{out} = \\mathrm{diag}(\\hat A \\mathbf{1})^{-1} \\hat A V

    A query with no allowed key gets zeros.

    Parameters
    ----------
    phi_q : Tensor ``[B, H, N, D]``
    phi_k : Tensor ``[B, H, M, D]``
    v : Tensor ``[B, H, M, dv]``
    """
    a = phi_q @ phi_k.transpose(-1, -2)  # [B, H, N, M]
    n, m = a.shape[-2:]
    keep = torch.ones(n, m, dtype=torch.bool)
    if causal:
        keep = keep.tril()
    keep = keep[None, None]  # [1, 1, N, M]
    if key_padding_mask is not None:
        keep = keep & ~key_padding_mask[:, None, None, :]
    a = a * keep
    den = a.sum(-1, keepdim=True)
    empty = ~keep.any(-1, keepdim=True)  # a query with no allowed key gets zeros
    return (a @ v) / torch.where(empty, torch.ones_like(den), den)


def pre_sbn_naive(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Pre-scaling of ppSBN with per-token statistics, row by row.

    For each row :math:`x` of ``x [..., N, d]``:
    :math:`x' = (x - \\bar x)/\\sqrt{\\sigma^2 + \\varepsilon}`, then :math:`x' / \\|x'\\|_2`
    (biased variance over the ``d`` entries of the row).
    """
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    for r in range(rows.shape[0]):
        row = rows[r]
        mean = sum(row.tolist()) / row.numel()
        var = sum((val - mean) ** 2 for val in row.tolist()) / row.numel()
        centred = (row - mean) / math.sqrt(var + eps)
        out[r] = centred / centred.norm()
    return out.reshape(x.shape)


def kernelized_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: Callable[[torch.Tensor], torch.Tensor],
    *,
    causal: bool = False,
) -> torch.Tensor:
    """Exact kernelized attention
    :math:`\\sum_j f(\\langle q_i, k_j\\rangle) v_j / \\sum_j f(\\langle q_i, k_j\\rangle)`
    on already scaled ``q [..., N, d]``, ``k [..., M, d]``, ``v [..., M, dv]``."""
    a = f(q @ k.transpose(-1, -2))  # [..., N, M]
    if causal:
        a = a * torch.ones(a.shape[-2:], dtype=torch.bool).tril()
    return (a @ v) / a.sum(-1, keepdim=True)
