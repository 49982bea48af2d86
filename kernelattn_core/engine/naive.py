"""Plain quadratic references, written to be read, not to be fast.

Every fast path of the engine is tested against these on outputs and gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..validation import all_finite, finite_rows, isolated_rows, non_finite_rows  # noqa: F401 - re-exported (moved below the engine)


def allowed_pairs(
    n: int, m: int, causal: bool, key_padding_mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean ``[B or 1, 1, N, M]`` mask of the (query, key) pairs that may interact, or None."""
    allowed = None
    if causal:
        allowed = torch.ones(n, m, dtype=torch.bool, device=device).tril()[None, None]  # [1, 1, N, M]
    if key_padding_mask is not None:
        keep = ~key_padding_mask[:, None, None, :]  # [B, 1, 1, M]
        allowed = keep if allowed is None else allowed & keep
    return allowed


def _zero_non_finite_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q, k, v`` with their non-finite rows replaced by 0 (a key and its value together),
    and those rows: ``bad_q [B, H, N]``, ``bad_k [B, H, M]``."""
    bad_q = ~finite_rows(q)
    bad_k = ~(finite_rows(k) & finite_rows(v))
    q = q.masked_fill(bad_q.unsqueeze(-1), 0.0)
    k = k.masked_fill(bad_k.unsqueeze(-1), 0.0)
    v = v.masked_fill(bad_k.unsqueeze(-1), 0.0)
    return q, k, v, bad_q, bad_k


def quarantine_non_finite(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``q, k, v`` with every non-finite query row, key row and value row replaced by 0,
    and the ``[B, H, N]`` rows that must be NaN (a non-finite query of their own, or an
    *allowed* key or value that is not finite); ``None`` when all are finite.

    The products then see finite numbers only, so a NaN row cannot send
    :math:`0 \\cdot \\mathrm{NaN}` back into the gradients of the other rows through its
    normaliser (a future NaN key made every earlier row's ``q.grad`` NaN); the rows that
    see a non-finite value are set to NaN afterwards, as exact attention gives them.
    Used by exact attention and the quadratic sampling estimators (``ra``); the linear
    engine does the same inside :func:`~kernelattn_core.engine.torch_backend.feature_attention_torch`.

    Parameters
    ----------
    q, k, v : Tensor ``[B, H, N, d]``, ``[B, H, M, d]``, ``[B, H, M, dv]``
    allowed : Tensor of bool ``[B or 1, 1, N, M]`` or None
        :func:`allowed_pairs` (``None``: every query sees every key).
    """
    if all_finite(q, k, v):
        return q, k, v, None
    q, k, v, bad_q, bad_k = _zero_non_finite_rows(q, k, v)
    seen = bad_k.unsqueeze(-2) if allowed is None else allowed & bad_k.unsqueeze(-2)  # [B, H, N|1, M]
    return q, k, v, bad_q | seen.any(-1)


