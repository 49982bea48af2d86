"""Quadratic reference of sliding-window + feature-map attention, written to be read.

The fast path (:mod:`kernelattn_hybrid.window`) is tested against it on outputs and
gradients.
"""

from __future__ import annotations

import torch

from .heavy import HeavyKeys


def leading_padding(key_padding_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` (int64): the number of padded keys before each row's first key that is not
    padded (``M`` for a row that is all padding); ``key_padding_mask [B, M]``, ``True`` =
    padded. The global tokens of a row start there."""
    return key_padding_mask.long().cumprod(-1).sum(-1)


def exact_sets(
    n: int,
    m: int,
    window: int,
    global_tokens: int,
    causal: bool,
    device: torch.device,
    global_offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exact, seen)``, boolean ``[N, M]``: pairs computed exactly (window and global
    tokens) and pairs the query may see at all (causal).

    The global tokens are the keys ``o .. o + g - 1``: ``o = 0`` without ``global_offset``;
    with it (``[B]``, each row's offset, :func:`leading_padding`) ``exact`` is ``[B, 1, N, M]``."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(m, device=device)[None, :]
    if global_offset is None:
        is_global = j < global_tokens  # [1, M]
    else:
        o = global_offset.to(device)[:, None, None, None]  # [B, 1, 1, 1]
        is_global = (j >= o) & (j < o + global_tokens)  # [B, 1, 1, M]
    if causal:
        seen = j <= i
        exact = ((i - j >= 0) & (i - j < window)) | (is_global & seen)
    else:
        seen = torch.ones(n, m, dtype=torch.bool, device=device)
        exact = ((i - j).abs() <= window) | is_global
    return exact, seen


def window_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    *,
    log_space: bool,
    window: int,
    global_tokens: int,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    global_offset: torch.Tensor | None = None,
    heavy: HeavyKeys | None = None,
) -> torch.Tensor:
    """The full ``[N, M]`` weight matrix: :math:`e^{q_i^\\top k_j}` on the exact set,
    :math:`\\phi_q(q_i)^\\top \\phi_k(k_j)` elsewhere, zero on disallowed pairs, rows
    normalised.

    For log-space maps the weights are formed as one log matrix,
    :math:`L_{ij} = q_i^\\top k_j` (exact) or :math:`\\log \\sum_D e^{l_{q,iD} + l_{k,jD}}`
    (features), and normalised by a row softmax; plain maps are normalised directly.
    Rows with no allowed key give zeros. ``global_offset [B]``: the global tokens of row
    ``b`` are the keys ``global_offset[b] .. global_offset[b] + g - 1`` (the estimator passes
    :func:`leading_padding`); ``None``: the keys ``0 .. g - 1``. ``heavy``
    (non-causal): each head's heavy keys (:mod:`kernelattn_hybrid.heavy`) join every
    query's exact set.
    """
    n, m = q.shape[-2], k.shape[-2]
    exact, seen = exact_sets(n, m, window, global_tokens, causal, q.device, global_offset)
    if heavy is not None:
        if causal:
            raise ValueError("heavy keys are defined for non-causal attention only")
        exact = exact | heavy.mask(m)[:, :, None, :]  # [B, H, N, M]
    allowed = seen[None, None]  # [1, 1, N, M]
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    logits = q @ k.transpose(-1, -2)  # [B, H, N, M]
    if log_space:
        feat = torch.logsumexp(phi_q.unsqueeze(-2) + phi_k.unsqueeze(-3), dim=-1)  # [B, H, N, M]
        lw = torch.where(exact, logits, feat).masked_fill(~allowed, float("-inf"))
        some = allowed.any(-1, keepdim=True)
        w = torch.softmax(lw.masked_fill(~some, 0.0), dim=-1).masked_fill(~allowed, 0.0)
        return (w @ v) * some
    w = torch.where(exact, logits.exp(), phi_q @ phi_k.transpose(-1, -2)).masked_fill(~allowed, 0.0)
    den = w.sum(-1, keepdim=True)
    return (w @ v) / torch.where(den == 0, torch.ones_like(den), den)


def heavy_keys_naive(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    count: int,
    *,
    log_space: bool,
    eligible: torch.Tensor | None = None,
    key_valid: torch.Tensor | None = None,
    query_valid: torch.Tensor | None = None,
) -> HeavyKeys:
    """Each head's ``count`` keys with the largest column sum of the full ``[N, M]``
    feature-map attention matrix :math:`P_{ij} = \\phi_q(q_i)^\\top \\phi_k(k_j) / \\sum_{j'}
    \\phi_q(q_i)^\\top \\phi_k(k_{j'})` over the valid keys, summed over the valid queries;
    chosen among the ``eligible`` valid keys (:func:`kernelattn_hybrid.heavy.select_heavy_keys`
    forms the same sums in linear time). Masks as there: ``[B, M]`` keys, ``[B, N]`` or
    ``[B, H, N]`` queries."""
    if log_space:
        logw = torch.logsumexp(phi_q.unsqueeze(-2) + phi_k.unsqueeze(-3), dim=-1)  # [B, H, N, M]
    else:
        logw = (phi_q @ phi_k.transpose(-1, -2)).log()
    keys = torch.ones(logw.shape[0], 1, 1, logw.shape[-1], dtype=torch.bool, device=logw.device)
    if key_valid is not None:
        keys = keys & key_valid[:, None, None, :]
    p = torch.softmax(logw.masked_fill(~keys, float("-inf")), dim=-1)  # [B, H, N, M]
    if query_valid is not None:
        rows = query_valid[:, None, :] if query_valid.dim() == 2 else query_valid
        p = p * rows.unsqueeze(-1)
    mass = p.sum(-2)  # [B, H, M]
    ok = keys[:, :, 0, :].expand_as(mass)
    if eligible is not None:
        ok = ok & eligible[:, None, :]
    top = mass.masked_fill(~ok, float("-inf")).topk(min(count, mass.shape[-1]), dim=-1)
    return HeavyKeys(top.indices, torch.isfinite(top.values))
