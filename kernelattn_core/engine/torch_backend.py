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
to NaN afterwards. Earlier rows keep bit-identical outputs and gradients. The non-causal
form does the same: a non-finite key is seen by every row (all of its head's rows are
NaN), a non-finite query row by its own row only, and the gradients are those of the
finite call with those rows removed (zero at the offending positions).

Half-precision inputs are computed in float32 (sums over long sequences overflow
float16) and the caller casts the output back.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..validation import finite_rows
from .chunked import (  # noqa: F401 - CausalInputs, query_side, _bad_rows: re-exported (moved to chunked.py)
    CausalInputs,
    CausalState,
    _bad_rows,
    causal_linear_attention,
    compute_dtype,
    default_chunk,
    finish_causal,
    prepare_causal,
    query_side,
)
from .naive import non_finite_rows


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
        (:func:`kernelattn_core.engine.chunked.default_chunk`).
    """
    dtype = compute_dtype(phi_q.dtype)
    phi_q, phi_k, v = phi_q.to(dtype), phi_k.to(dtype), v.to(dtype)
    if causal:
        num, den, _ = _causal(phi_q, phi_k, v, log_space, key_padding_mask, chunk_size, None)
        return num, den
    pad = None if key_padding_mask is None else key_padding_mask[:, None, :, None]  # [B, 1, M, 1]
    fq = query_side(phi_q, log_space)  # [B, H, N, D]
    if pad is not None:  # removed before any product, whatever they hold
        v = v.masked_fill(pad, 0.0)
    lk = phi_k if pad is None else phi_k.masked_fill(pad, float("-inf") if log_space else 0.0)
    lk, v, top, poisoned = quarantine_keys(lk, v, log_space)
    if log_space:
        c = top.amax(-1)[..., None, None]  # [B, H, 1, 1]
        c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))  # all keys padded
        fk = (lk - c).exp_()
    else:
        fk = lk
    s = torch.cat([fk.transpose(-1, -2) @ v, fk.sum(-2).unsqueeze(-1)], dim=-1)  # [B, H, D, dv + 1]
    out = fq @ s  # [B, H, N, dv + 1]: numerator and denominator in one product
    bad = non_finite_query_rows(out[..., -1], poisoned)
    if bad is not None:  # quarantined: kept out of the product (and its gradients), NaN afterwards
        out = (fq.masked_fill(bad.unsqueeze(-1), 0.0) @ s).masked_fill(bad.unsqueeze(-1), float("nan"))
    num, den = out.split([out.shape[-1] - 1, 1], dim=-1)  # one backward (a cat), not two zero-filled slices
    return num, den.squeeze(-1)


def quarantine_keys(
    lk: torch.Tensor, v: torch.Tensor, log_space: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Non-causal key quarantine: keys ``lk [B, H, M, D]`` (log-features in log space,
    padded ones already ``-inf`` / 0) and values ``v [B, H, M, dv]`` with every key whose
    features or value are not finite removed like padding (every query sees it: its rows
    are set to NaN afterwards, by :func:`non_finite_query_rows`), so no
    :math:`0 \\cdot \\mathrm{NaN}` reaches a gradient.

    Returns ``lk``, ``v``, the row maxima ``[B, H, M]`` of the cleaned log-features (log
    space; ``None`` otherwise) and the ``[B, H]`` flag of the heads that held such a key
    (``None`` when none did). In log space the row maxima, needed for the stabiliser
    anyway, find the keys; plain features and the values cost one reduction each.
    """
    top = None
    if log_space:
        top = lk.detach().amax(-1)  # [B, H, M]: NaN or +inf exactly on the rows holding one
        bad = torch.isnan(top) | torch.isposinf(top)
        bad = bad if bool(bad.any()) else None
    else:
        bad = non_finite_rows(lk)
    bad_v = non_finite_rows(v)
    if bad_v is not None:
        bad = bad_v if bad is None else bad | bad_v
    if bad is None:
        return lk, v, top, None
    drop = bad.unsqueeze(-1)
    lk = lk.masked_fill(drop, float("-inf") if log_space else 0.0)
    v = v.masked_fill(drop, 0.0)
    if top is not None:
        top = top.masked_fill(bad, float("-inf"))
    return lk, v, top, bad.any(-1)


def non_finite_query_rows(den: torch.Tensor, poisoned: torch.Tensor | None) -> torch.Tensor | None:
    """``[B, H, N]`` rows of a non-causal call to be quarantined, from the denominators
    ``den [B, H, N]`` of quarantined keys (finite sums, so a non-finite denominator is a
    non-finite query row, or a product that overflowed) and the heads ``poisoned [B, H]``
    that held a non-finite key (every row sees it); ``None`` when there is none."""
    bad = ~torch.isfinite(den.detach())
    if poisoned is not None:
        bad = bad | poisoned.unsqueeze(-1)
    return bad if bool(bad.any()) else None


