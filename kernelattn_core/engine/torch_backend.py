"""The plain torch backend of feature-map attention: linear in sequence length.

Non-causal form, :math:`O(N D d_v)` time and :math:`O(N D + D d_v)` memory:

.. math:: S = \\sum_j \\phi_k(k_j) v_j^\\top, \\quad z = \\sum_j \\phi_k(k_j), \\quad
          \\mathrm{num}_i = \\phi_q(q_i)^\\top S, \\quad \\mathrm{den}_i = \\phi_q(q_i)^\\top z .

Causal form (:mod:`kernelattn_core.engine.chunked`): chunks of ``C`` positions, all
processed by batched matrix products; only a scan over the :math:`N/C` chunk states
is sequential. The values get a column of ones, :math:`\\tilde v_j = (v_j, 1)`, so the
denominator is the last column of the numerator and one recurrence serves both.
Writing :math:`q_t` for the query features and :math:`k_j` for the key features
stated at the key's own stabiliser (below):

.. math::
    A^{(c)}_{tj} = [j \\le t]\\, e^{m_j - m_t}\\, q_t^\\top k_j, \\qquad
    U_c = \\sum_{j \\in c} e^{m_j - M_c}\\, k_j \\tilde v_j^\\top, \\qquad
    S_{c+1} = e^{M_{c-1} - M_c} S_c + U_c,

.. math::
    (\\mathrm{num}_t, \\mathrm{den}_t) = \\sum_{j \\in c,\\, j \\le t} A^{(c)}_{tj} \\tilde v_j
    + e^{M_{c-1} - m_t}\\, S_c^\\top q_t ,

with :math:`M_c` the stabiliser at the last position of chunk ``c``. The backward pass
is its own (:class:`torch.autograd.Function`): the transposed recurrence

.. math::
    G_c = \\sum_{t \\in c+1} e^{M_c - m_t} q_t \\bar o_t^\\top + e^{M_c - M_{c+1}} G_{c+1},
    \\qquad G_{n_c - 1} = \\bar S_{\\mathrm{final}},

runs from the last chunk to the first, the states :math:`S_c` are recomputed rather
than stored, and the gradients of :math:`q, k, \\tilde v` and of the initial state follow
chunk-wise (formulas in :mod:`kernelattn_core.engine.chunked`). Training memory is
:math:`O(N (D + d_v))` for the inputs plus :math:`O(N C + (N/C) D d_v)` transient.

**Log-space stabilisers (exact and causal-safe).** For log-space maps the engine
receives :math:`l_q = \\log \\phi_q`, :math:`l_k = \\log \\phi_k`.

* Query side: :math:`\\phi_q(q_i) e^{-\\max_D l_{q,i}}`, a per-query constant that
  cancels between numerator and denominator.
* Key side, non-causal: one constant :math:`c = \\max_{j, D} l_{k}` for the whole
  sequence (all keys are visible to every query).
* Key side, causal: the prefix maximum :math:`m_t = \\max_{j \\le t} \\max_D l_{k,j}`.
  Key ``j`` is stored as :math:`k_j = e^{l_{k,j} - m_j} \\le 1`; it reaches query
  :math:`t \\ge j` of its own chunk through the gate :math:`e^{m_j - m_t} \\le 1`, and
  later chunks restated at the chunk's end, :math:`e^{m_j - M_c} \\le 1`; the state
  reaches query ``t`` through :math:`e^{M_{c-1} - m_t} \\le 1` and decays by
  :math:`e^{M_{c-1} - M_c} \\le 1` per chunk. Every factor depends only on keys
  :math:`\\le t`, so a later, larger key can never change an earlier output, and none
  exceeds 1, so nothing overflows. Query :math:`t` effectively uses the constant
  :math:`e^{-m_t}`, which cancels in the ratio.

**Masked and non-finite values.** Padded keys (features and values) are removed with
``masked_fill`` before any product, so whatever they hold (NaN, inf) never reaches an
output or a gradient. In the causal form a non-finite key or value at a *valid*
position ``j`` must not touch rows ``t < j`` (a product ``0 * NaN`` inside a chunk
would): one reduction checks that the inputs are finite; when they are not, the
offending keys are dropped from the products like padding and the rows that
legitimately see them (``t >= j``, and a row whose own query is non-finite) are set
to NaN afterwards. Earlier rows keep bit-identical outputs and gradients.

Half-precision inputs are computed in float32 (sums over long sequences overflow
float16) and the caller casts the output back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .chunked import DEFAULT_CHUNK, causal_linear_attention

_HALF = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, else the dtype itself."""
    return torch.float32 if dtype in _HALF else dtype


