"""Exact variance of the random Maclaurin estimate, and its finiteness condition.

For one random feature with degree law :math:`P` on the support :math:`S` and
projections :math:`\\omega` with :math:`\\mathbb{E}[\\omega\\omega^\\top] = I`,

.. math::
    \\phi(x)\\phi(y) = \\frac{a_N}{P[N]} \\prod_{j=1}^{N} \\langle\\omega_j, x\\rangle\\langle\\omega_j, y\\rangle,
    \\qquad
    \\mathbb{E}[(\\phi(x)\\phi(y))^2] = \\sum_{n \\in S} \\frac{a_n^2}{P[n]}\\, m(x, y)^n,

with the fourth moment of one projection

.. math::
    m_R(x, y) = \\|x\\|^2\\|y\\|^2 + 2\\langle x, y\\rangle^2 - 2 \\sum_k x_k^2 y_k^2
    \\ (\\text{Rademacher}), \\qquad
    m_G(x, y) = \\|x\\|^2\\|y\\|^2 + 2\\langle x, y\\rangle^2\\ (\\text{Gaussian}).

The estimate :math:`\\Phi(x)^\\top\\Phi(y)` averages :math:`R` such features (plus a
deterministic :math:`a_0` in released mode), so

.. math::
    \\mathrm{Var}[\\Phi(x)^\\top\\Phi(y)] = \\frac{1}{R}\\Big(\\sum_{n \\in S}\\frac{a_n^2}{P[n]} m^n
    - \\Big(\\sum_{n \\in S} a_n \\langle x, y\\rangle^n\\Big)^2\\Big).

With the unbounded geometric law :math:`a_n^2 / P[n] = a_n^2 p^{n+1}/(p-1)`, and the
series has radius :math:`R_f^2/p` in :math:`m` (:math:`R_f` the kernel's radius of
convergence): **the variance is infinite when** :math:`p\\, m(x, y) \\ge R_f^2`. For
``inv``, ``logi``, ``sqrt`` at :math:`p = 2` that is :math:`m \\ge 1/2`; for entire
kernels (``exp``, ``trigh``, ``polynomial``) it never happens. A degree cap makes
every variance finite. (At :math:`p\\,m = R_f^2` exactly the series still converges
for ``logi`` and ``sqrt``; this module reports ``inf`` there, conservatively.)
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from kernelattn_core.toolkit import InputError

from .sampling import DegreeDistribution


class InfiniteVarianceWarning(UserWarning):
    """The random Maclaurin estimate has infinite variance on some input pair."""


_MAX_TERMS = 4000


def fourth_moment(x: torch.Tensor, y: torch.Tensor, projection: str = "rademacher") -> torch.Tensor:
    """:math:`m(x, y) = \\mathbb{E}[\\langle\\omega,x\\rangle^2\\langle\\omega,y\\rangle^2]`
    for paired rows ``x, y [..., d]``, giving ``[...]``."""
    t = (x * y).sum(-1)
    m = (x * x).sum(-1) * (y * y).sum(-1) + 2 * t * t
    if projection == "rademacher":
        m = m - 2 * (x * x * y * y).sum(-1)
    elif projection != "gaussian":
        raise InputError(f"projection: expected 'rademacher' or 'gaussian', got {projection!r}")
    return m


def _support_terms(kernel: Any, dist: DegreeDistribution, z_max: float) -> int:
    """Largest degree to sum for an unbounded law so the tail is below double precision."""
    if dist.stop is not None:
        return dist.stop
    if math.isinf(kernel.radius):
        return min(_MAX_TERMS, 200 + int(8 * math.sqrt(max(z_max, 0.0))))
    r = z_max / kernel.radius**2
    if r <= 0:
        return 8
    return min(_MAX_TERMS, math.ceil(math.log(1e-20) / math.log(r)) + 64)


def rmf_variance(
    x: torch.Tensor,
    y: torch.Tensor,
    kernel: Any,
    *,
    p: float = 2.0,
    projection: str = "rademacher",
    mode: str = "paper",
    max_degree: int | None = None,
    num_features: int = 1,
) -> torch.Tensor:
    """Exact :math:`\\mathrm{Var}[\\Phi(x)^\\top\\Phi(y)]` of ``rmf`` for paired rows.

    Parameters
    ----------
    x, y : Tensor ``[..., d]``
        Paired inputs (in the coordinates the map sees: already scaled).
    kernel : MaclaurinKernel
        The target kernel (an instance of this plugin's kernels).
    p, projection, mode, max_degree, num_features
        As for :class:`~kernelattn_maclaurin.feature_maps.RandomMaclaurinFeatures`.

    Returns
    -------
    Tensor ``[...]`` (float64), ``inf`` where the variance is infinite.
    """
    from .feature_maps import degree_distribution, random_feature_count

    dist = degree_distribution(p, mode, max_degree)
    r = random_feature_count(mode, num_features)
    x, y = x.to(torch.float64), y.to(torch.float64)
    m = fourth_moment(x, y, projection)  # [...]
    t = (x * y).sum(-1)
    zp = dist.p * m
    infinite = torch.zeros_like(m, dtype=torch.bool)
    if dist.stop is None and math.isfinite(kernel.radius):
        infinite = zp >= kernel.radius**2
    z_max = float(zp.masked_fill(infinite, 0.0).max()) if m.numel() else 0.0
    n_max = _support_terms(kernel, dist, z_max)
    n = torch.arange(dist.start, n_max + 1, dtype=torch.float64)  # [T]
    log_a = kernel.log_coefficients(n_max)[dist.start :]  # [T]
    log_m = m.clamp_min(0).log().unsqueeze(-1)  # [..., 1]
    n_log_m = torch.where(n == 0, torch.zeros_like(n), n * log_m)  # [..., T]; m^0 = 1 even at m = 0
    log_terms = 2 * log_a - dist.log_pmf(n) + n_log_m
    second = torch.logsumexp(log_terms, dim=-1).exp()
    if dist.stop is None:
        mean = kernel.f(t)
    else:
        a = log_a.exp()
        powers = torch.where(n == 0, torch.ones_like(t).unsqueeze(-1), t.unsqueeze(-1) ** n)
        mean = (a * powers).sum(-1)  # the truncated series the capped map estimates
    var = (second - mean**2) / r
    return var.masked_fill(infinite, math.inf)


def max_pair_values(
    q: torch.Tensor, k: torch.Tensor, projection: str, chunk: int = 1024, *, causal: bool = False
) -> tuple[float, float]:
    """:math:`\\max |\\langle q_i, k_j\\rangle|` and :math:`\\max m(q_i, k_j)` over all pairs
    of ``q [..., N, d]`` and ``k [..., M, d]`` (matching leading dimensions), by chunks of queries.

    With ``causal=True`` only the pairs :math:`j \\le i` count: a later key, out of the
    domain or not finite, never makes an earlier query's check fail (the pairs above the
    diagonal are *replaced* by 0, never multiplied)."""
    k2 = k * k
    kn = k2.sum(-1)  # [..., M]
    t_max, m_max = 0.0, 0.0
    for start in range(0, q.shape[-2], chunk):
        qc = q[..., start : start + chunk, :]
        t = qc @ k.transpose(-1, -2)  # [..., C, M]
        m = (qc * qc).sum(-1, keepdim=True) * kn.unsqueeze(-2) + 2 * t * t
        if projection == "rademacher":
            m = m - 2 * ((qc * qc) @ k2.transpose(-1, -2))
        if causal:
            rows = torch.arange(start, start + qc.shape[-2], device=q.device)[:, None]  # [C, 1]
            later = torch.arange(k.shape[-2], device=q.device)[None, :] > rows  # [C, M]
            t, m = t.masked_fill(later, 0.0), m.masked_fill(later, 0.0)
        if t.numel():
            t_max = max(t_max, float(t.abs().max()))
            m_max = max(m_max, float(m.max()))
    return t_max, m_max


def warn_infinite_variance(kernel_name: str, p: float, m_max: float, radius: float, stacklevel: int = 3) -> None:
    warnings.warn(
        f"rmf: the random Maclaurin estimate of kernel {kernel_name!r} has infinite variance on these inputs: "
        f"p * max m(q, k) = {p:g} * {m_max:.4g} = {p * m_max:.4g} >= R^2 = {radius**2:g} (R the radius of "
        "convergence, m = E[<w,q>^2 <w,k>^2]); normalise q and k (ppSBN), lower p, or cap the degree "
        "(max_degree=... or mode='released')",
        InfiniteVarianceWarning,
        stacklevel=stacklevel,
    )
