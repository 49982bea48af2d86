"""RFA-Gate (Peng et al., 2021, §3.2): causal random feature attention with a learned
forget gate.

.. math::
    g_t = \\sigma(w^\\top k_t + b), \\qquad
    S_t = g_t S_{t-1} + (1 - g_t)\\, \\phi(k_t) v_t^\\top, \\qquad
    z_t = g_t z_{t-1} + (1 - g_t)\\, \\phi(k_t), \\qquad
    \\mathrm{out}_t = \\frac{\\phi(q_t)^\\top S_t}{\\phi(q_t)^\\top z_t},

(:math:`S_0 = 0`, :math:`z_0 = 0`): recent tokens weigh more, a recency bias the
paper adds for language modelling. Unrolled,
:math:`S_t = \\sum_{j \\le t} (1 - g_j) e^{G_t - G_j} \\phi(k_j) v_j^\\top` with
:math:`G_t = \\sum_{i \\le t} \\log g_i`.

The gate is computed from the key here (one weight vector and bias per head); Peng
et al. compute it from the layer input :math:`x_t`, of which :math:`k_t` is a linear
image, so the family of gates is the same up to the key projection.

* :func:`gated_attention` is the fast form: chunks of ``chunk_size`` positions, the
  quadratic form inside a chunk with decays :math:`e^{G_t - G_j} \\le 1` and the state
  carried across chunks with decay :math:`e^{G_{\\text{end}} - G_{\\text{start}}} \\le 1`
  (every exponent is :math:`\\le 0`, so nothing overflows however long the sequence);
  time :math:`O(N C D d_v)`, linear in :math:`N`.
* :func:`gated_attention_naive` is the recurrence above, one position at a time (the
  reference).

Padded keys (``key_padding_mask``) are skipped: the gate is 1 and the update 0 there,
so the state passes through unchanged whatever the padded values are.
"""

from __future__ import annotations

import torch
from torch import nn

from kernelattn_core.errors import InputError


def _guard(den: torch.Tensor, eps: float) -> torch.Tensor:
    """Denominator with magnitude at least ``eps``, sign kept (signed trigonometric features)."""
    sign = torch.where(den < 0, -torch.ones_like(den), torch.ones_like(den))
    return sign * den.abs().clamp_min(eps)


def _gates(log_g: torch.Tensor, key_padding_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log g, 1 - g)`` with padded positions set to ``g = 1`` (no forgetting, no update)."""
    if key_padding_mask is None:
        return log_g, -torch.expm1(log_g)
    pad = key_padding_mask[:, None, :]  # [B, 1, N]
    log_g = log_g.masked_fill(pad, 0.0)
    return log_g, (-torch.expm1(log_g)).masked_fill(pad, 0.0)


def gated_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    log_g: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    chunk_size: int = 64,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Causal gated feature attention (fast, chunked).

    Parameters
    ----------
    phi_q, phi_k : Tensor ``[B, H, N, D]``
        Query and key features.
    v : Tensor ``[B, H, N, dv]``
    log_g : Tensor ``[B, H, N]``
        :math:`\\log g_t \\le 0` (``logsigmoid`` of the gate logits).
    key_padding_mask : Tensor ``[B, N]`` (bool, ``True`` = padded), optional
    chunk_size : int
    eps : float
        Smallest denominator magnitude.

    Returns
    -------
    Tensor ``[B, H, N, dv]``
    """
    if chunk_size < 1:
        raise InputError(f"chunk_size: expected an integer >= 1, got {chunk_size!r}")
    b, h, n, d_feat = phi_q.shape
    dv = v.shape[-1]
    log_g, upd = _gates(log_g, key_padding_mask)
    fk = phi_k * upd.unsqueeze(-1)  # [B, H, N, D]: (1 - g_j) phi(k_j), 0 on padding
    if key_padding_mask is not None:
        fk = fk.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        v = v.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    kv = phi_q.new_zeros(b, h, d_feat, dv)
    z = phi_q.new_zeros(b, h, d_feat)
    tri = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=phi_q.device).tril()
    outs = []
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        c = stop - start
        qc, kc, vc = phi_q[:, :, start:stop], fk[:, :, start:stop], v[:, :, start:stop]
        g_cum = log_g[:, :, start:stop].cumsum(-1)  # [B, H, C]: G_t - G_{start-1}
        gap = (g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)).masked_fill(~tri[:c, :c], float("-inf"))
        a = (qc @ kc.transpose(-1, -2)) * gap.exp()  # [B, H, C, C]: decay e^{G_t - G_j} on j <= t
        past = g_cum.exp()  # [B, H, C]: decay of the carried state to position t
        num = a @ vc + (qc @ kv) * past.unsqueeze(-1)
        den = a.sum(-1) + (qc @ z.unsqueeze(-1)).squeeze(-1) * past
        outs.append(num / _guard(den, eps).unsqueeze(-1))
        to_end = (g_cum[..., -1:] - g_cum).exp()  # [B, H, C]: e^{G_end - G_j}
        kc_end = kc * to_end.unsqueeze(-1)
        total = g_cum[..., -1].exp()  # [B, H]
        kv = kv * total[..., None, None] + kc_end.transpose(-1, -2) @ vc
        z = z * total[..., None] + kc_end.sum(-2)
    return torch.cat(outs, dim=2)


def gated_attention_naive(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    log_g: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The recurrence of RFA-Gate, one position at a time (reference for tests)."""
    b, h, n, d_feat = phi_q.shape
    log_g, upd = _gates(log_g, key_padding_mask)
    g = log_g.exp()
    s = phi_q.new_zeros(b, h, d_feat, v.shape[-1])
    z = phi_q.new_zeros(b, h, d_feat)
    outs = []
    for t in range(n):
        k_t, v_t = phi_k[:, :, t], v[:, :, t]
        if key_padding_mask is not None:
            keep = (~key_padding_mask[:, t])[:, None, None]
            k_t, v_t = torch.where(keep, k_t, 0.0), torch.where(keep, v_t, 0.0)
        s = g[:, :, t, None, None] * s + upd[:, :, t, None, None] * k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
        z = g[:, :, t, None] * z + upd[:, :, t, None] * k_t
        num = (phi_q[:, :, t].unsqueeze(-2) @ s).squeeze(-2)  # [B, H, dv]
        den = (phi_q[:, :, t] * z).sum(-1)  # [B, H]
        outs.append(num / _guard(den, eps).unsqueeze(-1))
    return torch.stack(outs, dim=2)


class Gate(nn.Module):
    """Per-head gate :math:`\\log g_t = \\log\\sigma(w_h^\\top k_t + b_h)`.

    Parameters
    ----------
    head_dim : int
    num_heads : int
    init_bias : float
        Initial :math:`b_h` (2.0 by default: :math:`g \\approx 0.88`, slow forgetting).
    """

    def __init__(self, head_dim: int, num_heads: int, init_bias: float = 2.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads, head_dim))
        self.bias = nn.Parameter(torch.full((num_heads,), float(init_bias)))

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        """``k [B, H, N, d]`` to ``log g [B, H, N]``."""
        logits = (k * self.weight.to(k.dtype)[None, :, None, :]).sum(-1) + self.bias.to(k.dtype)[None, :, None]
        return nn.functional.logsigmoid(logits)