def _query_side(phi_q: torch.Tensor, log_space: bool) -> torch.Tensor:
    if not log_space:
        return phi_q
    top = phi_q.detach().amax(-1, keepdim=True)  # per-query constant: cancels
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row of -inf: features 0
    return (phi_q - top).exp_()


def _bad_rows(x: torch.Tensor, log_space: bool) -> torch.Tensor:
    """``[B, H, N]``: rows holding NaN or inf (``-inf`` is a valid log-feature: feature 0)."""
    if log_space:
        return (torch.isnan(x) | torch.isposinf(x)).any(-1)
    return ~torch.isfinite(x).all(-1)


@dataclass
class CausalState:
    """What causal feature-map attention carries from one call to the next (decoding,
    or from one rank to the next in a sequence-parallel split).

    Attributes
    ----------
    kv : Tensor ``[B, H, D, dv]``
        :math:`\\sum_{j} \\hat\\phi_k(k_j) v_j^\\top` over every key seen so far.
    z : Tensor ``[B, H, D]``
        :math:`\\sum_{j} \\hat\\phi_k(k_j)`, the normaliser's running sum.
    m : Tensor ``[B, H, 1]`` or None
        For log-space maps, the stabiliser the sums are stated at (the running maximum
        of the key log-features, ``-inf`` while no key has been seen); ``None`` for
        plain features.
    length : int
        Number of positions consumed.

    poisoned : Tensor ``[B, H]`` of bool, optional
        Set once a non-finite key or value was consumed: every later row is NaN.

    ``kv`` and ``z`` are differentiable: gradients flow through a state passed to the
    next call back into the keys and values that made it.
    """

    kv: torch.Tensor
    z: torch.Tensor
    m: torch.Tensor | None
    length: int
    #: ``[B, H]``: a non-finite key or value the rows may see was consumed (every later
    #: row is NaN, as in exact attention); ``None`` when none was
    poisoned: torch.Tensor | None = None


