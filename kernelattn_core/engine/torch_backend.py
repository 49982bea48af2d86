"""The plain torch backend of feature-map attention: linear in sequence length.

Non-causal form, :math:`O(N D d_v)` time and :math:`O(N D + D d_v)` memory:

.. math:: S = \\sum_j \\phi_k(k_j) v_j^\\top, \\quad z = \\sum_j \\phi_k(k_j), \\quad
          \\mathrm{num}_i = \\phi_q(q_i)^\\top S, \\quad \\mathrm{den}_i = \\phi_q(q_i)^\\top z .

Causal form: chunks of ``C`` positions. Inside a chunk the ``C x C`` block of
:math:`\\phi_q \\phi_k^\\top` is masked to the lower triangle; across chunks a running
state :math:`S \\in \\mathbb{R}^{D \\times d_v}` carries the past. No ``[N, D, d_v]``
cumulative sum is ever formed.

**Log-space stabilisers (exact and causal-safe).** For log-space maps the engine
receives :math:`l_q = \\log \\phi_q`, :math:`l_k = \\log \\phi_k`.

* Query side: :math:`\\phi_q(q_i) e^{-\\max_D l_{q,i}}`, a per-query constant that
  cancels between numerator and denominator.
* Key side, non-causal: one constant :math:`c = \\max_{j, D} l_{k}` for the whole
  sequence (all keys are visible to every query).
* Key side, causal: the prefix maximum :math:`m_t = \\max_{j \\le t} \\max_D l_{k,j}`.
  Query :math:`t` uses keys scaled by :math:`e^{-m_t}`, which depends only on keys
  :math:`\\le t`; a later, larger key can never change an earlier output. Key ``j``
  is stored as :math:`e^{l_{k,j} - m_j}` and reaches query ``t`` through the factor
  :math:`e^{m_j - m_t} \\le 1` (the gate), so nothing overflows.

Half-precision inputs are computed in float32 (sums over long sequences overflow
float16) and the caller casts the output back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_HALF = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, else the dtype itself."""
    return torch.float32 if dtype in _HALF else dtype


def _query_side(phi_q: torch.Tensor, log_space: bool) -> torch.Tensor:
    if not log_space:
        return phi_q
    return (phi_q - phi_q.detach().amax(-1, keepdim=True)).exp()  # per-query constant: cancels


