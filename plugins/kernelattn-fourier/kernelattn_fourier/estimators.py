"""Estimator presets: feature-map attention with a trigonometric map and the
``signed-row`` normaliser."""

from __future__ import annotations

from typing import ClassVar

from kernelattn_core import FeatureMapAttention, Normalizer

from .feature_maps import RFAFeatures, TrigSoftmaxFeatures
from .normalizers import SignedRowNormalizer


def _normalizer(normalizer: Normalizer | str | None) -> Normalizer | str:
    return SignedRowNormalizer() if normalizer is None else normalizer


class TrigSoftmaxAttention(FeatureMapAttention):
    """Softmax attention through the trigonometric features (``trig-softmax-features``)
    with the ``signed-row`` normaliser.

    .. math:: \\mathrm{out}_i = \\frac{\\mathrm{den}_i\\, \\mathrm{num}_i}{\\mathrm{den}_i^2 + \\tau_i^2},
              \\quad \\mathrm{num}_i = \\phi(q_i)^\\top \\sum_j \\phi(k_j) v_j^\\top, \\quad
              \\mathrm{den}_i = \\phi(q_i)^\\top \\sum_j \\phi(k_j)

    with :math:`\\phi(x) = e^{\\|x\\|^2/2}[\\sin \\omega^\\top x, \\cos \\omega^\\top x]/\\sqrt m`
    (unbiased for :math:`e^{q^\\top k}`, not positive). Self-normalised, so biased at finite
    ``num_features`` and consistent as it grows.

    Parameters
    ----------
    num_features : int, optional
        Frequencies :math:`m` (feature dimension :math:`2m`; default 256).
    normalizer : Normalizer or str, optional
        ``SignedRowNormalizer()`` by default; ``"row"`` gives plain division.
    orthogonal : bool
        Orthogonal (Haar) frequencies.
    head_dim, redraw_every, seed, chunk_size, backend, scale
        As for :class:`~kernelattn_core.FeatureMapAttention`.
    """

    name: ClassVar[str] = "trig-softmax"
    unbiased: ClassVar[bool] = False
    consistent: ClassVar[bool] = True
    random: ClassVar[bool] = True
    has_budget: ClassVar[bool] = True
    linear: ClassVar[bool] = True

    def __init__(
        self,
        *,
        num_features: int | None = None,
        normalizer: Normalizer | str | None = None,
        orthogonal: bool = False,
        head_dim: int | None = None,
        redraw_every: int = 0,
        seed: int | None = None,
        chunk_size: int = 64,
        backend: str | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__(
            TrigSoftmaxFeatures(num_features=num_features, orthogonal=orthogonal),
            _normalizer(normalizer),
            head_dim=head_dim,
            redraw_every=redraw_every,
            seed=seed,
            chunk_size=chunk_size,
            backend=backend,
            scale=scale,
        )


class RFAAttention(FeatureMapAttention):
    """Random feature attention (Peng et al., 2021), the baseline of the source papers.

    Feature-map attention with :class:`~kernelattn_fourier.feature_maps.RFAFeatures`
    (trigonometric features of unit-normalised queries and keys, learnable scale
    :math:`\\sigma_h`) and the ``signed-row`` normaliser; it estimates

    .. math:: \\mathrm{out}_i \\approx \\sum_j
              \\frac{e^{\\hat q_i^\\top \\hat k_j / \\sigma_h^2}}
              {\\sum_{j'} e^{\\hat q_i^\\top \\hat k_{j'} / \\sigma_h^2}} v_j,
              \\qquad \\hat x = x / \\|x\\| .

    The :math:`d^{-1/4}` scaling of the package convention is removed by the
    normalisation; :math:`1/\\sigma_h^2` plays the role of the temperature.

    Parameters
    ----------
    num_features : int, optional
        Frequencies :math:`m` (default 128; feature dimension :math:`2m`).
    num_heads : int, optional
        One learnable scale per head (inputs with ``H = num_heads``); one shared scale
        when ``None``.
    init_scale : float
        Initial :math:`\\sigma` (default 1).
    learn_scale : bool
        Train :math:`\\sigma` (default ``True``).
    orthogonal : bool
        Orthogonal (Haar) directions (Peng et al. use i.i.d.; default ``False``).
    normalizer : Normalizer or str, optional
        ``SignedRowNormalizer()`` by default.
    head_dim, redraw_every, seed, chunk_size, backend, scale
        As for :class:`~kernelattn_core.FeatureMapAttention`.
    """

    name: ClassVar[str] = "rfa"
    unbiased: ClassVar[bool] = False
    consistent: ClassVar[bool] = True
    random: ClassVar[bool] = True
    has_budget: ClassVar[bool] = True
    linear: ClassVar[bool] = True

    def __init__(
        self,
        *,
        num_features: int | None = None,
        num_heads: int | None = None,
        init_scale: float = 1.0,
        learn_scale: bool = True,
        orthogonal: bool = False,
        normalizer: Normalizer | str | None = None,
        head_dim: int | None = None,
        redraw_every: int = 0,
        seed: int | None = None,
        chunk_size: int = 64,
        backend: str | None = None,
        scale: float | None = None,
    ) -> None:
        fm = RFAFeatures(
            num_features=num_features,
            num_heads=num_heads,
            init_scale=init_scale,
            learn_scale=learn_scale,
            orthogonal=orthogonal,
        )
        super().__init__(
            fm,
            _normalizer(normalizer),
            head_dim=head_dim,
            redraw_every=redraw_every,
            seed=seed,
            chunk_size=chunk_size,
            backend=backend,
            scale=scale,
        )
