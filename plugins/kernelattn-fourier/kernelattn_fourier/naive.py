"""Plain references, written to be read: one frequency at a time, one query at a time.

The tests compare the vectorised maps and the normaliser against these on outputs
and gradients.
"""

from __future__ import annotations

import math

import torch


def rff_features_naive(x: torch.Tensor, omega: torch.Tensor, phase: torch.Tensor | None = None) -> torch.Tensor:
    """Random Fourier features of ``x [n, d]`` from ``omega [m, d]``, one frequency at a time.

    ``phase=None``: :math:`[\\cos\\omega_j^\\top x]_j \\oplus [\\sin\\omega_j^\\top x]_j / \\sqrt m`;
    otherwise :math:`\\sqrt{2/m}\\,[\\cos(\\omega_j^\\top x + b_j)]_j`.
    """
    m = omega.shape[0]
    cos_part, sin_part = [], []
    for j in range(m):
        u = (x * omega[j]).sum(-1)  # [n]
        if phase is None:
            cos_part.append(torch.cos(u) / math.sqrt(m))
            sin_part.append(torch.sin(u) / math.sqrt(m))
        else:
            cos_part.append(math.sqrt(2.0 / m) * torch.cos(u + phase[j]))
    return torch.stack(cos_part + sin_part, dim=-1)


def trig_softmax_features_naive(x: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """:math:`e^{\\|x\\|^2/2}\\,[\\sin\\omega_j^\\top x]_j \\oplus [\\cos\\omega_j^\\top x]_j / \\sqrt m`."""
    m = omega.shape[0]
    scale = torch.exp(0.5 * (x * x).sum(-1)) / math.sqrt(m)  # [n]
    sins = [scale * torch.sin((x * omega[j]).sum(-1)) for j in range(m)]
    coss = [scale * torch.cos((x * omega[j]).sum(-1)) for j in range(m)]
    return torch.stack(sins + coss, dim=-1)


def rfa_features_naive(x: torch.Tensor, omega: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
    """RFA features of ``x [n, d]`` with one scale :math:`\\sigma`: trig features of
    :math:`x/\\|x\\|` with frequencies :math:`\\omega/\\sigma`."""
    m = omega.shape[0]
    rows = []
    for i in range(x.shape[0]):
        xh = x[i] / x[i].norm()
        u = torch.stack([(xh * omega[j]).sum() / sigma for j in range(m)])
        rows.append(torch.cat([u.sin(), u.cos()]) / math.sqrt(m))
    return torch.stack(rows)


def signed_row_naive(num: torch.Tensor, den: torch.Tensor, eps: float) -> torch.Tensor:
    """The ridge division of :class:`~kernelattn_fourier.normalizers.SignedRowNormalizer`,
    one query at a time, without the overflow rescaling:
    :math:`\\mathrm{den}\\,\\mathrm{num} / (\\mathrm{den}^2 + \\varepsilon^2 \\|\\mathrm{num}\\|^2 / d_v)`."""
    flat_num = num.reshape(-1, num.shape[-1])
    flat_den = den.reshape(-1)
    out = []
    for n, d in zip(flat_num, flat_den):
        denom = d * d + eps**2 * (n * n).mean()
        out.append(n * d / denom if bool(denom > 0) else torch.zeros_like(n))
    return torch.stack(out).reshape(num.shape)
