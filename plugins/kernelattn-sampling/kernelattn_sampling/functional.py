"""Vectorised building blocks of RA, RFA-SNIS and LARA, all in log space.

Every function works in the scaled coordinates of the core (q and k already
multiplied by :math:`d^{-1/4}`), where the Performer positive randomized mapping is

.. math:: \\xi(x, \\omega) = \\exp(\\omega^\\top x - \\tfrac12 \\|x\\|^2)

and every Gaussian has unit covariance. The factor :math:`\\xi(q_n, \\omega)` is
constant over keys and cancels in the target function, which is therefore

.. math:: f(\\omega) = \\sum_m \\mathrm{softmax}_m(\\omega^\\top k_m - \\tfrac12\\|k_m\\|^2)\\, v_m .
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from kernelattn_core.toolkit import all_finite, exp_kept, finite_rows

NEG_INF = float("-inf")


# --------------------------------------------------------------------------- generic helpers
def drop_padded(
    k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k [B, H, M, d]`` and ``v [B, H, M, dv]`` with padded positions *replaced* by 0.

    No query sees a padded key, so whatever it holds (NaN, inf) is removed before any
    product: :math:`0 \\cdot \\mathrm{NaN}` would otherwise reach every row.
    """
    if key_padding_mask is None:
        return k, v
    pad = key_padding_mask[:, None, :, None]  # [B, 1, M, 1]
    return k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)