def _causal(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    log_space: bool,
    key_padding_mask: torch.Tensor | None,
    chunk_size: int | None,
    state: CausalState | None,
) -> tuple[torch.Tensor, torch.Tensor, CausalState]:
    prep = prepare_causal(phi_q, phi_k, v, log_space, key_padding_mask, state)
    out, s_final = causal_linear_attention(
        prep.fq, prep.fk, prep.v1, prep.s0, prep.m, prep.m0, chunk_size or default_chunk(v.shape[-1])
    )
    return finish_causal(out, s_final, prep, state)


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
    if phi_q.shape[2] == 1 and state is not None and not torch.is_grad_enabled():
        return _decode_one(phi_q, phi_k, v, log_space, key_padding_mask, state)
    return _causal(phi_q, phi_k, v, log_space, key_padding_mask, chunk_size, state)


def _decode_one(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    log_space: bool,
    key_padding_mask: torch.Tensor | None,
    state: CausalState,
) -> tuple[torch.Tensor, torch.Tensor, CausalState]:
    """One new position given ``state`` (decoding without autograd): the recurrence itself,

    .. math::
        c' = \\max(c, \\max_D l_k), \\quad S' = e^{c - c'} S + e^{l_k - c'} v^\\top, \\quad
        z' = e^{c - c'} z + e^{l_k - c'}, \\quad
        \\mathrm{num} = \\hat\\phi_q^\\top S', \\quad \\mathrm{den} = \\hat\\phi_q^\\top z',

    with the same quarantine as :func:`prepare_causal` (a padded key leaves the state
    alone, a non-finite key or value sets ``poisoned``, a non-finite query poisons its
    row) and none of the chunked core's set-up, which dominates a one-position call."""
    b, h = phi_q.shape[:2]
    lq, lk, vv = phi_q[:, :, 0], phi_k[:, :, 0], v[:, :, 0]  # [B, H, D], [B, H, D], [B, H, dv]
    pad = torch.zeros(b, h, dtype=torch.bool, device=lq.device)
    if key_padding_mask is not None:
        pad = pad | key_padding_mask[:, :1]  # [B, 1] broadcast over heads
    bad_k = (_bad_rows(lk, log_space) | ~finite_rows(vv)) & ~pad  # [B, H]
    bad_q = _bad_rows(lq, log_space)  # [B, H]
    gone = (pad | bad_k).unsqueeze(-1)  # [B, H, 1]
    vv = vv.masked_fill(gone, 0.0)
    kv, z = state.kv.to(lq.dtype), state.z.to(lq.dtype)
    if log_space:
        lk = lk.masked_fill(gone, float("-inf"))
        m_old = state.m if state.m is not None else lq.new_full((b, h, 1), float("-inf"))
        m_new = torch.maximum(m_old, lk.amax(-1, keepdim=True))  # [B, H, 1]: -inf while no key
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        restate = torch.where(torch.isfinite(m_old), (m_old - safe).exp(), torch.zeros_like(safe))
        fk = (lk - safe).exp()  # [B, H, D], <= 1
        kv = torch.addcmul(kv * restate.unsqueeze(-1), fk.unsqueeze(-1), vv.unsqueeze(-2))
        z = torch.addcmul(z * restate, fk, torch.ones_like(fk))
        fq = query_side(lq.masked_fill(bad_q.unsqueeze(-1), float("-inf")), True)  # [B, H, D]
    else:
        fk = lk.masked_fill(gone, 0.0)
        kv = torch.addcmul(kv, fk.unsqueeze(-1), vv.unsqueeze(-2))
        z = z + fk
        m_new = None
        fq = lq.masked_fill(bad_q.unsqueeze(-1), 0.0)
    num = (fq.unsqueeze(-2) @ kv).squeeze(-2)  # [B, H, dv]
    den = (fq * z).sum(-1)  # [B, H]
    poisoned = bad_k if state.poisoned is None else state.poisoned | bad_k
    rows = poisoned | bad_q
    num = num.masked_fill(rows.unsqueeze(-1), float("nan"))
    den = den.masked_fill(rows, float("nan"))
    carried = poisoned if (state.poisoned is not None or bool(bad_k.any())) else None
    return num.unsqueeze(2), den.unsqueeze(2), CausalState(kv, z, m_new, state.length + 1, carried)


