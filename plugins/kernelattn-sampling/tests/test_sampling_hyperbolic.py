"""Corollary C.1 (LARA): randomized attention with the hyperbolic map."""

from __future__ import annotations

import math

import mpmath
import torch
from kernelattn_sampling.hyperbolic import hp_hyperbolic_attention, hp_hyperbolic_density, hyperbolic_ra


def test_p4_hyperbolic_identities_to_25_digits() -> None:
    for fn in (hp_hyperbolic_attention, hp_hyperbolic_density):
        value, target, _ = fn(30)
        with mpmath.workdps(40):
            assert abs(value - target) <= mpmath.mpf(10) ** -25 * abs(target), fn.__name__


def test_hyperbolic_ra_is_unbiased_for_softmax_attention() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 5, 3, generator=g, dtype=torch.float64) * s for s in (0.6, 0.6, 1.0))
    exact = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
    draws = torch.stack([hyperbolic_ra(q, k, v, 1, generator=g) for _ in range(3000)])
    mean, se = draws.mean(0), draws.std(0) / math.sqrt(draws.shape[0])
    z = ((mean - exact) / se).abs()
    assert float(z.max()) < 4.5

    # negative control: without the Gaussian noise (f at the component means) it is biased
    bad = torch.stack([hyperbolic_ra(q, k, v, 1, generator=g, noise=False) for _ in range(3000)])
    zb = ((bad.mean(0) - exact) / (bad.std(0) / math.sqrt(bad.shape[0])).clamp_min(1e-300)).abs()
    assert float(zb.max()) > 6