def visible_matmul(w: torch.Tensor, x: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """``w @ x`` where row ``i`` may only see the entries ``j`` with ``visible[i, j]``.

    ``w [..., X, M]`` is zero outside ``visible`` (bool, broadcastable to ``w``) and
    ``x [..., M, dv]``. A plain product gives :math:`0 \\cdot \\mathrm{NaN} = \\mathrm{NaN}`
    in every row when some ``x_j`` is not finite, including rows that must not see it
    (a later position under the causal mask). Non-finite entries are therefore replaced
    by 0 in the product and the output is set to NaN exactly where a *visible* ``j``
    holds a non-finite entry in that column, as an exact computation would give.
    """
    if all_finite(x):  # one sum: the common case pays no x-sized mask
        return w @ x
    finite = torch.isfinite(x)
    out = w @ torch.where(finite, x, torch.zeros_like(x))
    seen = (visible.to(x.dtype) @ (~finite).to(x.dtype)) > 0  # [..., X, dv]
    return out.masked_fill(seen, float("nan"))


def scores(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``x @ k^T`` ``[..., X, M]`` that keeps a non-finite key ``k_j`` in its own column.

    Forward, ``x @ k^T`` already confines it to column ``j`` (set to NaN here), which
    the caller then replaces by ``-inf`` wherever ``j`` is masked. The backward pass of a
    plain product, however, computes ``grad_x = G @ k`` and :math:`0 \\cdot \\mathrm{NaN}`
    would give every row a NaN gradient; the product is therefore taken with
    non-finite keys replaced by 0.
    """
    finite = finite_rows(k)  # [..., M]
    if bool(finite.all()):
        return x @ k.transpose(-1, -2)
    out = x @ k.masked_fill(~finite[..., None], 0.0).transpose(-1, -2)
    return out.masked_fill(~finite[..., None, :], float("nan"))


def safe_softmax_stats(logits: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-normaliser and softmax average of ``values``, safe for all ``-inf`` rows.

    Parameters
    ----------
    logits : Tensor ``[..., X, M]``
    values : Tensor ``[..., M, dv]`` (broadcast against ``logits``)

    Returns
    -------
    log_den : Tensor ``[..., X]``
        :math:`\\log\\sum_m e^{\\ell_m}`; ``-inf`` when every logit is ``-inf``.
    mean : Tensor ``[..., X, dv]``
        :math:`\\sum_m \\mathrm{softmax}_m(\\ell)\\, v_m`; zeros when every logit is ``-inf``.

    The row maximum is an exact stabiliser (it cancels); it is detached, which leaves
    every gradient unchanged. An all ``-inf`` row has zero gradients: its ``-inf``
    log-normaliser is a constant (the logarithm is taken of 1 there and replaced), so
    no :math:`0/0` of the logarithm's backward reaches the logits (or whatever made them,
    such as the samples of a sequence whose keys are all padded).
    """
    top = logits.detach().amax(-1, keepdim=True)  # [..., X, 1]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    visible = logits != NEG_INF  # a -inf logit is a masked (or weightless) key: its value is never seen
    w = exp_kept(logits - top, visible)  # [..., X, M]; exp's fast path (no -inf argument)
    den = w.sum(-1, keepdim=True)  # [..., X, 1]
    empty = den == 0
    safe_den = torch.where(empty, torch.ones_like(den), den)
    mean = visible_matmul(w, values, visible) / safe_den  # [..., X, dv]
    log_den = torch.where(empty, torch.full_like(den, NEG_INF), safe_den.log() + top)
    return log_den.squeeze(-1), mean


def key_log_bias(k: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    """:math:`-\\tfrac12\\|k_m\\|^2` with ``-inf`` at padded keys, ``[B, H, 1, M]``."""
    bias = -0.5 * (k * k).sum(-1).unsqueeze(-2)  # [B, H, 1, M]
    if key_padding_mask is not None:
        bias = bias.masked_fill(key_padding_mask[:, None, None, :], NEG_INF)
    return bias


def causal_allowed(n: int, m: int, device: torch.device) -> torch.Tensor:
    """``[N, M]`` bool, ``True`` where key ``j <= i`` (query ``i`` may see it)."""
    return torch.ones(n, m, dtype=torch.bool, device=device).tril()


def causal_bias(n: int, m: int, like: torch.Tensor) -> torch.Tensor:
    """``[N, M]`` with 0 where key ``j <= i`` and ``-inf`` after."""
    allowed = torch.ones(n, m, dtype=torch.bool, device=like.device).tril()
    return torch.zeros(n, m, dtype=like.dtype, device=like.device).masked_fill(~allowed, NEG_INF)


def target_stats(
    omega: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key statistics of samples: :math:`\\log D(\\omega)` and :math:`f(\\omega)`.

    .. math:: \\log D(\\omega) = \\log\\sum_m \\xi(k_m, \\omega), \\qquad
              f(\\omega) = \\sum_m \\frac{\\xi(k_m,\\omega)}{D(\\omega)} v_m

    Parameters
    ----------
    omega : Tensor ``[B, H, X, d]``
    k : Tensor ``[B, H, M, d]``
    v : Tensor ``[B, H, M, dv]``
    bias : Tensor broadcastable to ``[B, H, X, M]``
        :func:`key_log_bias` (``-inf`` at padded keys).
    allowed : Tensor of bool broadcastable to ``[B, H, X, M]``, optional
        Which keys each sample may see (the causal mask); the others' logits are
        *replaced* by ``-inf``, so a later key holding NaN or inf reaches no earlier row.

    Returns
    -------
    log_den ``[B, H, X]`` and f ``[B, H, X, dv]``.
    """
    lk = scores(omega, k) + bias  # [B, H, X, M]
    if allowed is not None:
        lk = lk.masked_fill(~allowed, NEG_INF)
    return safe_softmax_stats(lk, v)


def softmax_probs(
    q: torch.Tensor, k: torch.Tensor, key_padding_mask: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """Exact attention probabilities :math:`\\pi_{nm}` ``[B, H, N, M]`` (zero rows when
    no key is allowed)."""
    logits = scores(q, k)  # [B, H, N, M]
    if key_padding_mask is not None:
        logits = logits.masked_fill(key_padding_mask[:, None, None, :], NEG_INF)
    if causal:  # replaced, never added to: NaN + (-inf) would stay NaN
        logits = logits.masked_fill(~causal_allowed(q.shape[-2], k.shape[-2], q.device), NEG_INF)
    top = logits.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = exp_kept(logits - top, logits != NEG_INF)  # exp's fast path (no -inf argument)
    den = w.sum(-1, keepdim=True)
    return w / torch.where(den == 0, torch.ones_like(den), den)


# --------------------------------------------------------------------------- random draws
def draw_normal(shape: tuple[int, ...], like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Standard normal draws of ``shape`` (on the generator's device, then moved to ``like``),
    drawn in float64 for float64 ``like`` and in float32 otherwise: torch's float64 normal
    draws with a generator take about six times as long on the CPU (262K draws, one thread:
    5.7 vs 0.9 ms, a tenth of an RA training step at the task benchmarks' shape). So a
    float32 and a float64 call with the same seed see different noise (each is N(0, 1))."""
    device = generator.device if generator is not None else like.device
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    return torch.randn(shape, generator=generator, device=device, dtype=dtype).to(like.device, like.dtype)


def draw_indices(probs: torch.Tensor, samples: int, generator: torch.Generator | None) -> torch.Tensor:
    """Categorical indices ``[..., samples]`` from the rows of ``probs [..., M]``.

    Inverse-CDF draws: with :math:`c_i = \\sum_{j \\le i} p_j` (float64) and
    :math:`u \\sim U[0, 1)`, the index is the first :math:`i` with :math:`c_i > u\\, c_{M-1}`, so
    :math:`P(i) = p_i / \\sum_j p_j` and a zero-probability key is never drawn (a draw that
    rounding puts past the end goes to the first index where the sum is complete, a
    positive entry). Two passes over the rows (the float64 copy and its ``cumsum``) and one
    ``searchsorted``: ``torch.multinomial`` spends an exponential draw, an ``abs`` and an
    ``argmax`` on every element (the RA layer of the task benchmarks, ``[8192, 128]`` rows,
    1 thread: 74.7 -> 55 ms per forward and backward).

    Rows of zeros (no allowed key) draw uniformly; their outputs are zeroed later.
    """
    *lead, m = probs.shape
    cdf = probs.detach().reshape(-1, m).to(torch.float64).cumsum(-1)  # [rows, M]: non-decreasing (p >= 0)
    total = cdf[:, -1:]  # [rows, 1]: not finite iff the row holds a non-finite entry
    # rows with no allowed key, or that see a non-finite key (their output is NaN anyway)
    empty = ~(torch.isfinite(total) & (total > 0))
    device = generator.device if generator is not None else cdf.device
    u = torch.rand(cdf.shape[0], samples, generator=generator, device=device, dtype=torch.float64).to(cdf.device)
    idx = torch.where(empty, (u * m).long().clamp_max(m - 1), inverse_cdf(cdf, u))
    return idx.to(probs.device).reshape(*lead, samples)


def inverse_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Indices ``[..., S]``: for each uniform ``u [..., S]`` in ``[0, 1)`` the first ``i``
    with :math:`c_i > u\\, c_{M-1}` in ``cdf [..., M]`` (a cumulative sum of non-negative
    weights), so :math:`P(i) = p_i / \\sum_j p_j` and a zero weight is never picked. A
    product that rounds up to the total (``u`` within ``2^{-53}`` of 1) would fall past
    the end; it takes the first index at which the sum is complete instead, a positive
    entry (clamping to ``M - 1`` could pick a masked or future key of zero weight)."""
    total = cdf[..., -1:].contiguous()
    idx = torch.searchsorted(cdf, u * total, right=True)
    return torch.where(idx >= cdf.shape[-1], torch.searchsorted(cdf, total), idx)


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x [B, H, M, d]`` rows picked by ``idx [B, H, N, S]``, giving ``[B, H, N, S, d]``."""
    b, h, n, s = idx.shape
    m, d = x.shape[-2:]
    flat = idx.reshape(b, h, n * s, 1).expand(b, h, n * s, d)
    return torch.gather(x.expand(b, h, m, d), 2, flat).reshape(b, h, n, s, d)


def noise_std_value(noise_std: float | str, head_dim: int) -> float:
    """The noise standard deviation in scaled coordinates: 1 for ``"paper"``,
    :math:`d^{-1/4}` for ``"code"`` (the released code), or the number given."""
    if noise_std == "paper":
        return 1.0
    if noise_std == "code":
        return head_dim**-0.25
    return float(noise_std)


# --------------------------------------------------------------------------- RA
def ra_from_samples(
    omega: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Randomized attention from given samples: :math:`\\frac1S \\sum_s f(\\omega_{ns})`.

    Parameters
    ----------
    omega : Tensor ``[B, H, N, S, d]``
        Samples of each query's target :math:`p_n` (or of any other distribution).
    k, v : Tensor ``[B, H, M, d]``, ``[B, H, M, dv]``

    Returns
    -------
    Tensor ``[B, H, N, dv]``
    """
    return samples_output(omega, k, v, *_sample_masks(omega, k, key_padding_mask, causal))


def _sample_masks(
    omega: torch.Tensor, k: torch.Tensor, key_padding_mask: torch.Tensor | None, causal: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(bias [B, H, 1, M], allowed [N*S, M] or None)`` of :func:`samples_output` for the
    samples ``omega [B, H, N, S, d]`` of every query."""
    _, _, n, s, _ = omega.shape
    bias = key_log_bias(k, key_padding_mask)
    allowed = causal_allowed(n, k.shape[-2], k.device).repeat_interleave(s, dim=0) if causal else None
    return bias, allowed


def samples_output(
    omega: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, allowed: torch.Tensor | None
) -> torch.Tensor:
    """:math:`\\frac1S \\sum_s f(\\omega_{ns})` ``[B, H, N, dv]`` of samples ``omega [B, H, N, S, d]``
    given the keys' log bias ``[B, H, 1, M]`` (:func:`key_log_bias`) and the pairs each
    sample may see (``allowed [N*S, M]``, ``None``: every key)."""
    b, h, n, s, d = omega.shape
    _, f = target_stats(omega.reshape(b, h, n * s, d), k, v, bias, allowed)  # [B, H, N*S, dv]
    return f.reshape(b, h, n, s, -1).mean(3)


def output_isolated(
    output_of: Callable[[torch.Tensor], torch.Tensor], omega: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(output_of(omega), rows)``, the rows ``[B, H, N]`` whose output overflows (``None``
    when none does) computed again with their samples replaced by 0: see
    :func:`ra_from_samples_isolated`."""
    out = output_of(omega)
    rows = ~finite_rows(out.detach())  # [B, H, N]
    if not bool(rows.any()):
        return out, None
    return output_of(omega.masked_fill(rows[..., None, None], 0.0)), rows


def ra_from_samples_isolated(
    omega: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`ra_from_samples` whose overflowing rows send no gradient back: ``(out, rows)``.

    Finite but huge inputs (a float32 key of 1e30) overflow :math:`f(\\omega)` in the rows
    whose samples or keys reach them; the backward of such a row is :math:`0 \\cdot \\infty`
    into every key and value it sees, earlier ones included, even when no loss reads it.
    Those rows (``rows [B, H, N]``, ``None`` when there are none) are computed again with
    their samples replaced by 0, which cuts them from the samples' graph and keeps their
    products finite; the caller makes them NaN, as exact attention gives a row whose kernel
    overflows. One extra call of :func:`samples_output` only when a row overflows."""
    bias, allowed = _sample_masks(omega, k, key_padding_mask, causal)
    return output_isolated(functools.partial(samples_output, k=k, v=v, bias=bias, allowed=allowed), omega)


def ra_samples(
    q: torch.Tensor,
    k: torch.Tensor,
    probs: torch.Tensor,
    samples: int,
    noise_std: float,
    generator: torch.Generator | None,
    *,
    sample_index: bool = True,
    noise: bool = True,
    counter_seed: int | None = None,
) -> torch.Tensor:
    """Samples ``[B, H, N, S, d]`` of RA (Eq. 30) or of RA-biased (Eq. 31).

    .. math:: \\omega_{ns} = q_n + k_{z_{ns}} + \\sigma\\epsilon_{ns}, \\quad
              z_{ns} \\sim \\mathrm{Categorical}(\\pi_n)  \\qquad \\text{(RA)}

    .. math:: \\omega_{ns} = q_n + \\textstyle\\sum_m \\pi_{nm} k_m + \\sigma\\epsilon_{ns}
              \\qquad \\text{(RA-biased, ``sample_index=False``)}

    With ``counter_seed`` the draws are position-addressed (:func:`counter_uniform`)
    instead of coming from ``generator``.
    """
    if sample_index:
        if counter_seed is None:
            idx = draw_indices(probs, samples, generator)
        else:
            idx = counter_indices(probs, samples, counter_seed, stream=0)
        centre = gather_rows(k, idx)  # [B, H, N, S, d]
    else:
        centre = (
            visible_matmul(probs, k, probs != 0).unsqueeze(3).expand(*q.shape[:3], samples, q.shape[-1])
        )  # [B, H, N, S, d]
    omega = q.unsqueeze(3) + centre
    if noise and noise_std != 0:
        if counter_seed is None:
            eps = draw_normal(tuple(omega.shape), omega, generator)
        else:
            eps = counter_normal(counter_seed, tuple(omega.shape), 1, omega)
        omega = omega + noise_std * eps
    return omega


# --------------------------------------------------------------------------- RFA as SNIS
def rfa_from_samples(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, omega: torch.Tensor, key_padding_mask: torch.Tensor | None
) -> torch.Tensor:
    """RFA (Eq. 2) in the stable log-space form of the spec (non-causal).

    .. math:: \\bar y_s = f(\\omega_s), \\quad
              y_n = \\sum_s \\mathrm{softmax}_s\\big(\\omega_s^\\top q_n + \\log D(\\omega_s)\\big)\\, \\bar y_s

    ``omega [S, d]`` (shared by batch and heads) or ``[B, H, S, d]``.
    """
    if omega.dim() == 2:
        omega = omega.expand(*q.shape[:2], *omega.shape)
    log_den, ybar = target_stats(omega, k, v, key_log_bias(k, key_padding_mask))  # [B,H,S], [B,H,S,dv]
    logits = q @ omega.transpose(-1, -2) + log_den.unsqueeze(-2)  # [B, H, N, S]
    return safe_softmax_stats(logits, ybar)[1]


def log_standard_normal(omega: torch.Tensor) -> torch.Tensor:
    """:math:`\\log \\mathcal N(\\omega; 0, I)` over the last axis."""
    d = omega.shape[-1]
    return -0.5 * (omega * omega).sum(-1) - 0.5 * d * math.log(2 * math.pi)


# --------------------------------------------------------------------------- counter-based draws (evaluation)
_M32 = 0xFFFFFFFF


def _pcg_hash(x: torch.Tensor) -> torch.Tensor:
    """PCG output permutation on 32-bit words held in int64 (no overflow: factors < 2^30)."""
    x = (x * 747796405 + 2891336453) & _M32
    w = (((x >> ((x >> 28) + 4)) ^ x) * 277803737) & _M32
    return ((w >> 22) ^ w) & _M32


def counter_uniform(seed: int, shape: tuple[int, ...], stream: int, device: torch.device) -> torch.Tensor:
    """Uniforms in (0, 1), float64, addressed by position: element ``(i_0, ..., i_r)`` is a
    hash of ``(seed, stream, i_0, ..., i_r)``.

    Used for evaluation draws: they do not depend on the sequence length or on other
    positions (causal prefixes see the same draws) nor on the device.
    """
    h = torch.full((1,) * len(shape), (seed ^ (stream * 0x9E3779B9)) & _M32, dtype=torch.long, device=device)
    h = _pcg_hash(_pcg_hash(h) ^ ((seed >> 32) & _M32))
    for axis, size in enumerate(shape):
        idx = torch.arange(size, device=device).view([size if a == axis else 1 for a in range(len(shape))])
        h = _pcg_hash((h + idx) & _M32)
    hi = h.expand(shape)
    lo = _pcg_hash(hi ^ 0x5BD1E995)
    return ((hi >> 5).double() * 2**26 + (lo >> 6).double() + 0.5) / 2**53


def counter_normal(seed: int, shape: tuple[int, ...], stream: int, like: torch.Tensor) -> torch.Tensor:
    """Standard normals addressed by position (Box-Muller on :func:`counter_uniform`)."""
    u1 = counter_uniform(seed, shape, 2 * stream, like.device)
    u2 = counter_uniform(seed, shape, 2 * stream + 1, like.device)
    return ((-2 * u1.log()).sqrt() * torch.cos(2 * math.pi * u2)).to(like.dtype)


def counter_indices(probs: torch.Tensor, samples: int, seed: int, stream: int) -> torch.Tensor:
    """Categorical indices ``[..., samples]`` from ``probs [..., M]`` by the inverse CDF
    of position-addressed uniforms."""
    cdf = probs.detach().to(torch.float64).cumsum(-1)  # [..., M]
    u = counter_uniform(seed, (*probs.shape[:-1], samples), stream, probs.device)  # [..., S]
    return inverse_cdf(cdf, u).clamp_max(probs.shape[-1] - 1)  # a row of zeros gets index 0 (zeroed later)
