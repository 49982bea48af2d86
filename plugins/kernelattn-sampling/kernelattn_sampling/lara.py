"""LARA building blocks: landmarks, proposals (Eq. 32-35), weighting functions
(Eq. 36-38, constant, delta) and the self-normalised MIS estimator (Eq. 10 / 28).

Shapes: batch ``B``, heads ``H``, queries ``N``, keys ``M``, landmarks / proposals
``C``, samples ``S`` (``S = C``, or ``2C`` with antithetic pairs), head dimension ``d``.
Sample ``s`` belongs to proposal ``owner[s] = s mod C``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernelattn_core import InputError

from .functional import (
    NEG_INF,
    draw_indices,
    draw_normal,
    gather_rows,
    key_log_bias,
    safe_softmax_stats,
    target_stats,
)

PROPOSALS = ("eq34", "eq35", "eq33", "eq32", "standard-normal")
WEIGHTINGS = ("decoupled", "coupled", "balance", "constant", "delta")
NEGATIVE_POLICIES = ("clamp", "signed")
R_AXES = ("query", "landmark")
CLAMP_MIN = 1e-8


# --------------------------------------------------------------------------- landmarks
def segment_lengths(n: int, c: int) -> list[int]:
    """Lengths of the ``C`` contiguous 1-D segments of ``N`` tokens (the released code's split).

    When :math:`C \\nmid N` the first :math:`n_f = (\\lfloor N/C\\rfloor + 1)C - N` segments
    have length :math:`\\lfloor N/C\\rfloor` and the other :math:`C - n_f` one more;
    when :math:`N \\le C` every token is its own segment.
    """
    if n <= c:
        return [1] * n
    base = n // c
    n_f = (base + 1) * c - n
    return [base] * n_f + [base + 1] * (c - n_f)


def segment_means(x: torch.Tensor, c: int, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment means ``[B, H, C', d]`` of ``x [B, H, N, d]`` and which segments hold a
    kept token ``[B or 1, C']`` (``[B, H, C']`` for a per-head ``keep``; ``C' = min(C, N)``).

    ``keep [B, N]`` or ``[B, H, N]`` (bool) excludes tokens (padded keys, non-finite
    queries) from the means: they are replaced by 0 before the product, so whatever they
    hold reaches no landmark. A segment with no kept token gets a zero landmark.
    """
    n = x.shape[-2]
    lengths = segment_lengths(n, c)
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=x.device), torch.tensor(lengths, device=x.device))
    member = F.one_hot(seg, len(lengths)).T.to(x.dtype).unsqueeze(0)  # [1, C', N]
    if keep is not None and keep.dim() == 3:
        x = x.masked_fill(~keep[..., None], 0.0)
        member = member.unsqueeze(0) * keep[:, :, None, :].to(x.dtype)  # [B, H, C', N]
        count = member.sum(-1, keepdim=True)  # [B, H, C', 1]
        return (member / count.clamp_min(1)) @ x, count.squeeze(-1) > 0
    if keep is not None:
        x = x.masked_fill(~keep[:, None, :, None], 0.0)
        member = member * keep[:, None, :].to(x.dtype)  # [B, C', N]
    count = member.sum(-1, keepdim=True)  # [B, C', 1]
    avg = member / count.clamp_min(1)
    return avg.unsqueeze(1) @ x, count.squeeze(-1) > 0  # [B, H, C', d], [B, C']


