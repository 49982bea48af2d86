"""ppSBN: the pre- and post-scaling "batch normalization" of SchoenbAt / Macformer."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from kernelattn_core import Normalizer
from kernelattn_core.errors import InputError

STATS = ("token", "batch")


class PPSBN(Normalizer):
    """Pre-/post-scaling of random Maclaurin feature attention (ppSBN, Algorithm 1).

    **Pre-scaling** of each of q and k (``[B, H, N, d]``):

    .. math:: x' = \\frac{x - \\mu}{\\sqrt{\\sigma^2 + \\varepsilon}}, \\qquad
              x^{\\rm SBN} = s \\, \\frac{x'}{\\|x'\\|_2}\\ (\\text{per row}),

    with :math:`s = d^{-1/4}` (the scaling RMFA applies to its inputs), so every
    kernel argument satisfies :math:`|\\langle q, k\\rangle| \\le d^{-1/2} < 1` and the
    radius-one kernels stay in their domain. The statistics :math:`\\mu, \\sigma^2`
    (biased variance) are

    * ``stats="token"`` (default, the authors' code): per row over the ``d`` features
      (LayerNorm without affine). Then :math:`x^{\\rm SBN} = s(x - \\bar x)/\\|x - \\bar x\\|`
      exactly, :math:`\\varepsilon` only matters for constant rows, and attention stays
      causal.
    * ``stats="batch"``: per head and feature over the batch and sequence axes (the
      name "batch normalization"); padded keys are left out of the key statistics.
      This mixes information across positions (later tokens would leak into earlier
      outputs), so it is refused with ``causal=True``, whichever map it is combined
      with: :meth:`pre` raises when told ``causal=True`` (feature-map attention passes
      its ``causal`` flag), and RMFA / SchoenbAt refuse it before calling :meth:`pre`.

    A row that is constant (so :math:`x' = 0`) becomes the zero row instead of the
    code's 0/0 NaN.

    **Post-scaling** of the attention output :math:`a` (``[B, H, N, dv]``):

    .. math:: \\mathrm{post}(a) = \\gamma \\cdot \\mathrm{sign}(a)\\,|a|^{\\beta}

    with learnable :math:`\\gamma` and :math:`\\beta` (initialised to 1: the identity).
    The signed power makes negative outputs well defined (Algorithm 1's
    :math:`a^\\beta` is NaN for :math:`a < 0` and non-integer :math:`\\beta`);
    :math:`|a|` is clamped at the smallest normal number inside the power so the
    gradient in :math:`\\beta` (:math:`\\propto \\log|a|`) stays finite at :math:`a = 0`.
    ``power=False`` switches :math:`\\beta` off (:math:`\\gamma a`, as in the released
    LRA code).

    Parameters
    ----------
    eps : float, optional
        Denominator guard of the row normalisation (see
        :class:`~kernelattn_core.interfaces.Normalizer`).
    bn_eps : float
        :math:`\\varepsilon` of the standardisation (1e-12 as in the code; the papers
        say 1e-13).
    stats : {"token", "batch"}
    power : bool
        Learn :math:`\\beta` (the signed power); ``False`` gives :math:`\\gamma a`.
    channels : int, optional
        Per-channel :math:`\\gamma, \\beta` of shape ``[channels]`` (``dv``); scalars by default.
    row_scale : float, optional
        :math:`s`; :math:`d^{-1/4}` when ``None``.

    Attributes
    ----------
    gamma : Parameter ``[]`` or ``[channels]``
    beta : Parameter ``[]`` or ``[channels]`` (absent when ``power=False``)
    """

    name: ClassVar[str] = "ppsbn"
    aliases: ClassVar[tuple[str, ...]] = ("pp-sbn",)
    learnable: ClassVar[bool] = True
    claims: ClassVar[tuple[Any, ...]] = ()

    def __init__(
        self,
        eps: float | None = None,
        *,
        bn_eps: float = 1e-12,
        stats: str = "token",
        power: bool = True,
        channels: int | None = None,
        row_scale: float | None = None,
    ) -> None:
        super().__init__(eps)
        if stats not in STATS:
            raise InputError(f"stats: expected one of {list(STATS)}, got {stats!r}")
        if not (isinstance(bn_eps, int | float) and bn_eps >= 0):
            raise InputError(f"bn_eps: expected a number >= 0, got {bn_eps!r}")
        if channels is not None and (isinstance(channels, bool) or not isinstance(channels, int) or channels < 1):
            raise InputError(f"channels: expected a positive integer or None, got {channels!r}")
        if row_scale is not None and not (isinstance(row_scale, int | float) and row_scale > 0):
            raise InputError(f"row_scale: expected a positive number or None (d^(-1/4)), got {row_scale!r}")
        self.bn_eps = float(bn_eps)
        self.stats = stats
        self.power = bool(power)
        self.channels = channels
        self.row_scale = row_scale
        shape = () if channels is None else (channels,)
        self.gamma = nn.Parameter(torch.ones(shape))
        self.beta = nn.Parameter(torch.ones(shape)) if self.power else None

    # ------------------------------------------------------------------ pre-scaling
    def standardize(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Steps 1-2 of Algorithm 1 on ``x [B, H, N, d]``: unit rows (before :math:`s`).

        ``keep [B, 1, N, 1]`` (bool) selects the rows that enter batch statistics.
        Half inputs are standardised in float32 (``bn_eps = 1e-12`` underflows float16,
        and a constant row, always the case at ``d = 1``, would give 0/0); the result
        is cast back. A constant row gives the zero row in every dtype.
        """
        if x.dtype in (torch.float16, torch.bfloat16):
            return self.standardize(x.float(), keep).to(x.dtype)
        if self.stats == "token":
            mean = x.mean(-1, keepdim=True)
            var = ((x - mean) ** 2).mean(-1, keepdim=True)  # biased
        else:
            w = torch.ones_like(x[..., :1]) if keep is None else keep.to(x.dtype).expand_as(x[..., :1])  # [B,H,N,1]
            count = w.sum(dim=(0, 2), keepdim=True).clamp_min(1.0)  # [1, H, 1, 1]
            mean = (x * w).sum(dim=(0, 2), keepdim=True) / count  # [1, H, 1, d]
            var = (((x - mean) ** 2) * w).sum(dim=(0, 2), keepdim=True) / count
        root = torch.sqrt(var + self.bn_eps)
        xs = (x - mean) / torch.where(root > 0, root, torch.ones_like(root))  # 0/0 (bn_eps = 0): the zero row
        norm = xs.norm(dim=-1, keepdim=True)
        return xs / norm.clamp_min(torch.finfo(x.dtype).tiny)  # a zero row stays zero

    def pre(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-scaled ``q [B, H, N, d]`` and ``k [B, H, M, d]``: rows of norm :math:`s`;
        padded keys (``key_padding_mask [B, M]``) stay out of batch statistics.

        Raises
        ------
        InputError
            ``causal=True`` with ``stats="batch"``: statistics over the sequence axis
            would leak later tokens into earlier outputs.
        """
        if causal and self.stats == "batch":
            raise InputError(
                "causal: ppSBN with stats='batch' mixes statistics over all positions, so later tokens would "
                "reach earlier outputs (a causality leak); use stats='token' for causal attention"
            )
        s = self.row_scale if self.row_scale is not None else q.shape[-1] ** -0.25
        keep = None
        if self.stats == "batch" and key_padding_mask is not None:
            keep = ~key_padding_mask[:, None, :, None]  # [B, 1, M, 1]
        return self.standardize(q) * s, self.standardize(k, keep) * s

    # ------------------------------------------------------------------ post-scaling
    def post(self, out: torch.Tensor) -> torch.Tensor:
        """:math:`\\gamma\\,\\mathrm{sign}(a)|a|^\\beta` (or :math:`\\gamma a`) of ``out [B, H, N, dv]``."""
        gamma = self.gamma.to(out.dtype)
        if self.channels is not None and out.shape[-1] != self.channels:
            raise InputError(f"out: ppSBN has channels = {self.channels}, got value dimension dv = {out.shape[-1]}")
        if self.beta is None:
            return gamma * out
        beta = self.beta.to(out.dtype)
        magnitude = torch.exp(beta * out.abs().clamp_min(torch.finfo(out.dtype).tiny).log())
        return gamma * torch.sign(out) * magnitude

    def extra_repr(self) -> str:
        return (
            f"eps={self.eps}, bn_eps={self.bn_eps}, stats={self.stats!r}, power={self.power}, "
            f"channels={self.channels}, row_scale={self.row_scale}"
        )
