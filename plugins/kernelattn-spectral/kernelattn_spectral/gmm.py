"""GMM-RKS and GMM-PRF: feature maps whose frequencies come from a learned Gaussian mixture.

Frequencies are reparameterised, :math:`\\omega_{c,m} = A_c n_m + \\mu_c` with
:math:`n_m \\sim \\mathcal N(0, I)`, so gradients reach :math:`\\mu_c` and :math:`A_c` while the
noise :math:`n` is the map's only random draw (a buffer, redrawn by the redraw policy).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from kernelattn_core.toolkit import (
    FeatureMap,
    InputError,
    QuadratureIdentity,
    SymbolicExpectation,
    UnbiasedKernelEstimate,
)

from . import claims as _c
from ._base import check_int, check_positive_float, prf_log_features, rks_features
from .kernels import GaussianPRFKernel, SpectralMixtureKernel


class _GMMFeatureMap(FeatureMap):
    """Common part of the GMM maps: options, mean parameters and the shared noise."""

    learnable: ClassVar[bool] = True
    random: ClassVar[bool] = True
    unbiased: ClassVar[bool] = True
    default_num_features: ClassVar[int] = 256

    def __init__(
        self,
        head_dim: int | None = None,
        num_features: int | None = None,
        *,
        components: int = 2,
        bandwidth: float = 1.0,
        mean_init_std: float = 0.1,
        share_noise: bool = True,
        generator: torch.Generator | None = None,
    ) -> None:
        self.components = check_int("components", components)
        self.bandwidth = check_positive_float("bandwidth", bandwidth)
        self.mean_init_std = check_positive_float("mean_init_std", mean_init_std, allow_zero=True)
        if not isinstance(share_noise, bool):
            raise InputError(f"share_noise: expected a bool, got {share_noise!r}")
        self.share_noise = share_noise
        budget = self.default_num_features if num_features is None else num_features
        if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0 and budget % self.components:
            raise InputError(
                f"num_features: expected a multiple of components = {self.components} "
                f"(num_features / components samples per component), got {budget}"
            )
        super().__init__(head_dim, num_features, generator=generator)

    @property
    def samples_per_component(self) -> int:
        """:math:`M` frequencies per component (``num_features / components``)."""
        return self.num_features // self.components

    def _build(self, head_dim: int) -> None:
        c, m = self.components, self.samples_per_component
        self.means = nn.Parameter(torch.zeros(c, head_dim))  # [C, d]
        self._build_scales(head_dim)
        self.register_buffer("noise", torch.empty(1 if self.share_noise else c, m, head_dim))  # [C or 1, M, d]
        self.register_buffer("params_initialised", torch.tensor(False))

    def _build_scales(self, head_dim: int) -> None:
        raise NotImplementedError

    def _redraw(self, generator: torch.Generator | None) -> None:
        if not bool(self.params_initialised):
            # symmetry breaking of the components: mu_c ~ N(0, mean_init_std^2 I), once
            self.means.copy_(self.mean_init_std * self._draw("normal", tuple(self.means.shape), self.means, generator))
            self.params_initialised.fill_(True)
        self.noise.copy_(self._draw("normal", tuple(self.noise.shape), self.noise, generator))

    def _factor_apply(self, n: torch.Tensor) -> torch.Tensor:
        """:math:`A_c n` for noise ``n [C or 1, M, d]``, giving ``[C, M, d]``."""
        raise NotImplementedError

    def frequencies(self) -> torch.Tensor:
        """The frequencies :math:`\\omega_{c,m} = A_c n_m + \\mu_c`, ``[C * M, d]`` (differentiable
        in the parameters)."""
        if not self.built:
            raise InputError(f"{self.name!r}: frequencies() needs the head dimension; call build(head_dim) first")
        omega = self._factor_apply(self.noise) + self.means.unsqueeze(1)  # [C, M, d]
        return omega.reshape(-1, omega.shape[-1])

    def _feature_dim(self) -> int:
        return self.num_features * (2 if not self.log_space else 1)

    def _projections(self, x: torch.Tensor) -> torch.Tensor:
        w = self.frequencies().to(device=x.device, dtype=x.dtype)  # [C*M, d]
        return x @ w.transpose(0, 1)  # [..., C*M]

    def target_kernel(self) -> Any:
        """The closed-form kernel for the current parameters (detached copies)."""
        raise NotImplementedError

    def exact_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The exact kernel matrix :math:`K(x_i, y_j) = \\mathbb{E}_n[\\hat K(x_i, y_j)]` for the
        current parameters, ``x [..., N, d]``, ``y [..., M, d]`` to ``[..., N, M]``;
        differentiable in the parameters (the gradient the reparameterised estimate is
        unbiased for)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, components={self.components}, bandwidth={self.bandwidth}, "
            f"share_noise={self.share_noise}"
        )


class GMMRKSFeatureMap(_GMMFeatureMap):
    """GMM-RKS: trigonometric features with frequencies from a learned Gaussian mixture.

    .. math::
        \\omega_{c,m} = A_c n_m + \\mu_c, \\quad n_m \\sim \\mathcal N(0, I_d), \\qquad
        \\phi(x) = \\frac{1}{\\sqrt{CM}}\\big[\\cos(\\omega_{c,m}^\\top x),\\ \\sin(\\omega_{c,m}^\\top x)\\big]_{c,m}
        \\in \\mathbb{R}^{2CM},

    an unbiased estimate of the spectral-mixture kernel (``spectral-gmm``)

    .. math::
        K(x, y) = \\frac1C \\sum_c \\exp\\!\\left(-\\tfrac12 \\delta^\\top A_c A_c^\\top \\delta\\right)
        \\cos(\\mu_c^\\top \\delta), \\qquad \\delta = x - y .

    Parameters
    ----------
    head_dim : int, optional
    num_features : int
        Total number of frequencies :math:`CM` (a multiple of ``components``); the feature
        dimension is ``2 * num_features``.
    components : int
        :math:`C` (equal weights :math:`1/C`, not learned, as in the paper). Default 2 (LRA).
    bandwidth : float
        :math:`\\sigma`: :math:`A_c` starts at :math:`I/\\sigma`. Default 1.
    mean_init_std : float
        :math:`\\mu_c` starts at :math:`\\mathcal N(0, s^2 I)` (drawn once, from the generator of
        the first draw) so that components can separate; 0 starts every :math:`\\mu_c` at 0.
        Default 0.1.
    share_noise : bool
        One noise matrix :math:`n [M, d]` for all components (the paper, default) or one per component.

    Attributes
    ----------
    means : Parameter ``[C, d]``
        :math:`\\mu_c`.
    factors : Parameter ``[C, d, d]``
        :math:`A_c` (full; the paper's "Σ_c"; the covariance is :math:`A_c A_c^\\top`).
    noise : buffer ``[1 or C, M, d]``
        :math:`n`, the random draw; redrawn by the estimator's redraw policy
        (``create("gmm-rks", redraw_every=100)`` as in the paper), frozen in eval mode.

    Notes
    -----
    Claims: FM001 (unbiased for ``spectral-gmm`` at :math:`\\mu = 0, A = I`), FM005 (1-D
    symbolic expectation), HP001 (2-D Gauss–Hermite quadrature at 40 digits against the
    closed form with full :math:`A`). The gradient of the estimate w.r.t. :math:`\\mu, A` is
    unbiased for the gradient of :meth:`exact_kernel` (tested). Estimates lie in
    :math:`[-1, 1]`, so attention denominators can be small or negative.

    Examples
    --------
    >>> import kernelattn_core as ka
    >>> attn = ka.create("gmm-rks", num_features=64, redraw_every=100)
    """

    # trigonometric estimates can be negative: bounded division when denominators near zero
    default_normalizer: ClassVar[str] = "signed-row"
    name: ClassVar[str] = "gmm-rks"
    kernel: ClassVar[str | None] = "spectral-gmm"
    positive: ClassVar[bool] = False
    log_space: ClassVar[bool] = False
    claims: ClassVar[tuple[Any, ...]] = (
        UnbiasedKernelEstimate(options={"mean_init_std": 0.0}),
        SymbolicExpectation(derive=_c.derive_rks_1d),
        QuadratureIdentity(evaluate=_c.evaluate_gmm_rks_2d, label="GMM-RKS expectation, d = 2, C = 2, full A_c"),
    )

    def _build_budget(self, head_dim: int) -> list[tuple[str, int, int, str]]:
        # the [C, d, d] factors (and the [d, d] identity they start from), before allocating
        return [("head_dim", head_dim, self.components * head_dim, "components × head_dim (the [C, d, d] factors)")]

    def _build_scales(self, head_dim: int) -> None:
        eye = torch.eye(head_dim) / self.bandwidth
        self.factors = nn.Parameter(eye.repeat(self.components, 1, 1))  # [C, d, d]

    def _factor_apply(self, n: torch.Tensor) -> torch.Tensor:
        return n @ self.factors.transpose(-1, -2)  # (A_c n)^T = n^T A_c^T: [C, M, d]

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        return rks_features(self._projections(x))  # [..., 2CM]

    def target_kernel(self) -> SpectralMixtureKernel:
        return SpectralMixtureKernel(self.means.detach().clone(), self.factors.detach().clone())

    def exact_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return SpectralMixtureKernel(self.means, self.factors)(x, y)


class GMMPRFFeatureMap(_GMMFeatureMap):
    """GMM-PRF: positive random features with frequencies from a learned Gaussian mixture
    with diagonal scales.

    .. math::
        \\omega_{c,m} = a_c \\odot n_m + \\mu_c, \\quad a_c = e^{\\ell_c} > 0, \\qquad
        \\phi(x) = \\frac{e^{-\\|x\\|^2/2}}{\\sqrt{CM}}\\big[e^{\\omega_{c,m}^\\top x}\\big]_{c,m}
        \\in \\mathbb{R}_{>0}^{CM},

    an unbiased estimate of (``spectral-prf``)

    .. math::
        K(q, k) = \\frac1C \\sum_c \\exp\\!\\left(\\mu_c^\\top s + \\tfrac12 s^\\top \\mathrm{diag}(a_c^2)\\, s
        - \\tfrac12\\|q\\|^2 - \\tfrac12\\|k\\|^2\\right), \\qquad s = q + k,

    which at :math:`\\mu = 0, a = 1` is the softmax kernel :math:`e^{q^\\top k}`. Computed in
    log space (``log_space = True``); the engine applies its exact stabilisers.

    Parameters
    ----------
    head_dim, num_features, components, bandwidth, mean_init_std, share_noise
        As :class:`GMMRKSFeatureMap`; :math:`a_c` starts at :math:`1/\\sigma`. The feature
        dimension is ``num_features``.

    Attributes
    ----------
    means : Parameter ``[C, d]``
    log_scales : Parameter ``[C, d]``
        :math:`\\ell_c = \\log a_c` (the positive parameterisation; the paper gives none).
    noise : buffer ``[1 or C, M, d]``

    Notes
    -----
    Claims: FM001 (unbiased for softmax at :math:`\\mu = 0, a = 1`), FM002 (positive), FM005
    (1-D symbolic), HP001 (2-D quadrature). Per-sample variance per component
    :math:`K_c^2 (e^{s^\\top S_c s} - 1)`.
    """

    name: ClassVar[str] = "gmm-prf"
    kernel: ClassVar[str | None] = "spectral-prf"
    positive: ClassVar[bool] = True
    log_space: ClassVar[bool] = True
    claims: ClassVar[tuple[Any, ...]] = (
        UnbiasedKernelEstimate(options={"mean_init_std": 0.0}),
        SymbolicExpectation(derive=_c.derive_prf_1d),
        QuadratureIdentity(evaluate=_c.evaluate_gmm_prf_2d, label="GMM-PRF expectation, d = 2, C = 2, diagonal"),
    )

    def _build_scales(self, head_dim: int) -> None:
        self.log_scales = nn.Parameter(torch.full((self.components, head_dim), -math.log(self.bandwidth)))

    def scales(self) -> torch.Tensor:
        """:math:`a_c = e^{\\ell_c}`, ``[C, d]``."""
        return self.log_scales.exp()

    def _factor_apply(self, n: torch.Tensor) -> torch.Tensor:
        return n * self.scales().unsqueeze(1)  # [C, M, d]

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        return prf_log_features(self._projections(x), x)  # [..., CM] (log)

    def target_kernel(self) -> GaussianPRFKernel:
        return GaussianPRFKernel(self.means.detach().clone(), self.scales().detach().clone())

    def exact_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return GaussianPRFKernel(self.means, self.scales())(x, y)
