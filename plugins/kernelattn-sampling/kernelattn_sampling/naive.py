"""Plain, readable references (explicit exponentials, loops over samples), float64.

Beside the log-space fast paths of :mod:`.functional` and :mod:`.lara`; the tests
compare the two on outputs and gradients.
"""

from __future__ import annotations

import math

import torch


def xi(x: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """:math:`\\xi(x, \\omega) = \\exp(\\omega^\\top x - \\|x\\|^2/2)` for ``x [..., d]``,
    ``omega [..., d]`` (broadcast)."""
    return torch.exp((x * omega).sum(-1) - 0.5 * (x * x).sum(-1))


def gaussian_density(omega: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """:math:`N(\\omega; \\mu, I)`."""
    d = omega.shape[-1]
    return torch.exp(-0.5 * ((omega - mean) ** 2).sum(-1)) / (2 * math.pi) ** (d / 2)


def ra_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """Algorithm 1 in plain form for one head: ``q [N, d]``, ``k [M, d]``, ``v [M, dv]``,
    ``omega [N, S, d]``:
    :math:`y_n = \\frac1S\\sum_s \\frac{\\xi(q_n,\\omega_{ns})\\sum_m \\xi(k_m,\\omega_{ns}) v_m}
    {\\xi(q_n,\\omega_{ns})\\sum_m \\xi(k_m,\\omega_{ns})}`."""
    n, s, _ = omega.shape
    rows = []
    for i in range(n):
        acc = torch.zeros(v.shape[-1], dtype=v.dtype)
        for j in range(s):
            w = omega[i, j]
            xk = xi(k, w)  # [M]
            num = xi(q[i], w) * (xk[:, None] * v).sum(0)
            den = xi(q[i], w) * xk.sum()
            acc = acc + num / den
        rows.append(acc / s)
    return torch.stack(rows)


def rfa_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """Eq. 2 in plain form for one head, ``omega [S, d]``."""
    num = torch.zeros(q.shape[0], v.shape[-1], dtype=v.dtype)
    den = torch.zeros(q.shape[0], dtype=v.dtype)
    for w in omega:
        xq, xk = xi(q, w), xi(k, w)  # [N], [M]
        num = num + xq[:, None] * (xk[:, None] * v).sum(0)
        den = den + xq * xk.sum()
    return num / den[:, None]


def lara_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    omega: torch.Tensor,
    owner: torch.Tensor,
    proposal_density: torch.Tensor,
    alpha: torch.Tensor,
) -> torch.Tensor:
    """Eq. 28 with Algorithm 3 as corrected, for one head:
    :math:`\\alpha'_{nc} = \\alpha_{nc}(\\omega_c) N(\\omega_c; 0, I) / q_c(\\omega_c)`,
    :math:`y_n = \\sum_s \\alpha'_{ns}\\xi(q_n,\\omega_s) N_s / \\sum_s \\alpha'_{ns}\\xi(q_n,\\omega_s) D_s`.

    ``omega [S, d]``, ``proposal_density [S]`` (:math:`q_{c(s)}(\\omega_s)`), ``alpha [N, S]``.
    """
    zero = torch.zeros_like(omega[0])
    num = torch.zeros(q.shape[0], v.shape[-1], dtype=v.dtype)
    den = torch.zeros(q.shape[0], dtype=v.dtype)
    for s, w in enumerate(omega):
        a = alpha[:, s] * gaussian_density(w, zero) / proposal_density[s]  # [N]
        xq, xk = xi(q, w), xi(k, w)
        num = num + (a * xq)[:, None] * (xk[:, None] * v).sum(0)
        den = den + a * xq * xk.sum()
    return num / den[:, None]


def lara_eq10_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    omega: torch.Tensor,
    proposal_density: torch.Tensor,
    alpha: torch.Tensor,
) -> torch.Tensor:
    """Eq. 10: SN-MIS with the unnormalised target
    :math:`\\tilde p_n(\\omega) = N(\\omega;0,I)\\,\\xi(q_n,\\omega)\\sum_m\\xi(k_m,\\omega)`."""
    zero = torch.zeros_like(omega[0])
    num = torch.zeros(q.shape[0], v.shape[-1], dtype=v.dtype)
    den = torch.zeros(q.shape[0], dtype=v.dtype)
    for s, w in enumerate(omega):
        xk = xi(k, w)
        f = (xk[:, None] * v).sum(0) / xk.sum()  # f(omega) [dv]
        p_tilde = gaussian_density(w, zero) * xi(q, w) * xk.sum()  # [N]
        ratio = alpha[:, s] * p_tilde / proposal_density[s]
        num = num + ratio[:, None] * f
        den = den + ratio
    return num / den[:, None]


def segment_means_naive(x: torch.Tensor, c: int) -> torch.Tensor:
    """Segment means of ``x [N, d]`` with the released code's split, by a loop."""
    n = x.shape[0]
    if n <= c:
        return x.clone()
    base = n // c
    n_f = (base + 1) * c - n
    out, start = [], 0
    for i in range(c):
        length = base if i < n_f else base + 1
        out.append(x[start : start + length].mean(0))
        start += length
    assert start == n
    return torch.stack(out)


def mixture_density(omega: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The exact target :math:`p_n(\\omega) = \\sum_m \\pi_{nm} N(\\omega; q_n + k_m, I)`
    for one query ``q [d]``, ``omega [..., d]``."""
    pi = torch.softmax(k @ q, 0)  # [M]
    return sum(pi[m] * gaussian_density(omega, q + k[m]) for m in range(k.shape[0]))
