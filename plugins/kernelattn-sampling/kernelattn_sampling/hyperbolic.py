"""Randomized attention with the hyperbolic map (LARA, Corollary C.1).

With the Performer hyperbolic map :math:`\\xi(x, \\omega) = \\tfrac{1}{\\sqrt2}
e^{-\\|x\\|^2/2}[e^{\\omega^\\top x}, e^{-\\omega^\\top x}]` (two features, :math:`l = 2`),
softmax attention is :math:`\\mathbb{E}_{p_n}[f_n]` with

.. math::
    p_n(\\omega) = \\tfrac12 \\sum_m \\pi_{nm}\\big(N(\\omega; q_n + k_m, I)
                  + N(\\omega; -q_n - k_m, I)\\big),
    \\qquad
    f_n(\\omega) = \\frac{\\sum_m \\xi(q_n, \\omega)^\\top\\xi(k_m, \\omega)\\, v_m}
                        {\\sum_m \\xi(q_n, \\omega)^\\top\\xi(k_m, \\omega)},

(the printed proof omits the :math:`\\sum_m`), because
:math:`p_n(\\omega) = N(\\omega; 0, I)\\sum_m \\xi(q_n,\\omega)^\\top\\xi(k_m,\\omega) / \\sum_m e^{q_n^\\top k_m}`.
Unlike the :math:`l = 1` map, :math:`\\xi(q_n, \\cdot)` does not cancel in :math:`f_n`.

* :func:`hyperbolic_ra` samples :math:`p_n` exactly (component :math:`m \\sim \\pi_n`, a
  fair sign, Gaussian noise) and averages :math:`f_n`: an unbiased estimate of
  softmax attention (Monte Carlo test).
* :func:`hp_hyperbolic_attention` and :func:`hp_hyperbolic_density` are the 1-D
  identities at high precision (spec P4).
"""

from __future__ import annotations

import math
from typing import Any

import mpmath
import torch

from .theory import _example, _integrate, _pi


def _f_torch(omega: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """:math:`f_n(\\omega)` for ``omega [B, H, N, S, d]``, ``q [B, H, N, d]``, ``k [B, H, M, d]``,
    ``v [B, H, M, dv]``: ``[B, H, N, S, dv]``, in log space (cosh form)."""
    # xi(q).xi(k) = e^{-|q|^2/2 - |k|^2/2} cosh(omega.(q + k)); the q factor cancels in the ratio
    s = q.unsqueeze(-2).unsqueeze(-2) + k.unsqueeze(-4).unsqueeze(-4)  # [B, H, N, 1, M, d]
    a = (omega.unsqueeze(-2) * s).sum(-1)  # [B, H, N, S, M]
    log_cosh = a.abs() + torch.log1p(torch.exp(-2 * a.abs())) - math.log(2.0)
    logits = log_cosh - 0.5 * (k * k).sum(-1)[:, :, None, None, :]
    return torch.softmax(logits, -1) @ v.unsqueeze(2)  # [B, H, N, S, dv]


def hyperbolic_ra(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    *,
    noise: bool = True,
) -> torch.Tensor:
    r"""Hyperbolic randomized attention: ``q [B, H, N, d]`` (already scaled), ``k [B, H, M, d]``,
    ``v [B, H, M, dv]`` to ``[B, H, N, dv]``, unbiased for softmax attention.

    :math:`f_n` is even in :math:`\omega` (a cosh), so the fair sign changes nothing in
    distribution; it is kept to sample :math:`p_n` as stated. ``noise=False`` evaluates
    :math:`f_n` at the component means (biased, like RA without its noise)."""
    probs = torch.softmax(q @ k.transpose(-1, -2), -1)  # [B, H, N, M]
    b, h, n, m = probs.shape
    idx = torch.multinomial(probs.reshape(-1, m), num_samples, replacement=True, generator=generator)
    idx = idx.reshape(b, h, n, num_samples)  # [B, H, N, S]
    k_pick = torch.gather(
        k.unsqueeze(2).expand(b, h, n, m, k.shape[-1]), 3, idx.unsqueeze(-1).expand(-1, -1, -1, -1, k.shape[-1])
    )
    sign = torch.randint(0, 2, (b, h, n, num_samples, 1), generator=generator, dtype=q.dtype) * 2 - 1
    eps = torch.randn(k_pick.shape, generator=generator, dtype=q.dtype) if noise else torch.zeros_like(k_pick)
    omega = sign * (q.unsqueeze(-2) + k_pick) + eps  # [B, H, N, S, d]
    return _f_torch(omega, q, k, v).mean(-2)


# --------------------------------------------------------------------------- mpmath (1-D)
def hyperbolic_target_density(w: Any, q: Any, ks: list[Any]) -> Any:
    """:math:`p(\\omega) = \\tfrac12\\sum_m \\pi_m (N(\\omega; q + k_m) + N(\\omega; -q - k_m))` (1-D)."""
    return mpmath.fsum(p * (mpmath.npdf(w, q + k, 1) + mpmath.npdf(w, -q - k, 1)) / 2 for p, k in zip(_pi(q, ks), ks))


def hyperbolic_target_function(w: Any, q: Any, ks: list[Any], vs: list[Any]) -> Any:
    """:math:`f(\\omega)` with the hyperbolic map (1-D), straight from the definition."""

    def xi(x: Any) -> tuple[Any, Any]:
        c = mpmath.exp(-x * x / 2) / mpmath.sqrt(2)
        return c * mpmath.exp(w * x), c * mpmath.exp(-w * x)

    xq = xi(q)
    weights = [xq[0] * xk[0] + xq[1] * xk[1] for xk in (xi(k) for k in ks)]
    return mpmath.fsum(a * v for a, v in zip(weights, vs)) / mpmath.fsum(weights)


def hp_hyperbolic_attention(dps: int) -> tuple[Any, Any, str]:
    """HP001: :math:`\\int p f\\,d\\omega` equals softmax attention (1-D, Corollary C.1)."""
    with mpmath.workdps(dps + 10):
        q, ks, vs = _example()
        pts = [-q - k for k in ks]
        value = _integrate(
            lambda w: hyperbolic_target_density(w, q, ks) * hyperbolic_target_function(w, q, ks, vs), q, ks + pts
        )
        target = mpmath.fsum(p * v for p, v in zip(_pi(q, ks), vs))
    return value, target, "mpmath.quad of the hyperbolic p(w) f(w)"


def hp_hyperbolic_density(dps: int) -> tuple[Any, Any, str]:
    """HP001: the two-sided mixture equals :math:`N(\\omega;0,1)\\sum_m\\xi_q^\\top\\xi_{k_m}/Z` at a point."""
    with mpmath.workdps(dps + 10):
        q, ks, _ = _example()
        w = mpmath.mpf("0.37")

        def xi(x: Any) -> tuple[Any, Any]:
            c = mpmath.exp(-x * x / 2) / mpmath.sqrt(2)
            return c * mpmath.exp(w * x), c * mpmath.exp(-w * x)

        xq = xi(q)
        z = mpmath.fsum(mpmath.exp(q * k) for k in ks)
        value = mpmath.npdf(w, 0, 1) * mpmath.fsum(xq[0] * xi(k)[0] + xq[1] * xi(k)[1] for k in ks) / z
        target = hyperbolic_target_density(w, q, ks)
    return value, target, "two-sided mixture == N(w) sum xi.xi / Z at w = 0.37"
