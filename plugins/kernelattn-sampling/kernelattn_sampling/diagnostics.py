"""Variance diagnostics of self-normalised multiple importance sampling (LARA, App. D).

The delta-method variance of the SN-MIS estimate :math:`\\hat g = A / B` with one
sample per proposal (Eq. 20, with the sum over proposals over **both** terms, the
reading the spec verifies; the paper's display is ambiguous):

.. math::
    \\sum_d \\mathrm{Var}[\\hat g_{d}] \\approx \\sum_{c=1}^{C}\\Big(
    \\mathbb{E}_{q_c}\\Big[\\alpha_c^2 \\frac{p^2}{q_c^2}\\|f - \\mu\\|^2\\Big]
    - \\sum_d \\mathbb{E}_{q_c}\\Big[\\alpha_c \\frac{p}{q_c}(f_d - \\mu_d)\\Big]^2\\Big),

where :math:`\\mu = \\mathbb{E}_p[f]` is exact softmax attention (:math:`\\mu_B = 1`:
:math:`p` is normalised). With :math:`n` samples per proposal,
:math:`n \\cdot \\mathrm{tr\\,Var}[\\hat g] \\to` Eq. 20 (test N4).

Everything is 1-D in :math:`\\omega` (the spec's example: :math:`q = 0.7`,
:math:`k = (-0.4, 1.1, 0.3)`, :math:`v = (2, -1, 0.5)`), Gaussian proposals
:math:`q_c = N(\\mu_c, 1)` and balance-heuristic weights :math:`\\alpha_c = q_c / \\sum_{c'} q_{c'}`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import mpmath
import torch

from .theory import _pi, target_density, target_function


def _alpha(w: Any, means: Sequence[Any], c: int) -> Any:
    dens = [mpmath.npdf(w, m, 1) for m in means]
    return dens[c] / mpmath.fsum(dens)


def eq20_variance(
    q: float, keys: Sequence[float], values: Sequence[float], proposal_means: Sequence[float], *, dps: int = 20
) -> tuple[float, float]:
    """Eq. 20 by mpmath quadrature: ``(trace_variance, printed_form)``.

    ``printed_form`` is the reading with :math:`\\sum_c` over the first term only and the
    second term :math:`(\\sum_c \\mathbb{E}_{q_c}[\\cdot])^2` (which vanishes, since
    :math:`\\sum_c \\mathbb{E}_{q_c}[\\alpha_c p/q_c (f - \\mu)] = \\mathbb{E}_p[f - \\mu] = 0`);
    kept for the negative control of the Monte Carlo check.
    """
    with mpmath.workdps(dps):
        qq = mpmath.mpf(q)
        ks = [mpmath.mpf(k) for k in keys]
        vs = [mpmath.mpf(v) for v in values]
        means = [mpmath.mpf(m) for m in proposal_means]
        mu = mpmath.fsum(p * v for p, v in zip(_pi(qq, ks), vs))
        points = sorted({qq + k for k in ks} | set(means))
        first, second, cross = mpmath.mpf(0), mpmath.mpf(0), mpmath.mpf(0)
        for c, mc in enumerate(means):

            def ratio(w: Any, c: int = c, mc: Any = mc) -> Any:
                return _alpha(w, means, c) * target_density(w, qq, ks) / mpmath.npdf(w, mc, 1)

            def sq(w: Any, mc: Any = mc, ratio: Any = ratio) -> Any:
                return mpmath.npdf(w, mc, 1) * ratio(w) ** 2 * (target_function(w, ks, vs) - mu) ** 2

            def lin(w: Any, mc: Any = mc, ratio: Any = ratio) -> Any:
                return mpmath.npdf(w, mc, 1) * ratio(w) * (target_function(w, ks, vs) - mu)

            e_sq = mpmath.quad(sq, [mpmath.ninf, *points, mpmath.inf])
            e_lin = mpmath.quad(lin, [mpmath.ninf, *points, mpmath.inf])
            first += e_sq
            second += e_lin**2
            cross += e_lin
        return float(first - second), float(first - cross**2)


def snmis_draws(
    q: float,
    keys: Sequence[float],
    values: Sequence[float],
    proposal_means: Sequence[float],
    samples_per_proposal: int,
    replicates: int,
    *,
    seed: int = 0,
) -> torch.Tensor:
    """``[replicates]`` SN-MIS estimates :math:`\\hat g = A/B` (float64), each with
    ``samples_per_proposal`` draws from every proposal, balance-heuristic weights.

    .. math:: A = \\frac1n\\sum_c\\sum_{i=1}^{n} \\alpha_c(\\omega_{ci})
              \\frac{p(\\omega_{ci})}{q_c(\\omega_{ci})} f(\\omega_{ci}),
              \\qquad B = \\text{the same without } f .
    """
    g = torch.Generator().manual_seed(seed)
    k = torch.tensor(list(keys), dtype=torch.float64)  # [M]
    v = torch.tensor(list(values), dtype=torch.float64)  # [M]
    means = torch.tensor(list(proposal_means), dtype=torch.float64)  # [C]
    pi = torch.softmax(q * k, 0)  # [M]
    n = samples_per_proposal
    omega = means[None, :, None] + torch.randn(replicates, means.numel(), n, generator=g, dtype=torch.float64)
    w = omega.unsqueeze(-1)  # [R, C, n, 1]
    log_norm = -0.5 * math.log(2 * math.pi)
    log_p = torch.logsumexp(pi.log() + log_norm - 0.5 * (w - (q + k)) ** 2, -1)  # [R, C, n]
    log_qs = log_norm - 0.5 * (omega.unsqueeze(-1) - means) ** 2  # [R, C, n, C'] every proposal at every draw
    log_mix = torch.logsumexp(log_qs, -1)  # [R, C, n]: log sum_c' q_c'
    # alpha_c p / q_c = p / sum_c' q_c' (balance heuristic)
    weight = (log_p - log_mix).exp()  # [R, C, n]
    f = torch.softmax(w * k - 0.5 * k * k, -1) @ v  # [R, C, n]
    a = (weight * f).sum((-1, -2)) / n
    b = weight.sum((-1, -2)) / n
    return a / b
