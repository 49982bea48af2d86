"""Quadratic reference of sliding-window + feature-map attention, written to be read.

The fast path (:mod:`kernelattn_hybrid.window`) is tested against it on outputs and
gradients.
"""

from __future__ import annotations

import torch


def exact_sets(
    n: int, m: int, window: int, global_tokens: int, causal: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exact, seen)``, boolean ``[N, M]``: pairs computed exactly (window and global
    tokens) and pairs the query may see at all (causal)."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(m, device=device)[None, :]
    if causal:
        seen = j <= i
        exact = ((i - j >= 0) & (i - j < window)) | ((j < global_tokens) & seen)
    else:
        seen = torch.ones(n, m, dtype=torch.bool, device=device)
        exact = ((i - j).abs() <= window) | (j < global_tokens)
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
) -> torch.Tensor:
    """The full ``[N, M]`` weight matrix: :math:`e^{q_i^\\top k_j}` on the exact set,
    :math:`\\phi_q(q_i)^\\top \\phi_k(k_j)` elsewhere, zero on disallowed pairs, rows
    normalised.

    For log-space maps the weights are formed as one log matrix,
    :math:`L_{ij} = q_i^\\top k_j` (exact) or :math:`\\log \\sum_D e^{l_{q,iD} + l_{k,jD}}`
    (features), and normalised by a row softmax; plain maps are normalised directly.
    Rows with no allowed key give zeros.
    """
    n, m = q.shape[-2], k.shape[-2]
    exact, seen = exact_sets(n, m, window, global_tokens, causal, q.device)
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