def feature_attention_torch(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_space: bool,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator ``[B, H, N, dv]`` and denominator ``[B, H, N]`` of feature-map attention.

    Parameters
    ----------
    phi_q : Tensor ``[B, H, N, D]``
        Query features, or log-features when ``log_space``.
    phi_k : Tensor ``[B, H, M, D]``
        Key features, or log-features when ``log_space``.
    v : Tensor ``[B, H, M, dv]``
    key_padding_mask : Tensor ``[B, M]`` of bool, optional
        ``True`` marks a padded key.
    chunk_size : int
        Positions per chunk in the causal form.
    """
    dtype = compute_dtype(phi_q.dtype)
    phi_q, phi_k, v = phi_q.to(dtype), phi_k.to(dtype), v.to(dtype)
    pad = None if key_padding_mask is None else key_padding_mask[:, None, :, None]  # [B, 1, M, 1]
    fq = _query_side(phi_q, log_space)  # [B, H, N, D]
    if not causal:
        if log_space:
            lk = phi_k if pad is None else phi_k.masked_fill(pad, float("-inf"))
            c = lk.detach().amax(dim=(-2, -1), keepdim=True)  # [B, H, 1, 1]
            c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))  # all keys padded
            fk = (lk - c).exp()
        else:
            fk = phi_k if pad is None else phi_k.masked_fill(pad, 0.0)
        s = fk.transpose(-1, -2) @ v  # [B, H, D, dv]
        z = fk.sum(-2)  # [B, H, D]
        return fq @ s, (fq @ z.unsqueeze(-1)).squeeze(-1)
    num, den, _ = _causal_chunked(fq, phi_k, v, log_space, pad, chunk_size)
    return num, den


@dataclass
class CausalState:
    """What causal feature-map attention carries from one call to the next (decoding).

    Attributes
    ----------
    kv : Tensor ``[B, H, D, dv]``
        :math:`\\sum_{j} \\hat\\phi_k(k_j) v_j^\\top` over every key seen so far.
    z : Tensor ``[B, H, D]``
        :math:`\\sum_{j} \\hat\\phi_k(k_j)`, the normaliser's running sum.
    m : Tensor ``[B, H, 1]`` or None
        For log-space maps, the stabiliser the sums are stated at (the running maximum
        of the key log-features); ``None`` for plain features.
    length : int
        Number of positions consumed.
    """

    kv: torch.Tensor
    z: torch.Tensor
    m: torch.Tensor | None
    length: int


def _causal_chunked(
    fq: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    log_space: bool,
    pad: torch.Tensor | None,
    chunk_size: int,
    state: CausalState | None = None,
) -> tuple[torch.Tensor, torch.Tensor, CausalState]:
    b, h, n, d_feat = fq.shape
    dv = v.shape[-1]
    m = m_prev = None
    if log_space:
        lk = phi_k if pad is None else phi_k.masked_fill(pad, float("-inf"))
        m = lk.detach().amax(-1).cummax(-1).values  # [B, H, N] prefix max: causal
        if state is not None and state.m is not None:
            m = torch.maximum(m, state.m)  # the prefix continues from earlier calls
        # positions before the first valid key have m = -inf; give them the first finite
        # value (their outputs are exactly zero whatever m is, and m stays monotone)
        first = torch.where(torch.isfinite(m), m, torch.full_like(m, float("inf"))).amin(-1, keepdim=True)
        first = torch.where(torch.isfinite(first), first, torch.zeros_like(first))
        m = torch.where(torch.isfinite(m), m, first)
        fk = (lk - m.unsqueeze(-1)).exp()  # [B, H, N, D], entries <= 1, padded keys 0
        m_prev = m[..., :1]  # [B, H, 1]: stabiliser the running sums are stated at
        if state is not None and state.m is not None:
            m_prev = torch.where(torch.isfinite(state.m), state.m, m_prev)
    else:
        fk = phi_k if pad is None else phi_k.masked_fill(pad, 0.0)
    if state is None:
        kv = fq.new_zeros(b, h, d_feat, dv)  # [B, H, D, dv]
        z = fq.new_zeros(b, h, d_feat)  # [B, H, D]
    else:
        kv, z = state.kv.to(fq.dtype), state.z.to(fq.dtype)
    tri = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=fq.device).tril()
    nums, dens = [], []
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        c = stop - start
        qc, kc, vc = fq[:, :, start:stop], fk[:, :, start:stop], v[:, :, start:stop]
        a = qc @ kc.transpose(-1, -2)  # [B, H, C, C]
        if m is None:
            a = a.masked_fill(~tri[:c, :c], 0.0)
            num = a @ vc + qc @ kv
            den = a.sum(-1) + (qc @ z.unsqueeze(-1)).squeeze(-1)
        else:
            mc = m[..., start:stop]  # [B, H, C]
            gap = (mc.unsqueeze(-2) - mc.unsqueeze(-1)).masked_fill(~tri[:c, :c], float("-inf"))
            a = a * gap.exp()  # gate e^{m_j - m_t} <= 1 on j <= t, 0 above the diagonal
            past = (m_prev - mc).exp()  # [B, H, C] <= 1: state to query stabiliser
            num = a @ vc + (qc @ kv) * past.unsqueeze(-1)
            den = a.sum(-1) + (qc @ z.unsqueeze(-1)).squeeze(-1) * past
        nums.append(num)
        dens.append(den)
        if m is None:
            kv = kv + kc.transpose(-1, -2) @ vc
            z = z + kc.sum(-2)
        else:
            m_new = mc[..., -1:]  # [B, H, 1]
            decay = (m_prev - m_new).exp()  # <= 1
            kc = kc * (mc - m_new).exp().unsqueeze(-1)  # keys restated at m_new, <= 1
            kv = kv * decay.unsqueeze(-1) + kc.transpose(-1, -2) @ vc
            z = z * decay + kc.sum(-2)
            m_prev = m_new
    length = (0 if state is None else state.length) + n
    return torch.cat(nums, dim=2), torch.cat(dens, dim=2), CausalState(kv, z, m_prev, length)


def feature_attention_step(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_space: bool,
    key_padding_mask: torch.Tensor | None,
    state: CausalState | None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, CausalState]:
    """Causal attention of new positions given the state of all earlier ones.

    Feeding a sequence in pieces (one token at a time when decoding) gives the same
    numerator and denominator as one causal call over the whole sequence; the
    returned state continues it.
    """
    dtype = compute_dtype(phi_q.dtype)
    phi_q, phi_k, v = phi_q.to(dtype), phi_k.to(dtype), v.to(dtype)
    pad = None if key_padding_mask is None else key_padding_mask[:, None, :, None]
    return _causal_chunked(_query_side(phi_q, log_space), phi_k, v, log_space, pad, chunk_size, state)
