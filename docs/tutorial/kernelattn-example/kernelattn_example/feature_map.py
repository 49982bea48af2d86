"""Antithetic positive random features for the softmax kernel."""

from __future__ import annotations

import math
from typing import ClassVar

import sympy
import torch

from kernelattn_core import FeatureMap
from kernelattn_core.toolkit import ErrorDecay, SymbolicExpectation, UnbiasedKernelEstimate


def antithetic_expectation():
    """E over omega ~ N(0, 1) of the antithetic single-pair estimate, in one dimension."""
    x, y, w = sympy.symbols("x y omega", real=True)
    density = sympy.exp(-(w**2) / 2) / sympy.sqrt(2 * sympy.pi)

    def xi(z, s):
        return sympy.exp(s * w * z - z**2 / 2)

    pair = (xi(x, 1) * xi(y, 1) + xi(x, -1) * xi(y, -1)) / 2
    expectation = sympy.integrate(pair * density, (w, -sympy.oo, sympy.oo))
    return expectation, sympy.exp(x * y), "1-D Gaussian integral over omega, both signs"


class AntitheticPRF(FeatureMap):
    r"""Positive random features with antithetic pairs :math:`(\omega, -\omega)`.

    .. math::
        \phi(x) = \frac{e^{-|x|^2/2}}{\sqrt{2m}}
        \left[e^{\omega_1^\top x}, \dots, e^{\omega_m^\top x},
              e^{-\omega_1^\top x}, \dots, e^{-\omega_m^\top x}\right],
        \qquad \omega_i \sim \mathcal{N}(0, I_d),

    so :math:`D = 2m` positive features with
    :math:`\mathbb{E}[\phi(x)^\top \phi(y)] = \exp(\langle x, y\rangle)`. The map is
    built in log space; the engine applies exact, causal-safe stabilisers.

    Parameters
    ----------
    head_dim : int, optional
    num_features : int, optional
        The number ``m`` of antithetic pairs (``D = 2m`` features).
    """

    name: ClassVar[str] = "example-antithetic"
    kernel: ClassVar[str] = "softmax"
    unbiased: ClassVar[bool] = True
    positive: ClassVar[bool] = True
    log_space: ClassVar[bool] = True
    default_num_features: ClassVar[int] = 64
    claims: ClassVar[tuple] = (
        UnbiasedKernelEstimate(dims=(16, 64)),
        SymbolicExpectation(derive=antithetic_expectation),
        ErrorDecay(slope=-1.0),
    )

    def _build(self, head_dim: int) -> None:
        self.register_buffer("omega", torch.empty(self.num_features, head_dim))  # [m, d]

    def _redraw(self, generator: torch.Generator | None) -> None:
        self.omega.copy_(self._draw("normal", tuple(self.omega.shape), self.omega, generator))

    def _feature_dim(self) -> int:
        return 2 * self.num_features

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        u = x @ self.omega.to(x.dtype).T  # [..., m]
        base = -0.5 * (x * x).sum(-1, keepdim=True) - 0.5 * math.log(2 * self.num_features)
        return torch.cat([u, -u], dim=-1) + base  # log features [..., 2m]