def decode_one_finite(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    state: CausalState,
    *,
    log_space: bool,
    eps: float,
) -> tuple[torch.Tensor, CausalState] | None:
    """The normalised output of one new position and the continued state, on the
    assumption that everything is finite: the recurrence of :func:`_decode_one` without
    its quarantine, or ``None`` when the assumption fails (the caller then takes the
    guarded path, which gives the same result, up to rounding, wherever this one returns).

    A decoding step of a small model is dominated by the number of tensor operations,
    not their size (``[B, H, D]`` rows): the guarded step spends about 40 of them on
    masks and non-finite bookkeeping that change nothing for finite inputs. Here the
    output, the key's (log-)features and the denominator decide, read back with one
    synchronisation: a non-finite entry in the output or the key row (a non-finite
    query, key or value reaches one of them), or a denominator that
    :meth:`~kernelattn_core.interfaces.normalizer.Normalizer.normalize` would guard
    (:math:`|\\mathrm{den}| <` ``eps``), returns ``None``.

    For log-space maps the key is first absorbed at the state's stabiliser ``m``
    unchanged (:math:`S' = S + e^{l_k - m} v^\\top`: no rescaling of ``S`` and ``z``), which
    is :func:`absorb_one_finite` exactly whenever :math:`\\max_D l_k \\le m`, the usual case
    once a few keys are in; when a feature exceeds 1 the step is redone with the
    stabiliser raised (:func:`absorb_one_finite`, a second synchronisation).

    Parameters
    ----------
    phi_q, phi_k : Tensor ``[B, H, 1, D]``
        Features (log-features when ``log_space``) of the new position, in the state's dtype.
    v : Tensor ``[B, H, 1, dv]``
    state : CausalState
        Not poisoned (``m`` may be ``-inf``: no key consumed yet).
    eps : float
        The normaliser's smallest denominator.

    Returns
    -------
    (out, state) or None
        ``out [B, H, 1, dv] = num / den`` and the state after the position.
    """
    if not (phi_q.dtype == phi_k.dtype == v.dtype == state.kv.dtype) or phi_q.shape != phi_k.shape:
        return None  # a map that changes the dtype or the width: the guarded step casts and checks
    b, h, _, d_feat = phi_k.shape
    dv = v.shape[-1]
    lq = phi_q.reshape(b * h, 1, d_feat)
    fq = (lq - lq.amax(-1, keepdim=True)).exp_() if log_space else lq  # [BH, 1, D]
    lk, vv = phi_k.reshape(b * h, 1, d_feat), v.reshape(b * h, 1, dv)
    kv, z = state.kv.reshape(b * h, d_feat, dv), state.z.reshape(b * h, 1, d_feat)
    if log_space:
        assert state.m is not None
        fk = (lk - state.m.reshape(b * h, 1, 1)).exp_()  # at the current stabiliser
        kv, z = torch.addcmul(kv, fk.mT, vv), z + fk
        grew = fk.amax()
    else:
        kv, z = torch.addcmul(kv, lk.mT, vv), z + lk
        grew = None

    def read(kv: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The row ``[BH, 1, dv]`` from ``kv [BH, D, dv]`` and ``z [BH, 1, D]``, its finiteness
        sum (a non-finite query, key or value reaches the row or ``lk``) and the smallest
        denominator (log-space denominators are > 0 or NaN)."""
        den = torch.bmm(fq, z.mT)  # [BH, 1, 1]
        out = torch.bmm(fq, kv) / den
        return out, out.sum() + lk.sum(), den.amin() if log_space else den.abs().amin()

    out, total, low = read(kv, z)
    # one read-back, with (log space) the largest key feature at the old stabiliser
    total, smallest, *top = torch.stack([total, low] + ([grew] if grew is not None else [])).tolist()
    if top and not top[0] <= 1.0:  # a feature above the stabiliser (or NaN): raise it, check again
        new = absorb_one_finite(state, phi_k, v, log_space=True)
        out, total, low = read(new.kv.view(b * h, d_feat, dv), new.z.view(b * h, 1, d_feat))
        total, smallest = torch.stack([total, low]).tolist()
    else:
        new = dataclasses.replace(
            state,
            kv=kv.view(b, h, d_feat, dv),
            z=z.view(b, h, d_feat),
            length=state.length + 1,
        )
    if not (math.isfinite(total) and smallest >= eps):
        return None
    return out.view(b, h, 1, dv), new


def absorb_one_finite(state: CausalState, phi_k: torch.Tensor, v: torch.Tensor, *, log_space: bool) -> CausalState:
    """The state continued with one key of every head, without the quarantine of
    :func:`absorb_keys`: for a finite key row ``phi_k [B, H, 1, D]`` (log-features when
    ``log_space``) and value ``v [B, H, 1, dv]`` of the state's dtype (the caller checks
    finiteness, once, for its whole step),

    .. math::
        c' = \\max(c, \\max_D l_k), \\quad S' = e^{c - c'} S + e^{l_k - c'} v^\\top, \\quad
        z' = e^{c - c'} z + e^{l_k - c'}

    (plain maps: :math:`S' = S + \\phi_k v^\\top`, :math:`z' = z + \\phi_k`). A new state;
    ``state`` is not modified and its other fields (``poisoned``, ``owner``) carry over. The
    decoding short paths (a feature-map step, :func:`decode_one_finite`, and the key
    leaving ``sliding-window``'s window) add a key at :math:`c` as it is and take this
    update when the key raises the stabiliser."""
    b, h, _, d_feat = phi_k.shape
    dv = v.shape[-1]
    lk, vv = phi_k.reshape(b * h, d_feat, 1), v.reshape(b * h, 1, dv)
    kv, z = state.kv.reshape(b * h, d_feat, dv), state.z.reshape(b * h, 1, d_feat)
    m = None
    if log_space:
        assert state.m is not None
        m_old = state.m.reshape(b * h, 1, 1)
        m_new = torch.maximum(m_old, lk.amax(1, keepdim=True))  # [BH, 1, 1]
        restate = (m_old - m_new).exp_()
        fk = (lk - m_new).exp_()  # [BH, D, 1], <= 1
        kv = torch.addcmul(kv * restate, fk, vv)  # outer product; baddbmm is ~4x slower here
        z = (z * restate).add_(fk.mT)
        m = m_new.view(b, h, 1)
    else:
        kv = torch.addcmul(kv, lk, vv)
        z = z + lk.mT
    return dataclasses.replace(
        state, kv=kv.view(b, h, d_feat, dv), z=z.view(b, h, d_feat), m=m, length=state.length + 1
    )


def absorb_keys(
    state: CausalState | None,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_space: bool,
    key_padding_mask: torch.Tensor | None = None,
    drop: torch.Tensor | None = None,
) -> CausalState:
    """The causal state after consuming keys without queries: ``state`` (``None``: empty)
    continued with the key features ``phi_k [B, H, T, D]`` (log-features when
    ``log_space``) and values ``v [B, H, T, dv]``.

    .. math::
        c' = \\max\\big(c, \\max_{j, D} l_{k,j}\\big), \\quad
        S' = e^{c - c'} S + \\sum_j e^{l_{k,j} - c'} v_j^\\top, \\quad
        z' = e^{c - c'} z + \\sum_j e^{l_{k,j} - c'}

    (plain maps: :math:`S' = S + \\sum_j \\phi_k(k_j) v_j^\\top`, no stabiliser). Padded keys
    (``key_padding_mask [B, T]``) and the keys ``drop [B, H, T]`` are left out; a key whose
    features or value are not finite is left out too and sets the ``poisoned`` flag of its
    head (every later row that sees it is NaN), as the causal engine does. Used by decoding
    states that hold some keys exactly and hand them to the features later
    (``sliding-window``'s window).
    """
    dtype = compute_dtype(phi_k.dtype)
    phi_k, v = phi_k.to(dtype), v.to(dtype)
    b, h, t, d_feat = phi_k.shape
    dv = v.shape[-1]
    drop = torch.zeros(b, h, t, dtype=torch.bool, device=phi_k.device) if drop is None else drop
    if key_padding_mask is not None:
        drop = drop | key_padding_mask[:, None, :]
    bad = (_bad_rows(phi_k.detach(), log_space) | _bad_rows(v.detach(), False)) & ~drop  # [B, H, T]
    drop = drop | bad
    v = v.masked_fill(drop.unsqueeze(-1), 0.0)
    poisoned = bad.any(-1)  # [B, H]
    if state is not None and state.poisoned is not None:
        poisoned = poisoned | state.poisoned
    if state is None:
        kv = phi_k.new_zeros(b, h, d_feat, dv)
        z = phi_k.new_zeros(b, h, d_feat)
        m_old = phi_k.new_full((b, h, 1), float("-inf")) if log_space else None
        length = 0
    else:
        kv, z, m_old, length = state.kv.to(dtype), state.z.to(dtype), state.m, state.length
    if log_space:
        lk = phi_k.masked_fill(drop.unsqueeze(-1), float("-inf"))
        top = lk.detach().amax(-1).amax(-1, keepdim=True)  # [B, H, 1]
        m_new = torch.maximum(m_old, top)  # type: ignore[arg-type]
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        restate = torch.where(torch.isfinite(m_old), (m_old - safe).exp(), torch.zeros_like(safe))  # type: ignore[operator]
        fk = (lk - safe.unsqueeze(-1)).exp()  # [B, H, T, D], dropped keys 0
        kv = kv * restate.unsqueeze(-1) + fk.transpose(-1, -2) @ v
        z = z * restate + fk.sum(-2)
    else:
        fk = phi_k.masked_fill(drop.unsqueeze(-1), 0.0)
        kv = kv + fk.transpose(-1, -2) @ v
        z = z + fk.sum(-2)
        m_new = None
    return CausalState(kv, z, m_new, length + t, poisoned)
