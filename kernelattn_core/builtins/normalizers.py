"""Normalizers built into the core."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from ..errors import InputError
from ..interfaces.normalizer import Normalizer


class RowNormalizer(Normalizer):
    """Plain row normalisation :math:`\\mathrm{num}_i / \\mathrm{den}_i` (the default);
    see :class:`~kernelattn_core.interfaces.Normalizer` for the stabiliser."""

    name: ClassVar[str] = "row"


class SignedRowNormalizer(Normalizer):
    """Row normalisation that stays bounded when the denominator is near zero or negative.

    Trigonometric features give :math:`\\hat K(q_i, k_j) < 0` with positive probability, so
    :math:`\\mathrm{den}_i = \\sum_j \\hat K(q_i, k_j)`, an estimate of a positive number, can
    be zero or of either sign, and plain :math:`\\mathrm{num}_i / \\mathrm{den}_i` explodes.
    This normaliser divides with a ridge (Tikhonov) term measured against the numerator:

    .. math::
        \\mathrm{out}_i = \\frac{\\mathrm{den}_i}{\\mathrm{den}_i^2 + \\tau_i^2}\\,\\mathrm{num}_i,
        \\qquad \\tau_i^2 = \\varepsilon^2\\, \\frac{\\|\\mathrm{num}_i\\|^2}{d_v} .

    Properties (each tested):

    * equal to :math:`\\mathrm{num}_i/\\mathrm{den}_i` up to a relative
      :math:`\\varepsilon^2 r_i^2` where :math:`r_i = \\|\\mathrm{out}_i\\|_{\\mathrm{rms}}` when the
      ratio is moderate: the *sign* of the denominator is kept (hence the name);
    * the output RMS never exceeds :math:`1/(2\\varepsilon)` (the maximum of
      :math:`a/(a^2 + \\varepsilon^2)` over :math:`a`), and the output goes continuously to 0
      as :math:`\\mathrm{den}_i \\to 0` instead of jumping between :math:`\\pm\\infty`;
    * invariant to a common non-zero per-query factor on ``num`` and ``den`` (the
      engine's stabilisers); rows with ``num = den = 0`` (every key masked) give 0;
    * computed after dividing both by :math:`\\max(|\\mathrm{den}_i|, \\max|\\mathrm{num}_i|)`
      (an exact, per-query rescaling), so squares never overflow.

    **What it costs.** The cap is in the units of the values: with :math:`\\varepsilon = 10^{-2}`
    an output whose RMS is :math:`r` is shrunk by the factor :math:`1/(1 + \\varepsilon^2 r^2)`,
    :math:`10^{-4}` relative at :math:`r = 1`, and outputs are capped at RMS 50. For values of
    a very different scale choose ``eps`` accordingly (the rule cannot see the values,
    only ``num`` and ``den``). The fourier plugin's README measures the effect on
    ``kernelattn compare``.

    Parameters
    ----------
    eps : float
        :math:`\\varepsilon \\ge 0` (default ``1e-2``); ``0`` is plain signed division with
        0 for an exactly zero denominator.
    """

    name: ClassVar[str] = "signed-row"

    def __init__(self, eps: float = 1e-2) -> None:
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not math.isfinite(eps) or eps < 0:
            raise InputError(f"eps: expected a finite number >= 0, got {eps!r}")
        super().__init__(eps=float(eps))

    def normalize(self, num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
        """``num [B, H, N, dv]``, ``den [B, H, N]`` to ``[B, H, N, dv]`` (see the class docstring)."""
        scale = torch.maximum(den.detach().abs(), num.detach().abs().amax(-1))  # [B, H, N]
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        n = num / scale.unsqueeze(-1)  # entries in [-1, 1]
        d = den / scale
        tau2 = (self.eps**2) * (n * n).mean(-1)  # [B, H, N]
        denom = d * d + tau2
        safe = torch.where(denom > 0, denom, torch.ones_like(denom))
        return n * (d / safe).unsqueeze(-1)