def pooled_means(
    x: torch.Tensor, grid: tuple[int, int], pool: tuple[int, int], keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D adaptive average pooling of an image grid of tokens to ``pool`` landmarks.

    ``x [B, H, gh*gw, d]`` (row-major grid) gives ``[B, H, ph*pw, d]`` and the kept
    landmark mask ``[B or 1, ph*pw]``. ``keep [B, N]`` or ``[B, H, N]`` excludes tokens
    (replaced by 0 before pooling).
    """
    b, h, n, d = x.shape
    gh, gw = grid
    if n != gh * gw:
        raise InputError(f"grid: expected {gh} x {gw} = {gh * gw} tokens, got a sequence of {n}")
    img = x.transpose(-1, -2).reshape(b * h, d, gh, gw)  # [B*H, d, gh, gw]
    if keep is None:
        pooled = F.adaptive_avg_pool2d(img, pool)
        ok = torch.ones(1, pool[0] * pool[1], dtype=torch.bool, device=x.device)
    else:
        keep = keep if keep.dim() == 3 else keep[:, None, :].expand(b, h, n)  # [B, H, N]
        w = keep.to(x.dtype).reshape(b * h, 1, gh, gw)
        img = img.masked_fill(~keep.reshape(b * h, 1, gh, gw), 0.0)
        num = F.adaptive_avg_pool2d(img * w, pool)
        den = F.adaptive_avg_pool2d(w, pool)  # [B*H, 1, ph, pw]
        pooled = num / den.clamp_min(1e-30)
        pooled = torch.where(den > 0, pooled, torch.zeros_like(pooled))
        ok = den.reshape(b, h, -1)[:, 0] > 0
    return pooled.reshape(b, h, d, -1).transpose(-1, -2), ok


# --------------------------------------------------------------------------- proposals
@dataclass
class Proposals:
    """``C`` proposals: Gaussians :math:`N(\\mu_c, I)`, or Gaussian mixtures
    :math:`\\sum_m \\pi_{cm} N(b_c + k_m, I)` (Eq. 32; with the tokens as landmarks these
    are the exact targets :math:`p_n`).

    Attributes
    ----------
    mean : Tensor ``[B, H, C, d]``
        Gaussian means, or the mixture bases :math:`b_c`.
    log_pi : Tensor ``[B, H, C, M]`` or None
        Mixture log weights (None for Gaussians).
    keys : Tensor ``[B, H, M, d]`` or None
        Mixture component offsets :math:`k_m`.
    """

    mean: torch.Tensor
    log_pi: torch.Tensor | None = None
    keys: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return self.mean.shape[-2]

    def expected(self) -> torch.Tensor:
        """Proposal means ``[B, H, C, d]`` (the evaluation-mode samples)."""
        if self.log_pi is None:
            return self.mean
        return self.mean + self.log_pi.exp() @ self.keys

    def log_ratio(self, omega: torch.Tensor) -> torch.Tensor:
        """:math:`L_{sc} = \\log q_c(\\omega_s) - \\log N(\\omega_s; 0, I)`, ``[B, H, S, C]``.

        For a Gaussian this is :math:`\\log\\xi(\\mu_c, \\omega_s) = \\omega_s^\\top\\mu_c - \\tfrac12\\|\\mu_c\\|^2`.
        """
        mu = self.mean
        if self.log_pi is None:
            return omega @ mu.transpose(-1, -2) - 0.5 * (mu * mu).sum(-1).unsqueeze(-2)  # [B, H, S, C]
        k = self.keys
        wk = omega @ k.transpose(-1, -2)  # [B, H, S, M]
        bk = mu @ k.transpose(-1, -2)  # [B, H, C, M]
        sq = (mu * mu).sum(-1, keepdim=True) + 2 * bk + (k * k).sum(-1).unsqueeze(-2)  # [B, H, C, M]: |b_c + k_m|^2
        inner = self.log_pi.unsqueeze(-3) + wk.unsqueeze(-2) - 0.5 * sq.unsqueeze(-3)  # [B, H, S, C, M]
        return omega @ mu.transpose(-1, -2) + torch.logsumexp(inner, -1)  # [B, H, S, C]

    def sample(
        self, noise_std: float, generator: torch.Generator | None, antithetic: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sample per proposal (two with antithetic pairs :math:`\\mu \\pm \\epsilon`):
        ``omega [B, H, S, d]`` and ``owner [S]``."""
        centre = self.mean
        if self.log_pi is not None:
            idx = draw_indices(self.log_pi.exp(), 1, generator)  # [B, H, C, 1]
            centre = centre + gather_rows(self.keys, idx).squeeze(3)
        eps = noise_std * draw_normal(tuple(centre.shape), centre, generator)
        omega = torch.cat([centre + eps, centre - eps], dim=-2) if antithetic else centre + eps
        owner = torch.arange(omega.shape[-2], device=omega.device) % self.count
        return omega, owner


def make_proposals(
    kind: str,
    q_land: torch.Tensor,
    k_land: torch.Tensor,
    k: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    k_land_ok: torch.Tensor | None = None,
) -> Proposals:
    """Proposals from landmarks ``q_land, k_land [B, H, C, d]``.

    * ``eq34`` (default): :math:`\\mu_c = \\tilde q_c + \\tilde k_c`
    * ``eq35`` (corrected):
      :math:`\\mu_c = \\tilde q_c + \\sum_{c'} \\mathrm{softmax}_{c'}(\\tilde k_c^\\top\\tilde k_{c'})\\,\\tilde k_{c'}`
    * ``eq33``: :math:`\\mu_c = \\tilde q_c + \\sum_m \\mathrm{softmax}_m(\\tilde q_c^\\top k_m) k_m`
    * ``eq32``: the mixture :math:`\\sum_m \\mathrm{softmax}_m(\\tilde q_c^\\top k_m) N(\\tilde q_c + k_m, I)`
    * ``standard-normal``: :math:`\\mu_c = 0` (RFA)
    """
    if kind == "eq34":
        return Proposals(q_land + k_land)
    if kind == "standard-normal":
        return Proposals(torch.zeros_like(q_land))
    if kind == "eq35":
        logits = k_land @ k_land.transpose(-1, -2)  # [B, H, C, C]
        if k_land_ok is not None:
            logits = logits.masked_fill(~k_land_ok[:, None, None, :], NEG_INF)
        return Proposals(q_land + safe_softmax_stats(logits, k_land)[1])
    logits = q_land @ k.transpose(-1, -2) + key_log_bias(torch.zeros_like(k), key_padding_mask)  # [B, H, C, M]
    if kind == "eq33":
        return Proposals(q_land + safe_softmax_stats(logits, k)[1])
    if kind == "eq32":
        return Proposals(q_land, torch.log_softmax(logits, -1), k)
    raise InputError(f"proposal: expected one of {list(PROPOSALS)}, got {kind!r}")


# --------------------------------------------------------------------------- weighting functions
def r_prime(
    q: torch.Tensor, q_land: torch.Tensor, axis: str = "query", q_keep: torch.Tensor | None = None
) -> torch.Tensor:
    """:math:`r'_{nc} = \\exp(q_n^\\top\\tilde q_c) / \\sum_{n'} \\exp(q_{n'}^\\top\\tilde q_c)`
    (``axis="query"``, the released code's reading of Eq. 37) or normalised over
    landmarks ``c`` (``axis="landmark"``), ``[B, H, N, C]``.

    ``q_keep [B, H, N]`` (bool) leaves queries out of the sum over ``n'`` (a non-finite
    query would otherwise reach every row); their own ``r'`` is 0, and so is every ``r'`` of
    a sequence none of whose queries is kept (all padding: a softmax over nothing, not 0/0)."""
    logits = q @ q_land.transpose(-1, -2)  # [B, H, N, C]
    if q_keep is not None and axis == "query":
        logits = logits.masked_fill(~q_keep[..., None], NEG_INF)
        logits = torch.where(q_keep.any(-1)[..., None, None], logits, 0.0)  # finite, then zeroed below
        return torch.softmax(logits, dim=-2).masked_fill(~q_keep[..., None], 0.0)
    return torch.softmax(logits, dim=-2 if axis == "query" else -1)


def log_abs_density(log_ratio: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """:math:`\\log q_c(\\omega_s)` ``[B, H, S, C]`` from :math:`L_{sc}`."""
    d = omega.shape[-1]
    return log_ratio + (-0.5 * (omega * omega).sum(-1, keepdim=True) - 0.5 * d * math.log(2 * math.pi))


def weight_table(
    kind: str,
    log_ratio: torch.Tensor,
    omega: torch.Tensor,
    rp: torch.Tensor | None,
    beta: float = 1.0,
) -> torch.Tensor:
    """Every weight :math:`\\alpha_{nc}(\\omega_s)` at every point, ``[B, H, N, S, C]`` (reference).

    * constant: :math:`1/C`
    * balance (Eq. 36): :math:`\\alpha_c(\\omega) = q_c(\\omega)/\\sum_{c'} q_{c'}(\\omega)`
    * coupled (Eq. 37): balance
      :math:`+\\,\\beta\\, q_c(\\omega)\\,(r'_{nc} - \\sum_{c'} \\alpha^{BH}_{c'}(\\omega) r'_{nc'})`
    * decoupled (Eq. 38): balance :math:`+\\,\\beta\\,(r'_{nc} - \\frac1C\\sum_{c'} r'_{nc'})`
    * delta: :math:`\\delta_{nc}` (needs ``C = N``)

    Each sums to one over ``c`` at any common point :math:`\\omega`.
    """
    b, h, s, c = log_ratio.shape
    n = rp.shape[-2] if rp is not None else 1
    bh = torch.softmax(log_ratio, -1).unsqueeze(2).expand(b, h, n, s, c)  # [B, H, N, S, C]
    if kind == "constant":
        return torch.full_like(bh, 1.0 / c)
    if kind == "balance":
        return bh
    if kind == "delta":
        if n != c:
            raise InputError(f"weighting: 'delta' needs as many proposals as queries, got C = {c}, N = {n}")
        eye = torch.eye(c, dtype=bh.dtype, device=bh.device)[None, None, :, None, :]  # [1, 1, N, 1, C]
        return eye.expand(b, h, n, s, c)
    assert rp is not None
    if kind == "decoupled":
        corr = rp - rp.mean(-1, keepdim=True)  # [B, H, N, C]
        return bh + beta * corr.unsqueeze(3)
    if kind == "coupled":
        dens = log_abs_density(log_ratio, omega).exp().unsqueeze(2)  # [B, H, 1, S, C]
        mix = rp @ torch.softmax(log_ratio, -1).transpose(-1, -2)  # [B, H, N, S]: sum_c' BH_c'(w_s) r'_nc'
        return bh + beta * dens * (rp.unsqueeze(3) - mix.unsqueeze(-1))
    raise InputError(f"weighting: expected one of {list(WEIGHTINGS)}, got {kind!r}")


def realized_weights(
    kind: str,
    log_ratio: torch.Tensor,
    omega: torch.Tensor,
    owner: torch.Tensor,
    rp: torch.Tensor | None,
    beta: float,
    n: int,
) -> tuple[torch.Tensor, bool]:
    """Weights :math:`\\alpha_{n,c(s)}(\\omega_s)` of the drawn samples (fast path of
    :func:`weight_table` gathered at ``owner``).

    Returns ``(w, is_log)``: log weights ``[B, H, 1 or N, S]`` for the non-negative
    kinds (constant, balance, delta), plain signed weights ``[B, H, N, S]`` otherwise.
    """
    b, h, s, c = log_ratio.shape
    own = owner.view(1, 1, s, 1).expand(b, h, s, 1)
    log_bh = torch.log_softmax(log_ratio, -1).gather(-1, own).squeeze(-1).unsqueeze(2)  # [B, H, 1, S]
    if kind == "constant":
        return torch.full_like(log_bh, -math.log(c)), True
    if kind == "balance":
        return log_bh, True
    if kind == "delta":
        if n != c:
            raise InputError(f"weighting: 'delta' needs as many proposals as queries, got C = {c}, N = {n}")
        hit = torch.arange(n, device=owner.device)[:, None] == owner[None, :]  # [N, S]
        zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
        return torch.where(hit, zero, torch.full_like(zero, NEG_INF)).expand(b, h, n, s), True
    assert rp is not None
    r_own = rp[..., owner]  # [B, H, N, S]
    if kind == "decoupled":
        return log_bh.exp() + beta * (r_own - rp.mean(-1, keepdim=True)), False
    if kind == "coupled":
        dens = log_abs_density(log_ratio, omega).gather(-1, own).squeeze(-1).exp().unsqueeze(2)  # [B, H, 1, S]
        mix = rp @ torch.softmax(log_ratio, -1).transpose(-1, -2)  # [B, H, N, S]
        return log_bh.exp() + beta * dens * (r_own - mix), False
    raise InputError(f"weighting: expected one of {list(WEIGHTINGS)}, got {kind!r}")


# --------------------------------------------------------------------------- estimator
def lara_from_samples(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    omega: torch.Tensor,
    owner: torch.Tensor,
    proposals: Proposals,
    *,
    weighting: str = "decoupled",
    q_land: torch.Tensor | None = None,
    beta: float = 1.0,
    r_axis: str = "query",
    negative_weights: str = "clamp",
    key_padding_mask: torch.Tensor | None = None,
    q_keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Self-normalised MIS (Eq. 10 / Eq. 28) in log space.

    .. math:: y_n = \\frac{\\sum_s \\alpha_{n c(s)}(\\omega_s)\\,
              \\frac{\\xi(q_n, \\omega_s) D(\\omega_s)}{\\xi(\\mu_{c(s)}, \\omega_s)}\\, f(\\omega_s)}
              {\\sum_s \\alpha_{n c(s)}(\\omega_s)\\,
              \\frac{\\xi(q_n, \\omega_s) D(\\omega_s)}{\\xi(\\mu_{c(s)}, \\omega_s)}}

    with :math:`\\xi(\\mu_c, \\omega) = q_c(\\omega)/N(\\omega; 0, I)` (for mixtures the
    ratio :func:`Proposals.log_ratio`) and the query factor
    :math:`e^{-\\|q_n\\|^2/2}` dropped (it cancels).

    Parameters
    ----------
    q, k, v : Tensor ``[B, H, N, d]``, ``[B, H, M, d]``, ``[B, H, M, dv]``
    omega : Tensor ``[B, H, S, d]``
    owner : Tensor ``[S]`` of int
        The proposal each sample was drawn from.
    proposals : Proposals
    weighting, beta, r_axis
        See :func:`weight_table` and :func:`r_prime` (``q_land`` is needed for the
        coupled and decoupled weights).
    negative_weights : {"clamp", "signed"}
        ``clamp``: :math:`\\alpha \\leftarrow \\max(\\alpha, 10^{-8})` (released code);
        ``signed``: exact signed arithmetic, the normaliser may approach zero.
    q_keep : Tensor ``[B, H, N]`` of bool, optional
        Queries that enter statistics shared by all rows (:func:`r_prime`); a
        non-finite query only affects its own row.

    Returns
    -------
    Tensor ``[B, H, N, dv]``
    """
    log_den, ybar = target_stats(omega, k, v, key_log_bias(k, key_padding_mask))  # [B,H,S], [B,H,S,dv]
    lr = proposals.log_ratio(omega)  # [B, H, S, C]
    rho = lr.gather(-1, owner.view(1, 1, -1, 1).expand(*lr.shape[:3], 1)).squeeze(-1)  # [B, H, S]
    base = q @ omega.transpose(-1, -2) + (log_den - rho).unsqueeze(-2)  # [B, H, N, S]
    rp = None
    if weighting in ("coupled", "decoupled"):
        if q_land is None:
            raise InputError(f"q_land: weighting {weighting!r} needs the query landmarks")
        rp = r_prime(q, q_land, r_axis, q_keep)
    w, is_log = realized_weights(weighting, lr, omega, owner, rp, beta, q.shape[-2])
    if is_log:
        return safe_softmax_stats(base + w, ybar)[1]
    if negative_weights == "clamp":
        return safe_softmax_stats(base + w.clamp_min(CLAMP_MIN).log(), ybar)[1]
    if negative_weights != "signed":
        raise InputError(f"negative_weights: expected one of {list(NEGATIVE_POLICIES)}, got {negative_weights!r}")
    top = base.detach().amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    a = w * (base - top).exp()  # [B, H, N, S]
    den = a.sum(-1, keepdim=True)
    return (a @ ybar) / torch.where(den == 0, torch.ones_like(den), den)
