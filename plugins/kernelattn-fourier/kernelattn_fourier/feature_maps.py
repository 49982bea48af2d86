"""Trigonometric random feature maps: random Fourier features (``rff``), the
trigonometric softmax features (``trig-softmax-features``) and the RFA features
(``rfa-features``).

All three use ``num_features = m`` *frequencies*; the two-sided ``[cos, sin]`` maps
therefore have :math:`D = 2m` features and the offset map :math:`D = m`.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from kernelattn_core import FeatureMap, InputError
from kernelattn_core.toolkit import (
    DomainError,
    ErrorDecay,
    EstimateVariance,
    FusedFeatureSpec,
    PositiveFeatures,
    SymbolicExpectation,
    UnbiasedKernelEstimate,
    finite_rows,
)

from . import claims as C
from .kernels import GaussianKernel, SpectralKernel, make_kernel
from .sampling import iid_frequencies, orthogonal_frequencies

VARIANTS = ("cos-sin", "offset")


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{name}: expected a bool, got {value!r}")
    return value


def _identity(x: torch.Tensor, query: bool) -> torch.Tensor:
    return x


def _cos_sin_phase(omega: torch.Tensor) -> torch.Tensor:
    """``[2m]`` phases ``(0, .., 0, -π/2, .., -π/2)``: :math:`\\cos(u - \\pi/2) = \\sin u`."""
    m = omega.shape[0]
    return torch.cat([omega.new_zeros(m), omega.new_full((m,), -math.pi / 2)])


class _TrigBase(FeatureMap):
    """Shared frequency buffer ``omega [m, d]`` and its (i.i.d. or orthogonal) redraw."""

    positive: ClassVar[bool] = False
    random: ClassVar[bool] = True
    log_space: ClassVar[bool] = False
    has_budget: ClassVar[bool] = True

    omega: torch.Tensor
    spectral: SpectralKernel
    orthogonal: bool

    def _build(self, head_dim: int) -> None:
        self.register_buffer("omega", torch.empty(self.num_features, head_dim))  # [m, d]

    def _draw_frequencies(self, generator: torch.Generator | None) -> torch.Tensor:
        def draw(kind: str, shape: tuple[int, ...]) -> torch.Tensor:
            return self._draw(kind, shape, like=self.omega, generator=generator)

        assert self.head_dim is not None
        sampler = orthogonal_frequencies if self.orthogonal else iid_frequencies
        return sampler(self.spectral, self.num_features, self.head_dim, draw)

    def _redraw(self, generator: torch.Generator | None) -> None:
        self.omega.copy_(self._draw_frequencies(generator))

    def _projection(self, x: torch.Tensor) -> torch.Tensor:
        """:math:`\\omega^\\top x` for ``x [..., d]``, giving ``[..., m]``."""
        return x @ self.omega.to(dtype=x.dtype, device=x.device).transpose(0, 1)  # [..., m]


class RandomFourierFeatures(_TrigBase):
    """Random Fourier features (Rahimi & Recht, 2007) for a shift-invariant kernel.

    With :math:`\\omega_1, \\dots, \\omega_m \\sim p` (the kernel's spectral density):

    .. math::
        \\phi_{\\text{cos-sin}}(x) = \\frac{1}{\\sqrt m}\\left[\\cos(\\omega_j^\\top x),\\
        \\sin(\\omega_j^\\top x)\\right]_{j=1}^m \\in \\mathbb{R}^{2m},
        \\qquad
        \\phi_{\\text{offset}}(x) = \\sqrt{\\frac{2}{m}}\\left[\\cos(\\omega_j^\\top x + b_j)\\right]_{j=1}^m
        \\in \\mathbb{R}^{m},\\ b_j \\sim U(0, 2\\pi),

    so that :math:`\\phi(x)^\\top\\phi(y) = \\frac1m \\sum_j \\cos(\\omega_j^\\top(x - y))`
    (cos-sin) or :math:`\\frac1m\\sum_j [\\cos(\\omega_j^\\top(x - y)) + \\cos(\\omega_j^\\top(x + y) + 2 b_j)]`
    (offset), both unbiased for :math:`g(x - y)`.

    Parameters
    ----------
    head_dim : int, optional
    num_features : int, optional
        :math:`m`, the number of frequencies (default 256); the feature dimension is
        :math:`2m` for ``cos-sin`` and :math:`m` for ``offset``.
    generator : torch.Generator, optional
    kernel : {"gaussian", "laplacian", "matern"} or SpectralKernel
        The target kernel (default ``"gaussian"``).
    lengthscale : float
        :math:`\\ell` of the target kernel (default 1).
    nu : float, optional
        Matérn smoothness (1/2, 3/2 or 5/2; default 3/2); only with ``kernel="matern"``.
    variant : {"cos-sin", "offset"}
        The map (default ``"cos-sin"``).
    orthogonal : bool
        Block-orthogonal Haar directions with radial lengths from :math:`p`
        (isotropic kernels only: not ``laplacian``).

    Attributes
    ----------
    kernel : str
        **Instance** attribute: the registry name of the chosen target. The class
        attribute is the default target, ``"gaussian"``; an instance built with
        ``kernel="matern"`` reports ``"matern"``. Use :meth:`target_kernel` for the
        kernel with this map's lengthscale and :math:`\\nu`.
    omega : Tensor ``[m, d]``
        The frequencies (buffer).
    phase : Tensor ``[m]``
        The offsets :math:`b` (buffer; ``offset`` variant only).

    Notes
    -----
    Claims (checked by ``kernelattn verify fourier`` and by this plugin's tests):

    * FM001: unbiased, :math:`\\mathbb{E}[\\phi(x)^\\top\\phi(y)] = g(x - y)` (i.i.d. and orthogonal).
    * FM005: :math:`\\mathbb{E}_{\\omega \\sim \\mathcal{N}(0, \\ell^{-2} I)}[\\cos(\\omega^\\top\\delta)]
      = e^{-\\|\\delta\\|^2/2\\ell^2}`, by SymPy.
    * FM003: for i.i.d. frequencies the single-pair variance is

      .. math:: \\mathrm{Var}_{\\text{cos-sin}} = \\frac{1}{m}\\left(\\frac{1 + g(2\\delta)}{2} - g(\\delta)^2\\right)
                \\overset{\\text{Gaussian}}{=} \\frac{(1 - K^2)^2}{2m},
                \\qquad
                \\mathrm{Var}_{\\text{offset}} = \\mathrm{Var}_{\\text{cos-sin}} + \\frac{1}{2m}.

      The issue's :math:`\\tfrac12(1 - K^2)^2` is the variance *per frequency*
      (:math:`m = 1`, two features); with :math:`m` frequencies it is divided by :math:`m`.
    * FM004: kernel MSE falls as :math:`m^{-1}`.

    Examples
    --------
    >>> fm = RandomFourierFeatures(head_dim=4, num_features=8, kernel="matern", nu=0.5)
    >>> fm.kernel, fm.feature_dim
    ('matern', 16)
    """

    name: ClassVar[str] = "rff"
    aliases: ClassVar[tuple[str, ...]] = ("random-fourier",)
    kernel: ClassVar[str | None] = "gaussian"  # type: ignore[misc]  # overridden per instance
    unbiased: ClassVar[bool] = True
    learnable: ClassVar[bool] = False
    default_num_features: ClassVar[int] = 256
    claims: ClassVar[tuple[Any, ...]] = (
        PositiveFeatures(expect="fail"),  # negative control: cos/sin features are signed
        UnbiasedKernelEstimate(dims=(16, 64), norm_range=(0.2, 2.0), num_features=16),
        UnbiasedKernelEstimate(dims=(16,), norm_range=(0.2, 2.0), num_features=16, options={"orthogonal": True}),
        UnbiasedKernelEstimate(dims=(16,), norm_range=(0.2, 2.0), num_features=16, options={"variant": "offset"}),
        SymbolicExpectation(derive=C.derive_gaussian_cos_expectation),
        EstimateVariance(variance=C.rff_variance, norm_range=(0.2, 2.0)),
        EstimateVariance(variance=C.rff_variance, norm_range=(0.2, 2.0), options={"variant": "offset"}),
        ErrorDecay(slope=-1.0, norm_range=(0.2, 2.0)),
        *C.OPTION_CLAIMS["rff"],
    )

    def __init__(
        self,
        head_dim: int | None = None,
        num_features: int | None = None,
        *,
        generator: torch.Generator | None = None,
        kernel: str | SpectralKernel = "gaussian",
        lengthscale: float = 1.0,
        nu: float | str | None = None,
        variant: str = "cos-sin",
        orthogonal: bool = False,
    ) -> None:
        spectral = make_kernel(kernel, lengthscale, nu)
        if variant not in VARIANTS:
            raise InputError(f"variant: expected one of {list(VARIANTS)}, got {variant!r}")
        orthogonal = _check_bool("orthogonal", orthogonal)
        if orthogonal and not spectral.isotropic:
            raise InputError(
                f"orthogonal: needs an isotropic spectral density; kernel {spectral.name!r} is a product of "
                "1-D densities (use orthogonal=False, or kernel='matern' with nu=0.5 for the isotropic e^{-|d|/l})"
            )
        self.spectral = spectral
        self.kernel = spectral.name  # type: ignore[misc]  # the instance's target (see class docstring)
        self.variant = variant
        self.orthogonal = orthogonal
        super().__init__(head_dim, num_features, generator=generator)

    def target_kernel(self) -> SpectralKernel:
        """The exact kernel this map estimates (with its lengthscale and :math:`\\nu`)."""
        return self.spectral

    def _build(self, head_dim: int) -> None:
        super()._build(head_dim)
        if self.variant == "offset":
            self.register_buffer("phase", torch.empty(self.num_features))  # [m]

    def _redraw(self, generator: torch.Generator | None) -> None:
        super()._redraw(generator)
        if self.variant == "offset":
            self.phase.copy_(2 * math.pi * self._draw("uniform", (self.num_features,), self.phase, generator))

    def _feature_dim(self) -> int:
        return 2 * self.num_features if self.variant == "cos-sin" else self.num_features

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        u = self._projection(x)  # [..., m]
        m = self.num_features
        if self.variant == "cos-sin":
            return torch.cat([u.cos(), u.sin()], dim=-1) / math.sqrt(m)  # [..., 2m]
        b = self.phase.to(dtype=x.dtype, device=x.device)
        return math.sqrt(2.0 / m) * torch.cos(u + b)  # [..., m]

    def fused_spec(self) -> FusedFeatureSpec:
        """The ``"trig"`` family: :math:`\\rho \\cos(x\\omega^\\top + b)` with
        ``omega`` stacked twice and ``b = (0, -π/2)`` for cos-sin, or the drawn phase."""
        m = self.num_features
        if self.variant == "cos-sin":
            omega, phase, rho = torch.cat([self.omega, self.omega]), _cos_sin_phase(self.omega), 1.0 / math.sqrt(m)
        else:
            omega, phase, rho = self.omega, self.phase, math.sqrt(2.0 / m)
        return FusedFeatureSpec("trig", omega, _identity, lambda x, query: x.new_full(x.shape[:-1], rho), phase)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, kernel={self.spectral!r}, variant={self.variant!r}, orthogonal={self.orthogonal}"
        )


class TrigSoftmaxFeatures(_TrigBase):
    """Trigonometric features for the softmax kernel (RR / RFA; LARA App. C, map 3).

    .. math::
        \\phi(x) = \\frac{e^{\\|x\\|^2/2}}{\\sqrt m}
        \\left[\\sin(\\omega_j^\\top x),\\ \\cos(\\omega_j^\\top x)\\right]_{j=1}^m,
        \\qquad \\omega_j \\sim \\mathcal{N}(0, I_d),

    from :math:`e^{x^\\top y} = e^{\\|x\\|^2/2} e^{\\|y\\|^2/2} e^{-\\|x - y\\|^2/2}` and the
    Gaussian-kernel identity, so :math:`\\mathbb{E}[\\phi(x)^\\top\\phi(y)] = e^{x^\\top y}`.

    **Not positive**: :math:`\\phi(x)^\\top\\phi(y)` is negative with positive probability,
    so attention denominators can be zero or negative. The ``trig-softmax`` estimator
    pairs this map with the ``signed-row`` normaliser (see
    :class:`~kernelattn_fourier.normalizers.SignedRowNormalizer`).

    Parameters
    ----------
    head_dim, num_features, generator
        As for every feature map; ``num_features = m`` frequencies, :math:`D = 2m`.
    orthogonal : bool
        Block-orthogonal Haar frequencies with chi-distributed lengths.

    Notes
    -----
    Claims: FM001 unbiased for :math:`e^{x^\\top y}`; FM005 (SymPy, 1-D);
    FM003 variance :math:`e^{\\|x\\|^2 + \\|y\\|^2}(1 - K^2)^2/(2m)` with
    :math:`K = e^{-\\|x - y\\|^2/2}`.

    **Range.** What attention consumes (:meth:`raw_features`) leaves the query factor
    :math:`e^{\\|q\\|^2/2}` out: it is a positive per-query constant that cancels
    between numerator and denominator, and kept in it would overflow their product in
    float32 at :math:`\\|q\\|^2/2 + \\|k\\|^2/2 > 88`. Attention is therefore finite, with
    finite gradients, up to a key bound :math:`\\|k\\|^2/2 \\lesssim 80` in the scaled
    coordinates (:math:`\\|k\\| \\le 12`; half inputs are computed in float32). A key
    past the overflow bound of the key factor, :math:`\\|k\\|^2/2 > \\log` of the
    dtype's largest value (:math:`\\|k\\| > 13.3` in float32, :math:`37.7` in float64),
    raises :class:`~kernelattn_core.errors.DomainError` in non-causal attention
    (:meth:`prepare`), naming the bound; padded keys and non-finite rows are left out
    (they are never seen or are quarantined). Causal attention keeps the rows before
    such a key (they must not depend on later positions) and gives NaN rows from it on,
    as for a NaN input. The explicit :meth:`query` / :meth:`key` maps still give a NaN row at
    :math:`\\|x\\|^2/2 > 88` in float32.
    """

    name: ClassVar[str] = "trig-softmax-features"
    kernel: ClassVar[str | None] = "softmax"
    unbiased: ClassVar[bool] = True
    learnable: ClassVar[bool] = False
    default_num_features: ClassVar[int] = 256
    claims: ClassVar[tuple[Any, ...]] = (
        UnbiasedKernelEstimate(dims=(16, 64), norm_range=(0.2, 1.0), num_features=16),
        SymbolicExpectation(derive=C.derive_trig_softmax_expectation),
        EstimateVariance(variance=C.trig_softmax_variance, norm_range=(0.2, 1.0)),
        ErrorDecay(slope=-1.0),
        *C.OPTION_CLAIMS["trig-softmax-features"],
    )

    def __init__(
        self,
        head_dim: int | None = None,
        num_features: int | None = None,
        *,
        generator: torch.Generator | None = None,
        orthogonal: bool = False,
    ) -> None:
        self.orthogonal = _check_bool("orthogonal", orthogonal)
        self.spectral = GaussianKernel(1.0)
        super().__init__(head_dim, num_features, generator=generator)

    def _feature_dim(self) -> int:
        return 2 * self.num_features

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        u = self._projection(x)  # [..., m]
        half = 0.5 * (x * x).sum(-1, keepdim=True)  # [..., 1]: log of the row factor
        # a row whose factor e^{|x|^2/2} overflows is a NaN row (the engine drops the key or
        # poisons the row) with a zero gradient: the exponential never sees its exponent (its
        # backward would be 0 * inf = NaN), and NaN enters by addition, not through the product
        over = half > math.log(torch.finfo(x.dtype).max)
        scale = torch.exp(half.masked_fill(over, 0.0)) / math.sqrt(self.num_features)
        nan_rows = torch.zeros_like(half).masked_fill_(over, float("nan"))  # [..., 1], no gradient
        return torch.addcmul(nan_rows, torch.cat([u.sin(), u.cos()], dim=-1), scale)  # [..., 2m]

    #: :meth:`prepare` takes the estimator's factor: attention leaves the scaling to the
    #: engine (no scaled copies of ``q`` and ``k``) and the check reads the unscaled keys
    prepare_takes_scale: ClassVar[bool] = True

    #: the one-reduction screen of :meth:`prepare` passes a call whose largest half-norm is
    #: below ``(1 - _SCREEN_MARGIN)`` times the bound; keys closer to it (or non-finite,
    #: or padded ones past it) take the exact test, computed as :meth:`_features` computes
    #: it (the margin covers the rounding of the scaling in bfloat16, 2^-7 on ||k||^2, and of the norm)
    _SCREEN_MARGIN: ClassVar[float] = 2e-2

    def prepare(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        causal: bool = False,
        scale: float = 1.0,
    ) -> None:
        """Non-causal calls: raise :class:`~kernelattn_core.errors.DomainError` when an
        unpadded key has a factor :math:`e^{\\|k\\|^2/2}` that overflows the compute
        dtype (its feature row would be NaN, and so every output row), ``k`` the scaled
        key ``scale * k`` (feature-map attention passes the unscaled keys and its factor,
        ``prepare_takes_scale``). Padded keys, rows holding NaN or inf (quarantined by
        attention) and calls without queries are left out. Causal calls (and decoding
        steps) are not refused: the rows before the first such key are finite and must
        not depend on later positions, and the rows from it on are NaN, as after a NaN
        input. While Dynamo traces, nothing is read back (the NaN rows remain). Nothing is
        learned from the data.

        One reduction over ``k`` (the largest key norm) decides in the common case; only
        a call with a key near or past the bound, or a non-finite key, takes the exact
        per-row test."""
        if causal or q.shape[-2] == 0 or k.numel() == 0 or torch.compiler.is_compiling():
            return
        half_dtype = k.dtype in (torch.float16, torch.bfloat16)
        dtype = torch.float32 if half_dtype else k.dtype
        limit = math.log(torch.finfo(dtype).max)
        top = float(torch.linalg.vector_norm(k.detach(), dim=-1, dtype=dtype).amax())  # detached: no graph
        # NaN (a NaN key) fails the comparison and takes the exact test, as inf does
        if 0.5 * scale * scale * top * top <= limit * (1.0 - self._SCREEN_MARGIN):
            return
        with torch.no_grad():
            x = k.detach() if scale == 1.0 else k.detach() * scale  # as the engine scales
            x = x.float() if half_dtype else x
            half = 0.5 * (x * x).sum(-1)  # [B, H, M], as _features computes it
            seen = finite_rows(x)
            if key_padding_mask is not None:
                seen = seen & ~key_padding_mask[:, None, :]
            worst = float(torch.where(seen, half, torch.zeros_like(half)).max())
        if worst > limit:
            bound = math.sqrt(2.0 * limit)
            raise DomainError(
                f"k: {self.name!r} needs scaled key norms ||k|| <= {bound:.4g} in {str(x.dtype).replace('torch.', '')} "
                f"(the key factor e^(||k||^2/2) overflows past it), got max ||k|| = {math.sqrt(2.0 * worst):.4g} "
                "(after the estimator's scaling, d^(-1/4) by default); normalise the keys or lower scale"
            )

    def raw_features(self, x: torch.Tensor, *, query: bool) -> torch.Tensor:
        """What attention consumes, ``[..., d]`` to ``[..., 2m]``: :math:`\\phi_k(x)` for keys,
        :math:`e^{-\\|x\\|^2/2}\\phi_q(x)` for queries (a positive per-query factor that
        cancels in attention; see Range in the class notes). A key whose factor
        :math:`e^{\\|x\\|^2/2}` overflows, or a non-finite row, gives a NaN row with a zero
        gradient."""
        if not query:
            return super().raw_features(x, query=False)
        root = math.sqrt(self.num_features)

        def trig(t: torch.Tensor) -> torch.Tensor:
            u = self._projection(t)  # [..., m]
            return torch.cat([u.sin(), u.cos()], dim=-1) / root  # [..., 2m]

        return self._isolated(self._checked(x, "q"), True, trig)

    def fused_spec(self) -> FusedFeatureSpec:
        """The ``"trig"`` family: :math:`e^{\\|x\\|^2/2} m^{-1/2} \\cos(x\\omega^\\top + b)` for keys
        and :math:`m^{-1/2} \\cos(x\\omega^\\top + b)` for queries (the factor that cancels is
        left out, as in :meth:`raw_features`), ``omega`` stacked twice, ``b = (-π/2, 0)``
        (sin then cos)."""
        root = math.sqrt(self.num_features)

        def row(x: torch.Tensor, query: bool) -> torch.Tensor:
            if query:  # the cancelling factor e^{|q|^2/2} is left out (finite at large norms)
                return torch.full_like(x[..., 0], 1.0 / root)  # [...]
            return torch.exp(0.5 * (x * x).sum(-1)) / root  # [...]

        omega = torch.cat([self.omega, self.omega])
        return FusedFeatureSpec("trig", omega, _identity, row, _cos_sin_phase(self.omega).flip(0))


class RFAFeatures(_TrigBase):
    """The random feature attention map of Peng et al. (2021): trigonometric features
    of unit-normalised inputs with a learnable per-head scale.

    .. math::
        \\hat x = \\frac{x}{\\|x\\|}, \\qquad
        \\phi_h(x) = \\frac{1}{\\sqrt m}\\left[\\sin\\!\\left(\\frac{\\omega_j^\\top \\hat x}{\\sigma_h}\\right),\\
        \\cos\\!\\left(\\frac{\\omega_j^\\top \\hat x}{\\sigma_h}\\right)\\right]_{j=1}^m,
        \\qquad \\omega_j \\sim \\mathcal{N}(0, I_d),

    so that, on the unit sphere,

    .. math:: \\mathbb{E}[\\phi_h(x)^\\top\\phi_h(y)] = e^{-\\|\\hat x - \\hat y\\|^2 / 2\\sigma_h^2}
              = e^{-1/\\sigma_h^2}\\, e^{\\hat x^\\top \\hat y / \\sigma_h^2} .

    The constant :math:`e^{-1/\\sigma_h^2}` cancels in attention, which therefore
    estimates softmax attention over the *cosine* similarities with a learned
    inverse temperature :math:`1/\\sigma_h^2` per head.

    Choices where Peng et al. leave details open (documented and tested):

    * :math:`\\sigma_h = e^{s_h}` with a learnable ``log_scale`` :math:`s_h` (positive by
      construction), initialised to :math:`\\log` ``init_scale`` (default 1); the random
      directions :math:`\\omega_j` are shared by all heads (the reparametrisation
      :math:`\\omega_j/\\sigma_h` of :math:`\\mathcal N(0, \\sigma_h^{-2} I)`), so gradients reach
      :math:`\\sigma_h` through the features.
    * ``num_heads=None`` learns one scale shared by every head; ``num_heads=H`` learns
      one per head and expects inputs ``[..., H, N, d]``.
    * A zero vector is left at zero (:math:`\\hat 0 = 0`); the division uses
      :math:`\\max(\\|x\\|, \\text{tiny})`.
    * The optional gating of the paper is the estimator ``rfa-gate``
      (:class:`~kernelattn_fourier.estimators.RFAGateAttention`), causal only.

    Parameters
    ----------
    head_dim, num_features, generator
        As for every feature map (:math:`D = 2m`).
    num_heads : int, optional
        Learn one scale per head (inputs ``[..., H, N, d]``).
    init_scale : float
        Initial :math:`\\sigma` (default 1).
    learn_scale : bool
        Whether :math:`\\sigma` is a trainable parameter (default ``True``).
    orthogonal : bool
        Block-orthogonal Haar directions.

    Attributes
    ----------
    log_scale : Parameter ``[H]`` or ``[1]``
        :math:`\\log \\sigma_h`.
    """

    name: ClassVar[str] = "rfa-features"
    kernel: ClassVar[str | None] = None
    unbiased: ClassVar[bool] = False
    learnable: ClassVar[bool] = True
    default_num_features: ClassVar[int] = 128
    claims: ClassVar[tuple[Any, ...]] = C.OPTION_CLAIMS["rfa-features"]

    def __init__(
        self,
        head_dim: int | None = None,
        num_features: int | None = None,
        *,
        generator: torch.Generator | None = None,
        num_heads: int | None = None,
        init_scale: float = 1.0,
        learn_scale: bool = True,
        orthogonal: bool = False,
    ) -> None:
        if num_heads is not None and (isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1):
            raise InputError(f"num_heads: expected a positive integer or None, got {num_heads!r}")
        if (
            isinstance(init_scale, bool)
            or not isinstance(init_scale, int | float)
            or not math.isfinite(init_scale)
            or not init_scale > 0
        ):
            raise InputError(f"init_scale: expected a finite number > 0, got {init_scale!r}")
        learn_scale = _check_bool("learn_scale", learn_scale)
        orthogonal = _check_bool("orthogonal", orthogonal)
        super().__init__(None, num_features, generator=generator)
        self.orthogonal = orthogonal
        self.spectral = GaussianKernel(1.0)
        self.num_heads = num_heads
        self.log_scale = nn.Parameter(
            torch.full((num_heads or 1,), math.log(float(init_scale))), requires_grad=learn_scale
        )  # [H] or [1]
        if head_dim is not None:
            self.build(head_dim, generator=generator)

    def _feature_dim(self) -> int:
        return 2 * self.num_features

    def sigma(self) -> torch.Tensor:
        """:math:`\\sigma_h = e^{s_h}`, ``[H]`` or ``[1]``."""
        return self.log_scale.exp()

    def _check_heads(self, x: torch.Tensor, arg: str) -> None:
        if self.num_heads is not None and (x.dim() < 3 or x.shape[-3] != self.num_heads):
            raise InputError(
                f"{arg}: rfa-features was built with num_heads = {self.num_heads} and expects inputs [..., H, N, d] "
                f"with H = {self.num_heads}, got shape {tuple(x.shape)}"
            )

    def _checked(self, x: torch.Tensor, arg: str) -> torch.Tensor:
        x = super()._checked(x, arg)
        self._check_heads(x, arg)  # naming the caller's argument (q, k or x) and shape
        return x

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        self._check_heads(x, "x")
        norm = x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)  # [..., 1]
        u = self._projection(x / norm)  # [..., m]
        inv = (-self.log_scale).exp().to(dtype=x.dtype, device=x.device)  # [H] or [1]
        if self.num_heads is not None:
            inv = inv[:, None, None]  # [H, 1, 1] against [..., H, N, m]
        u = u * inv
        return torch.cat([u.sin(), u.cos()], dim=-1) / math.sqrt(self.num_features)  # [..., 2m]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_heads={self.num_heads}, orthogonal={self.orthogonal}"