def quarantine_overflow(
    logits: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    poison: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """Finite inputs whose log-kernel values overflow (``+inf`` or NaN: a finite but huge
    key in float32), quarantined as :func:`quarantine_non_finite` quarantines non-finite
    inputs; ``None`` when no entry of ``logits [B, H, N, M]`` overflows (``-inf``, a zero
    kernel value, is a valid entry).

    A query whose row overflows at a key it sees is replaced by 0 and its row poisoned
    (its normalisation overflows; exact attention gives it NaN). A key that overflows with
    a query that may not see it (a future key, causal) and whose row is otherwise sound is
    replaced by 0 (its value too), and the rows that see it are poisoned: the kernel's
    backward at that masked pair would otherwise be :math:`0 \\cdot \\mathrm{NaN}` into the
    earlier query's gradient (``spectral-prf``'s log-sum-exp over components at ``+inf``).
    The caller evaluates the kernel again on the returned inputs.
    """
    if logits.numel() == 0:
        return None
    top = logits.amax()  # one pass: NaN propagates, +inf shows; -inf entries are valid
    if not bool(torch.isnan(top) | torch.isposinf(top)):
        return None
    bad = torch.isnan(logits) | torch.isposinf(logits)  # [B, H, N, M]
    sees = bad if allowed is None else bad & allowed
    bad_q = sees.any(-1)  # [B, H, N]
    if allowed is None:  # every pair is seen: no key is hidden from a row
        bad_k = torch.zeros((*bad_q.shape[:-1], k.shape[-2]), dtype=torch.bool, device=bad_q.device)
    else:
        bad_k = (bad & ~allowed & ~bad_q.unsqueeze(-1)).any(-2)  # [B, H, M]
    q = q.masked_fill(bad_q.unsqueeze(-1), 0.0)
    k = k.masked_fill(bad_k.unsqueeze(-1), 0.0)
    v = v.masked_fill(bad_k.unsqueeze(-1), 0.0)
    seen = bad_k.unsqueeze(-2) if allowed is None else allowed & bad_k.unsqueeze(-2)  # [B, H, N|1, M]
    rows = bad_q | seen.any(-1)
    return q, k, v, rows if poison is None else poison | rows


def quarantine_traced(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quarantine_non_finite` for a traced call (``torch.compile``): no value read
    back, so the masks are always formed, and the rows that see a non-finite key without
    the ``[B, H, N, M]`` pair mask: every row when not ``causal``, from its position on
    when ``causal`` (query ``i`` sees keys ``j <= i``, as :func:`allowed_pairs`). Padded
    keys must already be finite (replaced by 0): padding does not enter here.

    Returns ``q, k, v`` with the non-finite rows replaced by 0 and the ``[B, H, N]`` rows
    that must be NaN."""
    n, m = q.shape[-2], k.shape[-2]
    q, k, v, bad_q, bad_k = _zero_non_finite_rows(q, k, v)
    if causal:
        upto = bad_k.to(torch.int32).cumsum(-1) > 0  # [B, H, M]: a bad key at or before j
        seen = upto[..., torch.arange(n, device=q.device).clamp_max(m - 1)]  # [B, H, N]
    else:
        seen = bad_k.any(-1, keepdim=True)  # [B, H, 1]
    return q, k, v, bad_q | seen


def isolated_pre(
    pre: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    q: torch.Tensor,
    k: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pre(q, k, key_padding_mask=..., **options)`` (a normaliser's pre-transform,
    ``[B, H, N, d]`` and ``[B, H, M, d]``) that no padded or non-finite row reaches:
    padded keys and non-finite rows enter as 0; non-finite rows leave as NaN rows (the
    engine then drops the key or poisons the query's row), padded keys as they came out
    (the engine removes them). Their gradients are exactly 0."""
    bad_q, bad_k = non_finite_rows(q), non_finite_rows(k)
    if bad_q is None and bad_k is None and key_padding_mask is None:
        return pre(q, k, key_padding_mask=key_padding_mask, **options)
    if bad_q is not None:
        q = q.masked_fill(bad_q.unsqueeze(-1), 0.0)
    zero_k = None if key_padding_mask is None else key_padding_mask[:, None, :]  # [B, 1, M]
    if bad_k is not None:
        zero_k = bad_k if zero_k is None else zero_k | bad_k
    if zero_k is not None:
        k = k.masked_fill(zero_k.unsqueeze(-1), 0.0)
    q, k = pre(q, k, key_padding_mask=key_padding_mask, **options)
    if bad_q is not None:
        q = q.masked_fill(bad_q.unsqueeze(-1), float("nan"))
    if bad_k is not None:
        k = k.masked_fill(bad_k.unsqueeze(-1), float("nan"))
    return q, k


def poison_rows(out: torch.Tensor, poison: torch.Tensor | None) -> torch.Tensor:
    """``out [B, H, N, dv]`` with the rows ``poison [B, H, N]`` (from
    :func:`quarantine_non_finite`) set to NaN; ``out`` itself when ``poison`` is None."""
    return out if poison is None else out.masked_fill(poison.unsqueeze(-1), float("nan"))


def feature_attention_naive(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_space: bool,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator and denominator of feature-map attention by forming the full matrix.

    .. math:: A_{ij} = \\phi_q(q_i)^\\top \\phi_k(k_j), \\quad
              \\mathrm{num}_i = \\sum_{j \\text{ allowed}} A_{ij} v_j, \\quad
              \\mathrm{den}_i = \\sum_{j \\text{ allowed}} A_{ij}

    Parameters
    ----------
    phi_q : Tensor ``[B, H, N, D]`` (log-features when ``log_space``)
    phi_k : Tensor ``[B, H, M, D]`` (log-features when ``log_space``)
    v : Tensor ``[B, H, M, dv]``

    Returns
    -------
    num : Tensor ``[B, H, N, dv]``
    den : Tensor ``[B, H, N]``
    """
    if log_space:
        phi_q, phi_k = phi_q.exp(), phi_k.exp()
    a = phi_q @ phi_k.transpose(-1, -2)  # [B, H, N, M]
    allowed = allowed_pairs(a.shape[-2], a.shape[-1], causal, key_padding_mask, a.device)
    if allowed is not None:
        a = a.masked_fill(~allowed, 0.0)
    return a @ v.to(a.dtype), a.sum(-1)


def kernel_attention_naive(
    kernel_matrix: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Exact kernelized attention from a kernel matrix ``[B, H, N, M]``; rows with no
    allowed key give zeros."""
    allowed = allowed_pairs(kernel_matrix.shape[-2], kernel_matrix.shape[-1], causal, key_padding_mask, v.device)
    a = kernel_matrix if allowed is None else kernel_matrix.masked_fill(~allowed, 0.0)
    den = a.sum(-1, keepdim=True)
    return (a @ v) / torch.where(den == 0, torch.ones_like(den), den)


def decayed_linear_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    *,
    s0: torch.Tensor | None = None,
    m: torch.Tensor | None = None,
    m0: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The causal recurrence of :func:`~kernelattn_core.engine.chunked.causal_linear_attention`,
    one position at a time (the reference its tests compare with, outputs and gradients).

    .. math::
        S_t = e^{\lambda_t}\, e^{m_{t-1} - m_t}\, S_{t-1} + k_t v_t^\top, \qquad
        o_t = S_t^\top q_t, \qquad S_{-1} = s_0,\ m_{-1} = m_0,

    with :math:`\lambda \equiv 0` when ``log_decay`` is ``None`` and :math:`m \equiv 0`
    when ``m`` is ``None`` (plain features). The state is decayed *before* position
    :math:`t`'s key is added, as gated linear attention and RFA-Gate define it.

    Parameters
    ----------
    q, k : Tensor ``[B, H, N, D]``
    v : Tensor ``[B, H, N, dv]``
    log_decay : Tensor ``[B, H, N]`` or None
        :math:`\lambda_t \le 0`.
    s0 : Tensor ``[B, H, D, dv]``, optional
        The incoming state (zeros when ``None``), stated at ``m0``.
    m, m0 : Tensor ``[B, H, N]``, ``[B, H, 1]``, optional
        The stabiliser the keys are stated at, and that of ``s0``.

    Returns
    -------
    out : Tensor ``[B, H, N, dv]``
    s_final : Tensor ``[B, H, D, dv]``
    """
    b, h, n, d_feat = q.shape
    state = q.new_zeros(b, h, d_feat, v.shape[-1]) if s0 is None else s0
    m_prev = None if m is None else (m[..., :1] if m0 is None else m0)  # [B, H, 1]
    rows = []
    for t in range(n):
        factor = q.new_zeros(b, h)  # log of what multiplies the state: lambda_t + m_{t-1} - m_t
        if log_decay is not None:
            factor = factor + log_decay[:, :, t]
        if m is not None:
            factor = factor + m_prev[..., 0] - m[:, :, t]  # type: ignore[index]
            m_prev = m[:, :, t : t + 1]
        state = factor.exp()[..., None, None] * state + k[:, :, t, :, None] * v[:, :, t, None, :]
        rows.append((q[:, :, t, None, :] @ state).squeeze(-2))  # [B, H, dv]
    out = torch.stack(rows, dim=2) if rows else q.new_zeros(b, h, 0, v.shape[-1])
    return out, state