def feature_attention_torch(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_space: bool,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    chunk_size: int | None = None,
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
    chunk_size : int, optional
        Positions per chunk in the causal form; ``None`` takes the measured default
        (:data:`kernelattn_core.engine.chunked.DEFAULT_CHUNK`).
    """
    dtype = compute_dtype(phi_q.dtype)
    phi_q, phi_k, v = phi_q.to(dtype), phi_k.to(dtype), v.to(dtype)
    if causal:
        num, den, _ = _causal(phi_q, phi_k, v, log_space, key_padding_mask, chunk_size, None)
        return num, den
    pad = None if key_padding_mask is None else key_padding_mask[:, None, :, None]  # [B, 1, M, 1]
    fq = _query_side(phi_q, log_space)  # [B, H, N, D]
    if pad is not None:  # removed before any product, whatever they hold
        v = v.masked_fill(pad, 0.0)
    if log_space:
        lk = phi_k if pad is None else phi_k.masked_fill(pad, float("-inf"))
        c = lk.detach().amax(dim=(-2, -1), keepdim=True)  # [B, H, 1, 1]
        c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))  # all keys padded
        fk = (lk - c).exp_()
    else:
        fk = phi_k if pad is None else phi_k.masked_fill(pad, 0.0)
    s = torch.cat([fk.transpose(-1, -2) @ v, fk.sum(-2).unsqueeze(-1)], dim=-1)  # [B, H, D, dv + 1]
    out = fq @ s  # [B, H, N, dv + 1]: numerator and denominator in one product
    num, den = out.split([out.shape[-1] - 1, 1], dim=-1)  # one backward (a cat), not two zero-filled slices
    return num, den.squeeze(-1)


def _causal(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    log_space: bool,
    key_padding_mask: torch.Tensor | None,
    chunk_size: int | None,
    state: CausalState | None,
) -> tuple[torch.Tensor, torch.Tensor, CausalState]:
    b, h, n, d_feat = phi_q.shape
    dv = v.shape[-1]
    drop = None if key_padding_mask is None else key_padding_mask[:, None, :]  # [B, 1, N]
    poison = None
    carried = None if state is None else state.poisoned  # [B, H]: consumed by an earlier call
    # one reduction decides whether a non-finite value could leak through 0 * NaN
    vk = phi_k if drop is None else phi_k.masked_fill(drop.unsqueeze(-1), 0.0)
    vv = v if drop is None else v.masked_fill(drop.unsqueeze(-1), 0.0)
    if not bool(torch.isfinite(phi_q.detach().sum() + vk.detach().sum() + vv.detach().sum())):
        bad_k = _bad_rows(vk.detach(), log_space) | _bad_rows(vv.detach(), False)  # [B, H, N]
        bad_q = _bad_rows(phi_q.detach(), log_space)
        drop = bad_k if drop is None else drop | bad_k
        phi_q = phi_q.masked_fill(bad_q.unsqueeze(-1), 0.0)
        poison = bad_k.cummax(-1).values | bad_q  # rows that legitimately see them
        carried = bad_k.any(-1) if carried is None else carried | bad_k.any(-1)
    if state is not None and state.poisoned is not None:  # an earlier call consumed one
        earlier = state.poisoned[..., None].expand(b, h, n)
        poison = earlier if poison is None else poison | earlier
    if drop is not None:
        v = v.masked_fill(drop.unsqueeze(-1), 0.0)
    fq = _query_side(phi_q, log_space)  # [B, H, N, D]
    m = m0 = m_out = None
    if log_space:
        lk = phi_k if drop is None else phi_k.masked_fill(drop.unsqueeze(-1), float("-inf"))
        m_raw = lk.detach().amax(-1)  # [B, H, N]
        if state is not None and state.m is not None:
            m_raw = torch.maximum(m_raw, state.m)  # the prefix continues from earlier calls
        m_raw = m_raw.cummax(-1).values  # prefix maximum: causal; -inf before the first key
        m_out = m_raw[..., -1:]
        # positions before the first valid key get the first finite value (their rows are
        # exactly zero whatever m is, and m stays non-decreasing)
        finite = torch.isfinite(m_raw)
        first = torch.where(finite, m_raw, torch.full_like(m_raw, float("inf"))).amin(-1, keepdim=True)
        first = torch.where(torch.isfinite(first), first, torch.zeros_like(first))
        m = torch.where(finite, m_raw, first)
        fk = (lk - m.unsqueeze(-1)).exp_()  # [B, H, N, D], entries <= 1, dropped keys 0
        m0 = m[..., :1]
        if state is not None and state.m is not None:
            m0 = torch.where(torch.isfinite(state.m), state.m, m0)
    else:
        fk = phi_k if drop is None else phi_k.masked_fill(drop.unsqueeze(-1), 0.0)
    v1 = torch.cat([v, v.new_ones(b, h, n, 1)], dim=-1)  # [B, H, N, dv + 1]
    if state is None:
        s0 = fq.new_zeros(b, h, d_feat, dv + 1)
    else:
        s0 = torch.cat([state.kv.to(fq.dtype), state.z.to(fq.dtype).unsqueeze(-1)], dim=-1)
    out, s_final = causal_linear_attention(fq, fk, v1, s0, m, m0, chunk_size or DEFAULT_CHUNK)
    num, den = out.split([dv, 1], dim=-1)  # one backward (a cat) instead of two zero-filled slices
    den = den.squeeze(-1)
    if poison is not None:
        num = num.masked_fill(poison.unsqueeze(-1), float("nan"))
        den = den.masked_fill(poison, float("nan"))
    length = (0 if state is None else state.length) + n
    return num, den, CausalState(s_final[..., :dv], s_final[..., dv], m_out, length, carried)


def feature_attention_step(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_space: bool,
    key_padding_mask: torch.Tensor | None,
    state: CausalState | None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, CausalState]:
    """Causal attention of new positions given the state of all earlier ones.

    Feeding a sequence in pieces (one token at a time when decoding) gives the same
    numerator and denominator as one causal call over the whole sequence (the same
    code runs both); the returned state continues it.

    Parameters
    ----------
    phi_q, phi_k : Tensor ``[B, H, T, D]``
        Features (log-features when ``log_space``) of the ``T`` new positions.
    v : Tensor ``[B, H, T, dv]``
    key_padding_mask : Tensor ``[B, T]`` of bool, optional
    state : CausalState, optional
        Returned by the previous call; ``None`` starts a sequence.
    chunk_size : int, optional
        As in :func:`feature_attention_torch`.

    Returns
    -------
    num : Tensor ``[B, H, T, dv]``
    den : Tensor ``[B, H, T]``
    state : CausalState
    """
    dtype = compute_dtype(phi_q.dtype)
    phi_q, phi_k, v = phi_q.to(dtype), phi_k.to(dtype), v.to(dtype)
    return _causal(phi_q, phi_k, v, log_space, key_padding_mask, chunk_size, state)


#: bytes of one ``[B, H, G, D]`` feature block of the grouped forward. Below glibc's
#: largest dynamic mmap threshold (32 MiB), blocks are reused from the heap; a larger
#: tensor is fresh pages on every call, and the page faults of a few ``[B, H, N, D]``
#: tensors made the ungrouped forward super-linear in ``N`` (measured: a 64 MiB
#: subtraction 10x slower than in place at N = 32K, 2x at N = 4K).
GROUP_BYTES = 8 * 2**20


def group_length(batch_heads: int, width: int, itemsize: int, chunk: int) -> int:
    """Positions per group: ``[B, H, G, width]`` blocks of at most :data:`GROUP_BYTES`,
    a multiple of ``chunk`` (at least one chunk)."""
    g = GROUP_BYTES // max(1, batch_heads * width * itemsize)
    return max(chunk, g // chunk * chunk)


def feature_attention_grouped(
    feature_map: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    chunk_size: int | None = None,
    group: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator and denominator of :func:`feature_attention_torch`, computed in
    position groups, features included (forward only: for calls without autograd).

    Every feature map acts token by token, so the features of a group of positions are
    the group's rows of the features of the whole sequence; no ``[B, H, N, D]`` tensor
    is ever formed, and each group's work space stays in memory the allocator reuses.

    * Causal: the groups run in order, each continuing the :class:`CausalState` of the
      previous one — the same code as decoding (:func:`feature_attention_step`), so the
      result is the one causal call's, prefix stabiliser included.
    * Non-causal: one pass over key groups accumulates
      :math:`S = \\sum_j \\hat\\phi_k(k_j) [v_j, 1]^\\top` stated at the running maximum
      :math:`c` of the key log-features (restated by :math:`e^{c_{old} - c_{new}} \\le 1`
      when it grows), then one pass over query groups forms :math:`\\hat\\phi_q(q_t)^\\top S`.

    Parameters
    ----------
    feature_map : FeatureMap
        Built and prepared; its ``raw_features`` are called per group.
    q, k : Tensor ``[B, H, N, d]``, ``[B, H, M, d]``
        Scaled queries and keys.
    v : Tensor ``[B, H, M, dv]``
    group : int, optional
        Positions per group (default: :func:`group_length`).
    """
    fm = feature_map
    log_space = fm.log_space
    b, h, n, _ = q.shape
    m_keys = k.shape[2]
    chunk = chunk_size or DEFAULT_CHUNK
    dtype = compute_dtype(q.dtype)
    width = fm.feature_dim
    g = group or group_length(b * h, width, torch.finfo(dtype).bits // 8, chunk)
    dv = v.shape[-1]
    num = torch.empty(b, h, n, dv, dtype=dtype, device=q.device)
    den = torch.empty(b, h, n, dtype=dtype, device=q.device)
    if causal:
        state = None
        for g0 in range(0, n, g):
            g1 = min(n, g0 + g)
            pq = fm.raw_features(q[:, :, g0:g1], query=True).to(dtype)
            pk = fm.raw_features(k[:, :, g0:g1], query=False).to(dtype)
            kpm = None if key_padding_mask is None else key_padding_mask[:, g0:g1]
            nu, de, state = _causal(pq, pk, v[:, :, g0:g1].to(dtype), log_space, kpm, chunk, state)
            num[:, :, g0:g1], den[:, :, g0:g1] = nu, de
        return num, den
    s = torch.zeros(b, h, width, dv + 1, dtype=dtype, device=q.device)
    c_run = torch.full((b, h, 1, 1), float("-inf"), dtype=dtype, device=q.device)
    for g0 in range(0, m_keys, g):
        g1 = min(m_keys, g0 + g)
        pk = fm.raw_features(k[:, :, g0:g1], query=False).to(dtype)
        vg = v[:, :, g0:g1].to(dtype)
        if key_padding_mask is not None:  # removed before any product, whatever they hold
            pad = key_padding_mask[:, None, g0:g1, None]
            vg = vg.masked_fill(pad, 0.0)
            pk = pk.masked_fill(pad, float("-inf") if log_space else 0.0)
        if log_space:
            c_new = torch.maximum(c_run, pk.amax(dim=(-2, -1), keepdim=True))
            safe = torch.where(torch.isfinite(c_new), c_new, torch.zeros_like(c_new))
            restate = torch.where(torch.isfinite(c_run), (c_run - safe).exp(), torch.zeros_like(c_run))
            s.mul_(restate)  # the sum so far, restated at the new maximum (factor <= 1)
            c_run = c_new
            fk = (pk - safe).exp_()  # entries <= 1; padded keys 0
        else:
            fk = pk
        s[..., :dv] += fk.transpose(-1, -2) @ vg
        s[..., dv] += fk.sum(-2)
    for g0 in range(0, n, g):
        g1 = min(n, g0 + g)
        fq = _query_side(fm.raw_features(q[:, :, g0:g1], query=True).to(dtype), log_space)
        out = fq @ s  # [B, H, G, dv + 1]
        num[:, :, g0:g1], den[:, :, g0:g1] = out[..., :dv], out[..., dv]
    return num, den
