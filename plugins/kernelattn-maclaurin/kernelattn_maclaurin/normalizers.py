"""ppSBN: the pre- and post-scaling "batch normalization" of SchoenbAt / Macformer."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from kernelattn_core import Normalizer
from kernelattn_core.toolkit import InputError

from .claims import OPTION_CLAIMS
from .fast import signed_power, unit_rows

STATS = ("token", "batch")
#: post-scaling forms: Algorithm 1's gamma * a^beta, the §3.2 operator (gamma a)^beta, gamma * a
POST_FORMS = ("gamma_pow", "pow_gamma", "gamma_only")


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

    **Post-scaling** of the attention output :math:`a` (``[B, H, N, dv]``), with learnable
    :math:`\\gamma` and :math:`\\beta` (initialised to 1: the identity), in one of the
    paper's two forms (``post_form``):

    .. math::
        \\texttt{"gamma\\_pow"}: \\ \\gamma \\cdot \\mathrm{sign}(a)\\,|a|^{\\beta}
        \\quad\\text{(Algorithm 1, the default)}, \\qquad
        \\texttt{"pow\\_gamma"}: \\ \\mathrm{sign}(\\gamma a)\\,|\\gamma a|^{\\beta}
        \\quad\\text{(§3.2, } \\overleftarrow{\\mathrm{SBN}}(X; \\gamma, \\beta) = (\\gamma X)^\\beta),

    or ``"gamma_only"``, :math:`\\gamma a` (the released LRA code, which comments the power
    out; ``power=False`` is the same). The paper states both power forms (SchoenbAt spec
    §1.6 and erratum 8): Algorithm 1 and the Theorem 2 proof use :math:`\\gamma \\cdot a^\\beta`,
    the operator definition of §3.2 uses :math:`(\\gamma X)^\\beta`. For :math:`\\gamma > 0` they
    span the same family (:math:`(\\gamma a)^\\beta = \\gamma^\\beta a^\\beta`) but differ in
    parametrisation, gradients and, for :math:`\\gamma < 0`, in sign: with ``"pow_gamma"``
    the sign of the output is that of :math:`\\gamma a`.

    **Where this departs from the paper, and why.** Both printed powers are NaN for a
    negative base and non-integer :math:`\\beta`, and :math:`a` is signed (the values are),
    so the power is the signed power :math:`\\mathrm{sign}(x)|x|^\\beta` (odd extension; equal
    to the printed form wherever that is defined), with :math:`|x|` clamped at the
    smallest normal number inside the power so the gradient in :math:`\\beta`
    (:math:`\\propto \\log|x|`) stays finite at :math:`x = 0`. The default stays Algorithm 1
    (the form the theorems and the authors' top-level code use) so trained models keep
    their meaning; ``post_form="pow_gamma"`` gives the §3.2 operator.

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
        Learn :math:`\\beta` (the signed power); ``False`` gives :math:`\\gamma a`
        (``post_form="gamma_only"``).
    post_form : {"gamma_pow", "pow_gamma", "gamma_only"}, optional
        The post-scaling form (above); ``"gamma_pow"`` when ``None`` (``"gamma_only"`` with
        ``power=False``).
    channels : int, optional
        Per-channel :math:`\\gamma, \\beta` of shape ``[channels]`` (``dv``); scalars by default.
    row_scale : float, optional
        :math:`s`; :math:`d^{-1/4}` when ``None``.

    Attributes
    ----------
    gamma : Parameter ``[]`` or ``[channels]``
    beta : Parameter ``[]`` or ``[channels]`` (``None`` for ``"gamma_only"``)
    post_form : str
    """

    name: ClassVar[str] = "ppsbn"
    aliases: ClassVar[tuple[str, ...]] = ("pp-sbn",)
    learnable: ClassVar[bool] = True
    claims: ClassVar[tuple[Any, ...]] = OPTION_CLAIMS["ppsbn"]

    def __init__(
        self,
        eps: float | None = None,
        *,
        bn_eps: float = 1e-12,
        stats: str = "token",
        power: bool = True,
        channels: int | None = None,
        row_scale: float | None = None,
        post_form: str | None = None,
    ) -> None:
        super().__init__(eps)
        if post_form is not None and post_form not in POST_FORMS:
            raise InputError(f"post_form: expected one of {list(POST_FORMS)} or None, got {post_form!r}")
        if not isinstance(power, bool):
            raise InputError(f"power: expected a bool, got {power!r}")
        if not power and post_form not in (None, "gamma_only"):
            raise InputError(f"power: power=False has no beta, but post_form={post_form!r} raises to beta")
        if post_form is None:
            post_form = "gamma_pow" if power else "gamma_only"
        if stats not in STATS:
            raise InputError(f"stats: expected one of {list(STATS)}, got {stats!r}")
        if isinstance(bn_eps, bool) or not (isinstance(bn_eps, int | float) and math.isfinite(bn_eps) and bn_eps >= 0):
            raise InputError(f"bn_eps: expected a finite number >= 0, got {bn_eps!r}")
        if channels is not None and (isinstance(channels, bool) or not isinstance(channels, int) or channels < 1):
            raise InputError(f"channels: expected a positive integer or None, got {channels!r}")
        if row_scale is not None and (
            isinstance(row_scale, bool)
            or not (isinstance(row_scale, int | float) and math.isfinite(row_scale) and row_scale > 0)
        ):
            raise InputError(f"row_scale: expected a finite number > 0 or None (d^(-1/4)), got {row_scale!r}")
        self.bn_eps = float(bn_eps)
        self.stats = stats
        self.post_form = post_form
        self.power = post_form != "gamma_only"
        self.channels = channels
        self.row_scale = row_scale
        shape = () if channels is None else (channels,)
        self.gamma = nn.Parameter(torch.ones(shape))
        self.beta = nn.Parameter(torch.ones(shape)) if self.power else None

    # ------------------------------------------------------------------ pre-scaling
    def standardize(self, x: torch.Tensor, keep: torch.Tensor | None = None, *, scale: float = 1.0) -> torch.Tensor:
        """Steps 1-2 of Algorithm 1 on ``x [B, H, N, d]``: unit rows, times ``scale``.

        ``keep [B, 1, N, 1]`` (bool) selects the rows that enter batch statistics.
        Half inputs are standardised in float32 (``bn_eps = 1e-12`` underflows float16,
        and a constant row, always the case at ``d = 1``, would give 0/0); the result
        is cast back. A constant row gives the zero row in every dtype, with a zero
        gradient. With token statistics :math:`\\varepsilon` cancels (see the class
        docstring), so the rows are :math:`(x - \\bar x)/\\lVert x - \\bar x\\rVert`, formed in one
        autograd node (:func:`~kernelattn_maclaurin.fast.unit_rows`; its composed form
        and the row-by-row :func:`~kernelattn_maclaurin.naive.pre_sbn_naive` are the
        references).
        """
        if x.dtype in (torch.float16, torch.bfloat16):
            return self.standardize(x.float(), keep, scale=scale).to(x.dtype)
        if self.stats == "token":
            return unit_rows(x, scale)
        w = torch.ones_like(x[..., :1]) if keep is None else keep.to(x.dtype).expand_as(x[..., :1])  # [B,H,N,1]
        count = w.sum(dim=(0, 2), keepdim=True).clamp_min(1.0)  # [1, H, 1, 1]
        mean = (x * w).sum(dim=(0, 2), keepdim=True) / count  # [1, H, 1, d]
        var = (((x - mean) ** 2) * w).sum(dim=(0, 2), keepdim=True) / count
        root = torch.sqrt(var + self.bn_eps)
        xs = (x - mean) / torch.where(root > 0, root, torch.ones_like(root))  # 0/0 (bn_eps = 0): the zero row
        norm = xs.norm(dim=-1, keepdim=True)
        zero = norm == 0  # a constant row: its output is the zero row, with zero gradient
        # (dividing by a clamped norm instead sent g / tiny through 1 / root in the
        # backward: inf - inf = NaN at a constant bfloat16 row, d = 2)
        rows = torch.where(zero, torch.zeros_like(xs), xs / torch.where(zero, torch.ones_like(norm), norm))
        return rows if scale == 1.0 else rows * scale

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
        return self.standardize(q, scale=s), self.standardize(k, keep, scale=s)

    # ------------------------------------------------------------------ post-scaling
    def post(self, out: torch.Tensor) -> torch.Tensor:
        """Post-scaled ``out [B, H, N, dv]``: :math:`\\gamma\\,\\mathrm{sign}(a)|a|^\\beta`
        (``"gamma_pow"``), :math:`\\mathrm{sign}(\\gamma a)|\\gamma a|^\\beta` (``"pow_gamma"``) or
        :math:`\\gamma a` (``"gamma_only"``)."""
        gamma = self.gamma.to(out.dtype)
        if self.channels is not None and out.shape[-1] != self.channels:
            raise InputError(f"out: ppSBN has channels = {self.channels}, got value dimension dv = {out.shape[-1]}")
        if self.beta is None:
            return gamma * out
        beta = self.beta.to(out.dtype)
        if self.post_form == "pow_gamma":
            return signed_power(gamma * out, beta, torch.ones((), dtype=out.dtype, device=out.device))  # (gamma a)^beta
        return signed_power(out, beta, gamma)  # gamma * a^beta, Algorithm 1

    def extra_repr(self) -> str:
        return (
            f"eps={self.eps}, bn_eps={self.bn_eps}, stats={self.stats!r}, post_form={self.post_form!r}, "
            f"channels={self.channels}, row_scale={self.row_scale}"
        )
