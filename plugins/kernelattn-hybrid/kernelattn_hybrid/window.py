"""Blocked computation of sliding-window + feature-map attention, linear in sequence length.

For query :math:`i` let :math:`W_i` be its exact set: the keys inside the window
(:math:`|i - j| \\le w` non-causal; :math:`i - w < j \\le i` causal) and the first
``g`` keys (global tokens, "attention sinks"; with ``global_offset`` the keys
``o_b .. o_b + g - 1`` of row ``b``: the estimator passes each row's leading padding),
and, non-causal with ``heavy``, its head's heavy keys (:mod:`kernelattn_hybrid.heavy`).
Every other allowed key :math:`j` (:math:`F_i`) enters through the feature map, and one normaliser covers both:

.. math::
    \\mathrm{out}_i = \\frac{\\sum_{j \\in W_i} e^{s_{ij}} v_j + \\sum_{j \\in F_i} \\phi_q(q_i)^\\top \\phi_k(k_j) v_j}
                           {\\sum_{j \\in W_i} e^{s_{ij}} + \\sum_{j \\in F_i} \\phi_q(q_i)^\\top \\phi_k(k_j)},
    \\qquad s_{ij} = q_i^\\top k_j .

**Blocks.** Positions are cut into blocks of ``C >= w`` positions. Non-causal: the keys
of a query's own block and its neighbours (``b - 1, b, b + 1``) are its *local* keys:
there both the logits and the feature scores are formed (``[C, 3C]`` per block) and each
pair takes the term its set says. Keys of farther blocks are all feature keys; they reach
the query through per-block sums :math:`S_b = \\sum_{j \\in b} \\phi_k(k_j) v_j^\\top`
combined by one ``[nb, nb]`` product with a 0/1 matrix (in groups of blocks beyond 1024
blocks, linear). The blocks of all sequences lie end to end in one flat layout, each sequence
between two zero blocks, so that every block's local keys are a view (``unfold``) that the
batched products read without a copy; without autograd the per-block work runs in
cache-sized chunks and the exponentials' arguments are clamped off ``exp``'s slow path
(:func:`_noncausal`). Causal: the exact part is
formed on blocks ``b - 1, b`` (``[C, 2C]``), and the feature part, every key with
:math:`i - j \\ge w`, is the engine's causal recurrence
(:func:`~kernelattn_core.engine.chunked.causal_linear_attention`, the one every causal
estimator feeds) over the feature keys delayed by :math:`w` positions. Time
:math:`O(N C (d + d_v) + N D d_v)`, memory :math:`O(N C + (N / C) D d_v)`; no ``[N, M]``
tensor. (The non-causal far product adds :math:`O((N / C)^2 D d_v)` up to
:data:`FAR_MATMUL_BLOCKS` blocks, 32K tokens at ``C = 32``, where a CPU runs it about as fast
as the linear grouped sums or faster; they take over beyond.)

**Stabilisers (exact, causal-safe).** For log-space maps
(:math:`l = \\log \\phi`) the feature score is
:math:`\\phi_q(q_i)^\\top \\phi_k(k_j) = e^{a_i + c_j} \\sum_D e^{l_{q,i} - a_i} e^{l_{k,j} - c_j}`
with :math:`a_i = \\max_D l_{q,i}` and a key constant :math:`c_j`: the global maximum
:math:`c` of the key log-features (non-causal) or their prefix maximum
:math:`c_j = \\max_{j' \\le j} \\max_D l_{k,j'}` (causal: it depends on earlier keys only).
The two parts of row :math:`i` are first summed on their own scales,

.. math::
    E_i = \\sum_{j \\in W_i} e^{s_{ij} - m_i}, \\quad m_i = \\max_{j \\in W_i} s_{ij},
    \\qquad
    Z_i = \\sum_{j \\in F_i} e^{-(a_i + c_i)} \\phi_q(q_i)^\\top \\phi_k(k_j),

where every exact term is :math:`\\le 1` by the maximum and every feature term through
the gate :math:`e^{c_j - c_i} \\le 1` for :math:`j \\le i` (causal: the recurrence's
stabiliser is the delayed prefix maximum :math:`c_{i - w}`, the largest log-feature of the
keys row :math:`i` reads through the features, so the row's feature scale is
:math:`a_i + c_{i - w}`, written :math:`a_i + c_i` below, and a later, larger key never
changes an earlier output). Then both are restated at the row's log-normaliser

.. math:: M_i = \\max\\left(m_i + \\log E_i,\\; a_i + c_i + \\log |Z_i|\\right),

that is, the exact part is scaled by :math:`e^{m_i - M_i} \\le 1` and the feature part by
:math:`e^{a_i + c_i - M_i}`. :math:`M_i` cancels exactly in the ratio, and the restated
denominator lies in :math:`[1, 2]` (positive maps), so neither the output nor its
gradient (which carries :math:`1 / \\mathrm{den}`) can blow up. A single stabiliser
:math:`\\max(m_i, a_i + c_i)` does not give this: :math:`a_i + c_i` only *bounds* the
feature scores (non-causal, :math:`c` comes from keys that row :math:`i` may see exactly),
so at input norm 10 in float32 the denominator of a row could underflow to a subnormal
number and :math:`q` received an infinite or NaN gradient. The feature scale's exponent is
capped at :math:`\\tfrac12 \\log` of the dtype's largest number (it only binds when
:math:`Z_i` is itself near underflow). For maps that are not in log space,
:math:`a = c = 0`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from kernelattn_core.toolkit import absorb_one_finite, exp_kept, exp_nonpositive, prefix_stabiliser

from .heavy import HeavyKeys

NEG = float("-inf")


def _blocks(x: torch.Tensor, length: int, block: int) -> torch.Tensor:
    """``x [B, H, L, e]`` padded with zeros to ``length`` and cut into ``[B, H, L / C, C, e]``."""
    return _rows(x, length).unflatten(-2, (length // block, block))


def _rows(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x [..., L', e]`` padded with zero rows to ``length`` (no copy when it has them)."""
    return x if x.shape[-2] == length else F.pad(x, (0, 0, 0, length - x.shape[-2]))


def _local(x: torch.Tensor, causal: bool) -> torch.Tensor:
    """Per block, the concatenation of the previous, own and (non-causal) next block:
    ``[B, H, nb, C, e]`` to ``[B, H, nb, 2C or 3C, e]`` (zeros beyond the ends)."""
    padded = F.pad(x, (0, 0, 0, 0, 1, 0 if causal else 1))  # one zero block each side
    parts = (
        [padded[:, :, :-2], padded[:, :, 1:-1], padded[:, :, 2:]]
        if not causal
        else [padded[:, :, :-1], padded[:, :, 1:]]
    )
    return torch.cat(parts, dim=-2)


def window_attention_blocked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor | Callable[[torch.Tensor, bool], torch.Tensor],
    phi_k: torch.Tensor | Callable[[torch.Tensor, bool], torch.Tensor],
    *,
    log_space: bool,
    window: int,
    global_tokens: int,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    block_size: int,
    global_offset: torch.Tensor | None = None,
    heavy: HeavyKeys | None = None,
) -> torch.Tensor:
    """Sliding-window + feature-map attention (see the module docstring).

    Parameters
    ----------
    q, k : Tensor ``[B, H, N, d]``, ``[B, H, M, d]``
        Scaled queries and keys (logits are ``q k^T``).
    v : Tensor ``[B, H, M, dv]``
    phi_q, phi_k : Tensor ``[B, H, N, D]``, ``[B, H, M, D]``, or a function
        Features, or log-features when ``log_space``; or a function ``(x, query) -> [B, H,
        L, D]`` of row-wise features, which the non-causal path applies to its padded copies
        of ``q`` and ``k`` (no copy of the features).
    window : int
        Half-width ``w`` (non-causal) or number of most recent keys (causal).
    global_tokens : int
        The first this many keys are exact for every query.
    key_padding_mask : Tensor ``[B, M]`` of bool, optional
    block_size : int
        Block length ``C`` (at least ``window``).
    global_offset : Tensor ``[B]`` of int, optional
        Where the global tokens of each row start: the keys ``o_b .. o_b + g - 1`` of row
        ``b`` (the estimator passes the row's leading padding,
        :func:`~kernelattn_hybrid.naive.leading_padding`); ``None``: ``0 .. g - 1``.
    heavy : HeavyKeys, optional
        Non-causal only: each head's heavy keys (:mod:`kernelattn_hybrid.heavy`), exact
        for every query like global tokens (valid keys that are not global tokens).

    Returns
    -------
    Tensor ``[B, H, N, dv]``; rows with no allowed key are zero. Non-causal, a strided
    view of the kernel's padded layout (not contiguous: the estimator's own masking step
    makes its output contiguous).
    """
    if causal and heavy is not None:
        raise ValueError("heavy keys are defined for non-causal attention only")
    if causal and callable(phi_q):
        phi_q = phi_q(q, True)
    if causal and callable(phi_k):
        phi_k = phi_k(k, False)
    if not causal:
        return _noncausal(
            q,
            k,
            v,
            phi_q,
            phi_k,
            log_space=log_space,
            window=window,
            global_tokens=global_tokens,
            key_padding_mask=key_padding_mask,
            block_size=block_size,
            global_offset=global_offset,
            heavy=heavy,
        )
    return _causal(
        q,
        k,
        v,
        phi_q,
        phi_k,
        log_space=log_space,
        window=window,
        global_tokens=global_tokens,
        key_padding_mask=key_padding_mask,
        block_size=block_size,
        global_offset=global_offset,
    )


def _global_keys(
    global_offset: torch.Tensor | None, g: int, valid: torch.Tensor, m_keys: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For per-row global tokens (``global_offset [B]``): their key positions, clamped into
    ``[0, M)`` for gathering, and whether each is a valid key (inside ``[0, M)`` and not
    padded; ``valid [B, >= M]``), both ``[B, g]``. ``None`` without offsets (the keys
    ``0 .. g - 1``, sliced)."""
    if global_offset is None or g == 0:
        return None
    gpos = global_offset.to(valid.device)[:, None] + torch.arange(g, device=valid.device)  # [B, g]
    index = gpos.clamp(max=m_keys - 1)
    return index, (gpos < m_keys) & valid.gather(1, index)


def _gather_keys(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [B, H, M, e]`` at the per-row positions ``index [B, g]``: ``[B, H, g, e]``."""
    b_, h_, _, e = x.shape
    return x.gather(2, index[:, None, :, None].expand(b_, h_, index.shape[1], e))


def _gather_head_keys(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [B, H, M, e]`` at the per-head positions ``index [B, H, s]``: ``[B, H, s, e]``."""
    return x.gather(2, index[..., None].expand(*index.shape, x.shape[-1]))


def _is_global(global_offset: torch.Tensor | None, g: int, pos: torch.Tensor) -> torch.Tensor:
    """Whether the positions ``pos [L]`` are global tokens: ``[1, L]`` (``pos < g``) or, with
    ``global_offset [B]``, ``[B, L]``."""
    if global_offset is None:
        return (pos < g)[None]
    o = global_offset.to(pos.device)[:, None]
    return (pos >= o) & (pos < o + g)


#: positions per chunk of the engine's causal recurrence that carries the feature part
FEATURE_CHUNK = 64


def _causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    *,
    log_space: bool,
    window: int,
    global_tokens: int,
    key_padding_mask: torch.Tensor | None,
    block_size: int,
    global_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """The causal case of :func:`window_attention_blocked`.

    Exact part: blocks ``b - 1, b`` of every block (logits on the window and the global
    tokens). Feature part: key :math:`j` reaches row :math:`i` through the features once
    :math:`i - j \\ge w`, so it is the engine's causal recurrence
    (:func:`~kernelattn_core.engine.chunked.causal_linear_attention`) over the feature keys
    *delayed by* :math:`w` positions: :math:`\\tilde k_i = k_{i - w}`, with the delayed prefix
    maximum :math:`c_{i - w}` as its stabiliser (a later, larger key never changes a row).
    """
    from kernelattn_core.toolkit import causal_linear_attention

    recorded = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, phi_q, phi_k))
    b_, h_, n, _ = q.shape
    m_keys = k.shape[-2]
    dv = v.shape[-1]
    device = q.device
    c_blk = block_size
    nb = -(-max(n, m_keys) // c_blk)
    length = nb * c_blk
    g = min(global_tokens, m_keys)

    # ------------------------------------------------------------ key validity and position sets
    pos = torch.arange(length, device=device)
    valid = (pos < m_keys).expand(b_, length)  # [B, L]
    if key_padding_mask is not None:
        valid = valid & ~F.pad(key_padding_mask, (0, length - m_keys), value=True)
    is_global = _is_global(global_offset, g, pos)  # [1 or B, L]
    feat_key = valid & ~is_global  # keys that may enter through features [B, L]
    glob = _global_keys(global_offset, g, valid, m_keys)  # per-row global keys, or None: 0 .. g - 1

    # ------------------------------------------------------------ feature part: the causal recurrence, delayed by w
    delayed = (pos - window).clamp(min=0)  # [L]: the key position row i reads, i - w
    fq = _rows(phi_q, length)
    if log_space:
        a = fq.detach().amax(-1)  # [B, H, L]
        a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
        fq = _exp_masked(fq - a.unsqueeze(-1), None, recorded)
        lk = _rows(phi_k, length).masked_fill(~feat_key[:, None, :, None], NEG)
        _, c = prefix_stabiliser(lk.detach().amax(-1))  # [B, H, L]: prefix maximum (the first finite value before it)
        fk = _exp_masked(lk - c.unsqueeze(-1), feat_key[:, None, :, None], recorded)  # [B, H, L, D],
        # <= 1, non-feature keys 0
        m_f = a + c[..., delayed]  # [B, H, L]: the feature part's scale, a_i + c_{i - w}
        stab = c[..., delayed].contiguous()  # non-decreasing, finite
    else:
        a = torch.zeros(b_, h_, length, dtype=q.dtype, device=device)
        fk = _rows(phi_k, length).masked_fill(~feat_key[:, None, :, None], 0.0)
        m_f = a
        stab = None
    v1 = torch.cat([_rows(v, length), torch.ones_like(_rows(v, length)[..., :1])], dim=-1)  # [B, H, L, dv + 1]
    fk_d = F.pad(fk, (0, 0, window, 0))[:, :, :length]  # [B, H, L, D]: zeros before position w
    v1_d = F.pad(v1, (0, 0, window, 0))[:, :, :length]
    s0 = fq.new_zeros(b_, h_, fq.shape[-1], dv + 1)
    m0 = None if stab is None else stab[..., :1]
    out_f, _ = causal_linear_attention(fq, fk_d, v1_d, s0, stab, m0, FEATURE_CHUNK)
    num_f, den_f = out_f.split([dv, 1], dim=-1)  # [B, H, L, dv], [B, H, L, 1]
    den_f = den_f.squeeze(-1)

    # ------------------------------------------------------------ exact part: blocks b - 1 and b
    qb = _blocks(q, length, c_blk)  # [B, H, nb, C, d]
    kb = _blocks(k, length, c_blk)
    vb = _blocks(v, length, c_blk)  # [B, H, nb, C, dv]
    k_loc, v_loc = _local(kb, True), _local(vb, True)  # [B, H, nb, 2C, .]
    r_loc = k_loc.shape[-2]
    qpos = pos.view(nb, c_blk)  # [nb, C]
    kpos = qpos[:, :1] - c_blk + torch.arange(r_loc, device=device)  # [nb, R] (may be < 0)
    in_range = (kpos >= 0) & (kpos < length)
    valid_loc = valid[:, kpos.clamp(0, length - 1)] & in_range  # [B, nb, R]
    diff = qpos[:, :, None] - kpos[:, None, :]  # [nb, C, R]: i - j
    in_win = (diff >= 0) & (diff < window)
    local_key = ~is_global[:, kpos.clamp(0, length - 1)]  # [1 or B, nb, R]: not a global token
    exact_loc = in_win[None] & valid_loc[:, :, None, :] & local_key[:, :, None, :]  # [B, nb, C, R]
    s_loc = (qb @ k_loc.transpose(-1, -2)).masked_fill(~exact_loc[:, None], NEG)  # [B, H, nb, C, R]
    win_max = s_loc.detach().amax(-1).flatten(-2)  # [B, H, L]
    if g > 0:
        qg = F.pad(q, (0, 0, 0, length - n))  # [B, H, L, d]
        if glob is None:
            k_g, v_g = k[:, :, :g], v[:, :, :g]
            g_ok = valid[:, None, None, :g] & (pos[:, None] >= torch.arange(g, device=device))[None, None]
        else:  # per-row global keys [B, H, g, .]: valid ones at or before the row
            index, ok = glob
            k_g, v_g = _gather_keys(k, index), _gather_keys(v, index)
            g_ok = (ok[:, None, :] & (pos[None, :, None] >= index[:, None, :]))[:, None]  # [B, 1, L, g]
        s_g = (qg @ k_g.transpose(-1, -2)).masked_fill(~g_ok, NEG)  # [B, H, L, g]
        win_max = torch.maximum(win_max, s_g.detach().amax(-1))
    m_e = torch.where(torch.isfinite(win_max), win_max, torch.zeros_like(win_max))  # [B, H, L]
    # <= 1; exactly 0 off the exact set (a future key's value must not reach a row)
    e_loc = _exp_masked(s_loc - m_e.unflatten(-1, (nb, c_blk)).unsqueeze(-1), exact_loc[:, None], recorded)
    den_e = e_loc.sum(-1).flatten(2, 3)  # [B, H, L]
    if g > 0:
        e_g = (s_g - m_e.unsqueeze(-1)).exp()  # [B, H, L, g]
        den_e = den_e + e_g.sum(-1)

    # ------------------------------------------------------------ one log-normaliser per row
    with torch.no_grad():
        l_e = m_e + den_e.log()  # -inf: no exact key
        l_f = m_f + den_f.abs().log()  # -inf: no feature key (abs: signed maps)
        top = torch.maximum(l_e, l_f)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows with no allowed key
        cap = 0.5 * math.log(torch.finfo(top.dtype).max)  # e^cap * e^cap stays finite
        w_e = torch.where(den_e > 0, (m_e - top).clamp(max=0.0).exp(), torch.zeros_like(top))  # <= 1
        w_f = (m_f - top).clamp(max=cap).exp()  # [B, H, L]
    num = ((e_loc * w_e.unflatten(-1, (nb, c_blk)).unsqueeze(-1)) @ v_loc).flatten(2, 3)  # [B, H, L, dv]
    num = num + num_f * w_f.unsqueeze(-1)
    den = den_e * w_e + den_f * w_f  # [B, H, L], in [1, 2] for positive maps
    if g > 0:
        num = num + (e_g * w_e.unsqueeze(-1)) @ v_g

    num, den = num[:, :, :n], den[:, :, :n]
    safe = torch.where(den > 0, den, torch.ones_like(den))
    out = num / safe.unsqueeze(-1)
    return torch.where((den > 0).unsqueeze(-1), out, torch.zeros_like(out))


_STATIC: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _exp_masked(x: torch.Tensor, keep: torch.Tensor | None, recorded: bool) -> torch.Tensor:
    """:math:`e^x` of fresh stabilised arguments ``x`` (:math:`\\le 0` where kept), exactly 0
    where ``keep`` (a boolean or 0/1 mask; ``None``: everywhere kept) is False or 0, with
    arguments below the dtype's normal range raised to its edge (torch's exp is several
    times slower at ``-inf`` and far below 0), computed in place. Under autograd through
    :func:`~kernelattn_core.engine.chunked.exp_kept` (exp's derivative, no clamp backward: a
    clamp's backward cost more than exp's slow path at ``-inf``), without it
    :func:`~kernelattn_core.engine.chunked.exp_nonpositive` (``keep`` as a factor). ``x``
    may hold ``-inf`` where ``keep`` is False."""
    if recorded:
        return exp_kept(x, keep)
    return exp_nonpositive(x, None if keep is None else keep.to(x.dtype))


def _static_masks(
    block: int, window: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bias, inside)`` ``[C, 3C]`` for the non-causal local block: query ``r`` of block
    ``b`` is position :math:`bC + r`, key slot ``t`` position :math:`(b - 1)C + t`, so
    :math:`i - j = C + r - t` whatever the block. ``bias`` is 0 inside the window and
    :math:`-\\infty` outside; ``outside`` is 1 outside the window and 0 inside."""
    key = (block, window, str(device), dtype)
    if key not in _STATIC:
        r = torch.arange(block, device=device)[:, None]
        t = torch.arange(3 * block, device=device)[None, :]
        inside = (block + r - t).abs() <= window
        bias = torch.zeros(inside.shape, dtype=dtype, device=device).masked_fill(~inside, NEG)
        _STATIC[key] = (bias, (~inside).to(dtype))
        if len(_STATIC) > 64:  # a handful of shapes in practice
            _STATIC.pop(next(iter(_STATIC)))
    return _STATIC[key]


def _flat_blocks(x: torch.Tensor, nb: int, block: int, ones: bool = False) -> torch.Tensor:
    """``x [B, H, L', e]`` (``L' <= nb C``) laid out flat as ``[T C, e]`` rows: for every
    ``(b, h)`` one zero block, the ``L'`` rows padded with zero rows to ``nb C``, one zero
    block (``P = nb + 2`` blocks, ``T = B H P``); with ``ones`` a last column that is 1 on
    the ``L'`` rows of ``x`` (``[T C, e + 1]``).

    In this layout the local keys of every block but the first and the last (its own and
    both neighbours, zeros beyond the ends of each sequence) are one ``unfold(0, 3C, C)`` of
    the rows: a strided view whose batch dimension has a single stride, which ``bmm`` reads
    without the copy that a ``[B, H, nb, ...]`` view of overlapping windows costs (two
    strides to merge). One copy of ``x`` is made; gradients flow back through it."""
    b_, h_, length, e = x.shape
    p = nb + 2
    if torch.is_grad_enabled() and x.requires_grad:  # F.pad: its backward is a view of the gradient
        if ones:
            x = torch.cat([x, torch.ones_like(x[..., :1])], -1)
        pad = (0, 0, block, (p - 1) * block - length)
        return F.pad(x.reshape(b_ * h_, length, x.shape[-1]), pad).view(b_ * h_ * p * block, -1)
    buf = x.new_empty(b_ * h_ * p * block, e + int(ones))  # written once: the zero rows, then x
    rows = buf.view(b_ * h_, p * block, e + int(ones))
    rows[:, :block].zero_()
    rows[:, block + length :].zero_()
    rows[:, block : block + length, :e].copy_(x.reshape(b_ * h_, length, e))
    if ones:
        rows[:, block : block + length, e].fill_(1.0)
    return buf


#: up to this many blocks per sequence the non-causal far sums are one ``[nb, nb]`` product
#: (quadratic in the blocks, but one pass). Measured 2026-11-26, 2 threads, MiniLM heads, the
#: whole call with the product over the call with the grouped sums of
#: :func:`_far_sums_grouped`: 4K training 0.86x, 8K inference 0.86x, 16K (514 blocks)
#: 0.92-1.09x in two runs (inference) and 1.09x (training): no clear winner there. Longer
#: inputs take the grouped sums (linear; at 32K 0.82x the prefix and suffix scans they
#: replace)
FAR_MATMUL_BLOCKS = 1024

#: blocks per group of :func:`_far_sums_grouped`
FAR_GROUP = 16


def _far_of(nb: int, like: torch.Tensor) -> torch.Tensor:
    """``[nb, nb]``: 1 where two blocks are two or more apart, else 0 (``like``'s dtype and device)."""
    idx = torch.arange(nb, device=like.device)
    return ((idx[:, None] - idx[None, :]).abs() >= 2).to(like.dtype)


def _far_sums(s_blk: torch.Tensor) -> torch.Tensor:
    """For per-block sums ``s_blk [R, nb, D, e]``, the sums over the blocks two or more
    away from each block, :math:`F_b = \\sum_{|b' - b| \\ge 2} S_{b'}`, ``[R, nb, D, e]``.

    Up to :data:`FAR_MATMUL_BLOCKS` blocks one ``[nb, nb]`` product with a 0/1 matrix; beyond,
    in groups of blocks (:func:`_far_sums_grouped`). Every :math:`F_b` is a sum of the
    blocks' own terms, never total minus the near blocks: a small far sum beside a large
    block is never the difference of two large numbers."""
    nb = s_blk.shape[1]
    if nb <= FAR_MATMUL_BLOCKS:
        return (_far_of(nb, s_blk) @ s_blk.flatten(-2)).view(s_blk.shape)
    return _far_sums_grouped(s_blk)


def _far_sums_grouped(s_blk: torch.Tensor) -> torch.Tensor:
    """:func:`_far_sums` beyond :data:`FAR_MATMUL_BLOCKS` blocks: linear in ``nb``, and
    again without differences.

    Blocks in groups of :data:`FAR_GROUP` = ``G``: one product with a ``[G + 3, G]`` 0/1
    matrix gives, per group, the far sums inside the group and three group sums (all blocks,
    all but the last, all but the first); block ``i`` of group ``B`` then adds the groups two
    or more away (a prefix and a suffix sum over the groups, a ``G``-th of the data), group
    ``B - 1`` (without its last block when ``i = 0``) and group ``B + 1`` (without its first
    block when ``i = G - 1``)."""
    r, nb = s_blk.shape[:2]
    g = FAR_GROUP
    ns = -(-nb // g)
    s = s_blk.reshape(r, nb, -1)
    s = F.pad(s, (0, 0, 0, ns * g - nb)).view(r, ns, g, -1)  # [R, groups, G, K], zero blocks at the end
    y = _group_weights(g, s) @ s  # [R, groups, G + 3, K]
    within, total, but_last, but_first = y[:, :, :g], y[:, :, g], y[:, :, g + 1], y[:, :, g + 2]
    zero = torch.zeros_like(total[:, :1])
    before = torch.cat([zero, zero, total[:, :-2].cumsum(1)], 1)[:, :ns]  # groups <= B - 2
    after = torch.cat([total[:, 2:].flip(1).cumsum(1).flip(1), zero, zero], 1)[:, -ns:]  # groups >= B + 2
    far_groups = before + after
    prev, prev_but_last = (torch.cat([zero, x[:, :-1]], 1) for x in (total, but_last))  # group B - 1
    nxt, nxt_but_first = (torch.cat([x[:, 1:], zero], 1) for x in (total, but_first))  # group B + 1
    first = far_groups + prev_but_last + nxt  # block 0 of each group
    mid = far_groups + prev + nxt
    last = far_groups + prev + nxt_but_first  # block G - 1
    add = torch.cat([first[:, :, None], mid[:, :, None].expand(r, ns, g - 2, -1), last[:, :, None]], 2)
    return (within + add).reshape(r, ns * g, -1)[:, :nb].reshape(s_blk.shape)


def _group_weights(g: int, like: torch.Tensor) -> torch.Tensor:
    """``[G + 3, G]`` 0/1: rows ``i < G`` pick the blocks of a group two or more from block
    ``i``; then all blocks, all but the last, all but the first."""
    idx = torch.arange(g, device=like.device)
    far = (idx[:, None] - idx[None, :]).abs() >= 2
    ones = torch.ones(1, g, dtype=torch.bool, device=like.device)
    return torch.cat([far, ones, idx[None] < g - 1, idx[None] > 0]).to(like.dtype)


#: without autograd, the non-causal local part runs over chunks of blocks whose temporaries
#: (``[chunk, C, 3C]`` scores) total about this many bytes: they stay in the cache and the
#: allocator reuses them, where whole-input temporaries are paged in afresh on many calls
#: (glibc returns blocks above 32 MB to the system). Measured 2026-11-26, 2 threads, one
#: process per setting: 4 MB gives 8K (batch 1) 145-158 ms a call and N = 512 (batch 8)
#: 57-66 ms, steadily; one pass 125-195 ms and 61-73 ms, 16-32 MB chunks swing between the
#: two (the allocator's state decides)
CHUNK_BYTES = 4 << 20


def _noncausal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor | Callable[[torch.Tensor, bool], torch.Tensor],
    phi_k: torch.Tensor | Callable[[torch.Tensor, bool], torch.Tensor],
    *,
    log_space: bool,
    window: int,
    global_tokens: int,
    key_padding_mask: torch.Tensor | None,
    block_size: int,
    global_offset: torch.Tensor | None = None,
    heavy: HeavyKeys | None = None,
) -> torch.Tensor:
    """The non-causal case of :func:`window_attention_blocked` with few passes over the
    ``[T, C, 3C]`` local scores (``T = B H (nb + 2)`` blocks of the flat layout of
    :func:`_flat_blocks`, whose local keys are views, not copies).

    The window is one static ``[C, 3C]`` bias (the offset :math:`i - j` of a local pair
    does not depend on the block), key validity one ``[B, nb + 2, 3C]`` bias, and
    numerators and denominators come out of one product each (the values carry a column of
    ones). The feature part is the local pairs outside the window plus, for blocks two or
    more apart, per-block sums :math:`S_b = \\sum_{j \\in b} \\phi_k(k_j) v_j^\\top` combined
    by :func:`_far_sums` (sums of non-negative terms for positive maps: no difference of
    large numbers, which would drown a row whose exact terms lie far below its feature
    scale). The stabilisers are those of the module docstring: exact terms at the largest
    exact logit :math:`m_i`, feature terms at :math:`a_i + c` (:math:`c` the largest key
    log-feature), both restated at the row's log-normaliser. Everything per block is
    computed by :func:`_noncausal_local`: once over all blocks under autograd, over chunks
    of :data:`CHUNK_BYTES` without it (no Python loop is recorded by autograd). Heavy keys
    join the global keys (exact for every row) and leave the window and feature sets of
    their head."""
    b_, h_, n, _ = q.shape
    m_keys, dv = k.shape[-2], v.shape[-1]
    device, dtype = q.device, q.dtype
    c_blk = block_size
    nb = -(-max(n, m_keys) // c_blk)
    p = nb + 2  # blocks per sequence in the flat layout: a zero block at each end
    t_blk = b_ * h_ * p
    g = min(global_tokens, m_keys)

    pos = torch.arange(m_keys, device=device)
    valid = torch.ones(b_, m_keys, dtype=torch.bool, device=device)  # [B, M]
    if key_padding_mask is not None:
        valid = ~key_padding_mask
    feat_key = valid & ~_is_global(global_offset, g, pos)  # keys of the window and feature sets (globals apart) [B, M]
    if heavy is not None:  # per head: [B, H, M]
        feat_key = feat_key[:, None, :] & ~heavy.mask(m_keys)
    glob = _global_keys(global_offset, g, valid, m_keys)  # per-row global keys, or None: 0 .. g - 1

    def flat(x: torch.Tensor, ones: bool = False) -> torch.Tensor:
        return _flat_blocks(x, nb, c_blk, ones)

    # Queries, keys, values, features and masks in the flat layout, each one copy; the steps
    # after it work in place on tensors this function owns (autograd saves none of what they
    # overwrite). Non-feature keys (padding, globals) and the zero blocks: 0 features, 0
    # values and ones. Features given as a function are computed on the flat rows (no copy).
    q_f, k_f = flat(q), flat(k)  # [T C, d]
    grad = torch.is_grad_enabled()
    recorded = grad and any(t.requires_grad for t in (q, k, v, phi_q, phi_k) if isinstance(t, torch.Tensor))
    lead = (b_, h_, p * c_blk)
    lq, own_q = _flat_features(phi_q, q_f, True, lead, nb, c_blk, recorded)  # [T C, D]
    lk, own_k = _flat_features(phi_k, k_f, False, lead, nb, c_blk, recorded)
    recorded = recorded or (grad and (lq.requires_grad or lk.requires_grad))  # trainable feature maps
    # one pass under autograd (no Python loop is recorded) and under a compiler (which fuses
    # it; a loop would unroll); chunks of blocks otherwise
    one_pass = recorded or torch.compiler.is_compiling()
    # Without autograd the arguments of exp are clamped: torch's exp leaves its fast path far
    # below 0 or at -inf (4.6x slower with half the entries -inf). The local logits at a third
    # of log(smallest normal) (float32: -29), not lower, so that their products with the
    # values are not subnormal (slower still): a clamped term is at most e^-29 = 2.5e-13 of
    # its row's largest exact term, at a key whose values and ones are 0 (padding) or that the
    # row sees through its features (rows with no exact key drop their exact part, below).
    # The features at log(smallest normal), as exp_nonpositive does; the non-feature keys'
    # features are set to 0 after the exponential. Under autograd no clamp: its backward costs
    # more than it saves, and masked terms are exact zeros.
    tiny = math.log(torch.finfo(dtype).tiny)
    low_e, low_f = (-math.inf, -math.inf) if recorded else (tiny / 3, tiny)
    per_head = feat_key if feat_key.dim() == 3 else feat_key[:, None, :]  # [B, 1 or H, M]
    not_feat = flat(per_head[..., None].expand(b_, h_, m_keys, 1).to(dtype)) == 0  # [T C, 1]
    if log_space:
        a_f = lq.detach().amax(-1, keepdim=True)  # [T C, 1]
        a_f = torch.where(torch.isfinite(a_f), a_f, torch.zeros_like(a_f))
        c = lk.detach().amax(-1, keepdim=True).masked_fill(not_feat, NEG).view(b_, h_, -1).amax(-1)  # [B, H]
        c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
        c_rows = c[..., None].expand(b_, h_, p * c_blk).reshape(-1, 1)  # [T C, 1]
        fq_f = _exp_(lq.sub_(a_f) if own_q else lq - a_f, low_f)  # e^{l_q - a}, at most 1
        fk_f = lk.sub_(c_rows) if own_k else lk - c_rows  # then e^{l_k - c}, at most 1, 0 at non-feature keys
        if recorded:
            _exp_(fk_f.masked_fill_(not_feat, NEG), low_f)  # (exp saves its result: masked before)
        else:
            _exp_(fk_f, low_f).masked_fill_(not_feat, 0.0)
    else:
        a_f = torch.zeros(t_blk * c_blk, 1, dtype=dtype, device=device)
        c = torch.zeros(b_, h_, dtype=dtype, device=device)
        fq_f = lq
        fk_f = lk.masked_fill_(not_feat, 0.0) if own_k else lk.masked_fill(not_feat, 0.0)
    v1_f = flat(v, ones=True).masked_fill_(not_feat, 0.0)  # [T C, dv + 1]: values and a column of ones

    # Blocks 1 .. T - 2 (block 0 and block T - 1 are zero blocks, outside every sequence):
    # their queries [T - 2, C, .]; their local keys and values as views [T - 2, ., 3C]
    span = 3 * c_blk
    inner = slice(1, t_blk - 1)
    blk = _Blocks(
        q=q_f.view(t_blk, c_blk, -1)[inner],
        fq=fq_f.view(t_blk, c_blk, -1)[inner],
        k_loc=k_f.unfold(0, span, c_blk),  # [T - 2, d, 3C]
        fk_loc=fk_f.unfold(0, span, c_blk),  # [T - 2, D, 3C]
        v_loc=v1_f.unfold(0, span, c_blk).transpose(1, 2),  # [T - 2, 3C, dv + 1]
        # the key bias (invalid, global, padding or beyond the end) of every block: [T - 2, 3C]
        key_bias=_key_bias(feat_key, h_, p, c_blk, dtype)[inner],
        # the feature part's log-scale a_i + c per row: [T - 2, C]
        m_f=(a_f.view(t_blk, c_blk) + c[..., None].expand(b_, h_, p).reshape(t_blk, 1))[inner],
        low=low_e,
        far=None,
        s_blk=None,
        far_of=None,
        k_g=None,
        v_g=None,
        g_bias=None,
    )
    if nb > 2:  # the blocks two or more apart
        blocks = (b_ * h_, p, c_blk)
        s_blk = fk_f.view(*blocks, -1).transpose(-1, -2) @ v1_f.view(*blocks, dv + 1)  # [BH, P, D, dv + 1]
        if one_pass or p > FAR_MATMUL_BLOCKS:
            blk.far = _far_sums(s_blk).reshape(t_blk, -1, dv + 1)[inner]  # [T - 2, D, dv + 1]
        else:  # formed chunk by chunk (_far_rows): no [T, D, dv + 1] tensor
            blk.s_blk, blk.far_of = s_blk.flatten(-2), _far_of(p, s_blk)
    if g > 0 or heavy is not None:  # the global (and heavy) keys of every block's sequence, ones, their bias
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # keys, values, validity [B, H, ., .]
        if g > 0 and glob is None:
            parts.append((k[:, :, :g], v[:, :, :g], valid[:, None, :g].expand(b_, h_, g)))
        elif g > 0:  # per-row global keys [B, H, g, .]
            index, g_valid = glob
            parts.append((_gather_keys(k, index), _gather_keys(v, index), g_valid[:, None].expand(b_, h_, g)))
        if heavy is not None:  # per-head heavy keys [B, H, s, .]
            parts.append((_gather_head_keys(k, heavy.index), _gather_head_keys(v, heavy.index), heavy.valid))
        k_g, v_g, g_valid = (torch.cat(x, 2) if len(x) > 1 else x[0] for x in zip(*parts, strict=True))
        n_g = k_g.shape[2]
        per_block = (b_, h_, p, n_g)
        ones = torch.ones(b_, h_, n_g, 1, dtype=v.dtype, device=device)
        blk.k_g = k_g[:, :, None].expand(*per_block, k.shape[-1]).reshape(t_blk, n_g, -1)[inner]  # [T - 2, G, d]
        v_g = torch.cat([v_g, ones], -1)[:, :, None].expand(*per_block, dv + 1)
        blk.v_g = v_g.reshape(t_blk, n_g, dv + 1)[inner]
        g_bias = torch.zeros(b_, h_, n_g, dtype=dtype, device=device).masked_fill(~g_valid, NEG)
        blk.g_bias = g_bias[:, :, None].expand(*per_block).reshape(t_blk, 1, n_g)[inner]  # [T - 2, 1, G]

    bias, outside = _static_masks(c_blk, window, device, dtype)
    if one_pass:
        out = _noncausal_local(blk, 0, t_blk - 2, bias, outside)
    else:
        out = q.new_empty(t_blk - 2, c_blk, dv)
        chunk = max(1, CHUNK_BYTES // (c_blk * span * q.element_size() * 3))  # three [C, 3C] temporaries per block
        for i0 in range(0, t_blk - 2, chunk):
            i1 = min(i0 + chunk, t_blk - 2)
            out[i0:i1] = _noncausal_local(blk, i0, i1, bias, outside)
    # row r of sequence s (block 1 + r // C of it) is row s P C + r of ``out`` (which starts at block 1)
    rows = p * c_blk * dv
    return out.as_strided((b_, h_, n, dv), (h_ * rows, rows, dv, 1))  # the real rows: a view, not a copy


def _exp_(x: torch.Tensor, low: float) -> torch.Tensor:
    """``x`` overwritten by :math:`e^{\\max(x, low)}` (no clamp for ``low = -inf``)."""
    return (x if low == -math.inf else x.clamp_(min=low)).exp_()


def _flat_features(
    phi: torch.Tensor | Callable[[torch.Tensor, bool], torch.Tensor],
    x_f: torch.Tensor,
    query: bool,
    lead: tuple[int, int, int],
    nb: int,
    block: int,
    recorded: bool,
) -> tuple[torch.Tensor, bool]:
    """Features ``[T C, D]`` in the flat layout and whether the caller may overwrite them in
    place: ``phi`` laid out (a tensor ``[B, H, L, D]``: one copy, the caller's), or computed
    on the flat rows ``x_f`` (a function of ``(x [B, H, P C, d], query)``: no copy; not the
    caller's to overwrite under autograd, whose graph may have saved it (``recorded``), nor
    when it is not contiguous or shares memory with ``x_f``)."""
    if not callable(phi):
        return _flat_blocks(phi, nb, block), True
    out = phi(x_f.view(*lead, x_f.shape[-1]), query)
    if torch.compiler.is_compiling():  # Dynamo cannot read storage pointers: never overwrite in place there
        return out.reshape(x_f.shape[0], out.shape[-1]), False
    aliased = out.untyped_storage().data_ptr() == x_f.untyped_storage().data_ptr()
    owned = not (recorded or out.requires_grad) and out.is_contiguous() and not aliased
    return out.reshape(x_f.shape[0], out.shape[-1]), owned


@dataclass
class _Blocks:
    """The inputs of :func:`_noncausal_local` for the blocks ``1 .. T - 2`` of the flat
    layout (:func:`_flat_blocks`; blocks 0 and ``T - 1`` are zero blocks outside every
    sequence); every field's first dimension is the block, counted from block 1."""

    q: torch.Tensor  # [T - 2, C, d]
    fq: torch.Tensor  # [T - 2, C, D]: query features (scaled by e^{-a})
    k_loc: torch.Tensor  # [T - 2, d, 3C]: local keys of blocks 1 .. T - 2, transposed (a view)
    fk_loc: torch.Tensor  # [T - 2, D, 3C]: their local key features (scaled by e^{-c}), transposed (a view)
    v_loc: torch.Tensor  # [T - 2, 3C, dv + 1]: their local values and ones, zero at non-feature keys (a view)
    key_bias: torch.Tensor  # [T - 2, 3C]: 0 at the local keys that may be exact, -inf elsewhere
    m_f: torch.Tensor  # [T - 2, C]: the feature part's log-scale a_i + c
    low: float  # the clamp of the local logits' exp arguments (-inf: none)
    far: torch.Tensor | None  # [T - 2, D, dv + 1]: feature sums of the blocks two or more away
    s_blk: torch.Tensor | None  # [B H, P, D (dv + 1)]: per-block feature sums (when ``far`` is formed per chunk)
    far_of: torch.Tensor | None  # [P, P]: 1 for blocks two or more apart (with ``s_blk``)
    k_g: torch.Tensor | None  # [T - 2, g, d]: global keys
    v_g: torch.Tensor | None  # [T - 2, g, dv + 1]: global values and ones
    g_bias: torch.Tensor | None  # [T - 2, 1, g]: 0 at valid global keys, -inf at padded ones


def _key_bias(feat_key: torch.Tensor, heads: int, p: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B H P, 3C]``: for every block of the flat layout, 0 at its local keys that are
    feature keys (valid, not global or heavy; those inside the window are exact) and
    :math:`-\\infty` at the others, zero blocks included. ``feat_key`` is ``[B, M]`` (the
    same for every head) or ``[B, H, M]``."""
    b_, m_keys = feat_key.shape[0], feat_key.shape[-1]
    # per sequence: one margin block, one zero block, the keys padded to nb C, one zero block, one margin block
    ok = F.pad(feat_key, (2 * block, (p + 2) * block - 2 * block - m_keys), value=False)  # [B, (H,) (P + 2) C]
    bias = torch.zeros(ok.shape, dtype=dtype, device=feat_key.device).masked_fill(~ok, NEG)
    bias = bias.unfold(-1, 3 * block, block)  # [B, (H,) P, 3C]
    if feat_key.dim() == 2:
        bias = bias[:, None].expand(b_, heads, p, 3 * block)
    return bias.reshape(b_ * heads * p, 3 * block)


def _far_rows(s_blk: torch.Tensor, far_of: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    """Far sums ``[t1 - t0, D (dv + 1)]`` of the blocks ``t0 .. t1 - 1`` of the flat layout,
    one ``[rows, P] @ [P, D (dv + 1)]`` product per sequence they touch (called without
    autograd only: the loop is over sequences, not recorded)."""
    p = far_of.shape[0]
    parts = []
    for seq in range(t0 // p, (t1 - 1) // p + 1):
        lo, hi = max(t0 - seq * p, 0), min(t1 - seq * p, p)
        parts.append(far_of[lo:hi] @ s_blk[seq])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _noncausal_local(blk: _Blocks, i0: int, i1: int, bias: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
    """Outputs ``[i1 - i0, C, dv]`` of the blocks ``i0 + 1 .. i1`` of the flat layout (the
    fields of ``blk`` start at block 1): the exact terms (window and global keys) and the
    feature terms (local pairs outside the window, far blocks) of each row, restated at the
    row's log-normaliser (module docstring); rows with no allowed key are zero."""

    def rows(x: torch.Tensor) -> torch.Tensor:  # no slice for the whole range (its backward would copy)
        return x if (i0, i1) == (0, x.shape[0]) else x[i0:i1]

    q, fq, m_f, v_loc = rows(blk.q), rows(blk.fq), rows(blk.m_f), rows(blk.v_loc)
    dv = v_loc.shape[-1] - 1
    s_loc = torch.baddbmm(bias + rows(blk.key_bias)[:, None, :], q, rows(blk.k_loc))  # [t, C, 3C]
    win_max = s_loc.detach().amax(-1)  # [t, C]
    if blk.k_g is not None:
        s_g = torch.baddbmm(rows(blk.g_bias), q, rows(blk.k_g).transpose(-1, -2))  # [t, C, g]
        win_max = torch.maximum(win_max, s_g.detach().amax(-1))
    has_exact = torch.isfinite(win_max)  # [t, C]
    m_e = torch.where(has_exact, win_max, torch.zeros_like(win_max))
    e_loc = _exp_(s_loc.sub_(m_e.unsqueeze(-1)), blk.low)  # <= 1, 0 or tiny off the exact set
    ne = torch.bmm(e_loc, v_loc)  # [t, C, dv + 1]: numerator and denominator
    if blk.k_g is not None:
        ne = torch.baddbmm(ne, s_g.sub_(m_e.unsqueeze(-1)).exp_(), rows(blk.v_g))

    f_out = torch.bmm(fq, rows(blk.fk_loc)).mul_(outside)  # [t, C, 3C]: local pairs outside the window
    nf = torch.bmm(f_out, v_loc)  # [t, C, dv + 1]
    if blk.far is not None:
        nf = torch.baddbmm(nf, fq, rows(blk.far))
    elif blk.s_blk is not None:  # blocks i0 + 1 .. i1 of the whole layout
        nf = torch.baddbmm(nf, fq, _far_rows(blk.s_blk, blk.far_of, i0 + 1, i1 + 1).view(i1 - i0, fq.shape[-1], -1))

    den_e, den_f = ne[..., dv], nf[..., dv]  # [t, C]
    with torch.no_grad():
        l_e = torch.where(has_exact, m_e + den_e.log(), torch.full_like(m_e, NEG))
        top = torch.maximum(l_e, m_f + den_f.abs().log())
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows with no allowed key
        cap = 0.5 * math.log(torch.finfo(top.dtype).max)
        w_e = torch.where((den_e > 0) & has_exact, (m_e - top).clamp(max=0.0).exp(), torch.zeros_like(top))
        w_f = (m_f - top).clamp(max=cap).exp()
    tot = ne * w_e.unsqueeze(-1) + nf * w_f.unsqueeze(-1)  # [t, C, dv + 1]
    num, den = tot[..., :dv], tot[..., dv]
    safe = torch.where(den > 0, den, torch.ones_like(den))
    out = num / safe.unsqueeze(-1)
    return torch.where((den > 0).unsqueeze(-1), out, torch.zeros_like(out))


def _pair_sets(
    rows: torch.Tensor,
    m_keys: int,
    window: int,
    global_tokens: int,
    causal: bool,
    global_offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exact, feat)``, boolean ``[R, M]`` for the query positions ``rows [R]``: the pairs
    computed exactly (window and global tokens) and the other pairs the query may see (the
    feature set; causal: keys at or before the query). With ``global_offset [B]`` (per-row
    global tokens) ``[B, 1, R, M]``."""
    i = rows[:, None]
    j = torch.arange(m_keys, device=rows.device)
    is_global = _is_global(global_offset, global_tokens, j)  # [1 or B, M]
    if global_offset is not None:
        is_global = is_global[:, None, None, :]  # [B, 1, 1, M]
    j = j[None, :]
    if causal:
        seen = j <= i
        exact = seen & ((i - j < window) | is_global)
    else:
        seen = torch.ones(i.shape[0], m_keys, dtype=torch.bool, device=rows.device)
        exact = ((i - j).abs() <= window) | is_global
    return exact, seen & ~exact


#: inputs with at most this many (query, key) pairs per head take the dense form
#: (:func:`window_attention_dense`) instead of the blocked one. Measured 2026-11-26, one
#: thread, dense time over blocked time: training (forward + backward of a layer, 2 heads of
#: width 32, batch 32, window 16 / 8 + 48 features) causal N = 64 0.69, N = 128 1.00,
#: non-causal N = 96 0.77, N = 128 0.99; MiniLM's heads in inference (12 heads, window 24,
#: [CLS], 78 features, padded batches) N = 32 0.47, 64 0.60, 128 0.86, 256 1.29, 512 2.98.
#: Element-wise passes over ``[N, M]`` are memory-bound beyond that.
DENSE_MAX_PAIRS = 128 * 128


def window_attention_dense(
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
    """:func:`window_attention_blocked` for short inputs: the same rows from ``[N, M]``
    matrices (a few batched products and element-wise passes instead of some sixty
    operations on blocks), differentiated by autograd.

    The exact part is :math:`e^{s_{ij} - m_i}` on the exact set; the feature part
    :math:`e^{-(a_i + c_i)} \\phi_q(q_i)^\\top \\phi_k(k_j)` on the feature set, with the
    stabilisers of the module docstring: non-causal, :math:`c` the largest key log-feature
    (one constant per head); causal, the key's prefix maximum :math:`c_j` inside
    (:math:`\\hat\\phi_k(k_j) = e^{l_{k,j} - c_j} \\le 1`) and the row's delayed prefix
    maximum :math:`c_{i - w}` outside, through the gate :math:`e^{c_j - c_{i - w}} \\le 1`
    (a later, larger key never changes a row). Both parts are restated at the row's
    log-normaliser :math:`M_i` as in the blocked form, so the denominator lies in
    :math:`[1, 2]` for positive maps. Time and memory :math:`O(N M (d + D))` per head:
    used up to :data:`DENSE_MAX_PAIRS` pairs.

    Parameters and result as :func:`window_attention_blocked` (no ``block_size``).
    """
    n, m_keys = q.shape[-2], k.shape[-2]
    device, dtype = q.device, q.dtype
    rows = torch.arange(n, device=device)
    exact, feat = _pair_sets(rows, m_keys, window, global_tokens, causal, global_offset)  # [N, M] or [B, 1, N, M]
    # keys that may enter through features: [M], or [B, M] with per-row global tokens
    feat_key = ~_is_global(global_offset, global_tokens, torch.arange(m_keys, device=device))
    if global_offset is None:
        feat_key = feat_key[0]
    if key_padding_mask is not None:
        valid = ~key_padding_mask[:, None, None, :]  # [B, 1, 1, M]
        exact, feat = exact & valid, feat & valid  # [B, 1, N, M]
        feat_key = feat_key & valid[:, 0, 0]  # [B, M]
    if heavy is not None:  # valid keys, exact for every row of their head: [B, H, N, M] sets, [B, H, M] keys
        if causal:
            raise ValueError("heavy keys are defined for non-causal attention only")
        hk = heavy.mask(m_keys)
        exact, feat = exact | hk[:, :, None, :], feat & ~hk[:, :, None, :]
        feat_key = (feat_key if feat_key.dim() == 1 else feat_key[:, None, :]) & ~hk
    # masks as factors (the gate; the exponentials without autograd, _exp_masked): those
    # arguments are clamped, and q, k, v and the features are finite here, so a factor 0 is
    # an exact 0
    fe_f = feat.to(dtype)

    s = q @ k.transpose(-1, -2)  # [B, H, N, M]
    with torch.no_grad():
        m_e = s.masked_fill(~exact, NEG).amax(-1, keepdim=True)  # [B, H, N, 1]
        m_e = torch.where(torch.isfinite(m_e), m_e, torch.zeros_like(m_e))
    recorded = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, phi_q, phi_k))
    e = _exp_masked(s - m_e, exact, recorded)  # <= 1, 0 off the exact set

    if log_space:
        fk_keep = (feat_key if feat_key.dim() == 3 else feat_key.view(-1, 1, m_keys)).to(dtype)[..., None]
        # [1 or B, 1 or H, M, 1]
        with torch.no_grad():
            a = phi_q.amax(-1, keepdim=True)  # [B, H, N, 1]
            a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
            key_max = phi_k.masked_fill(fk_keep == 0, NEG).amax(-1)  # [B, H, M], -inf: never a feature key
        fq = _exp_masked(phi_q - a, None, recorded)
        if causal:
            with torch.no_grad():
                _, c = prefix_stabiliser(key_max)  # [B, H, M]: prefix maximum, finite, non-decreasing
                c_row = c[..., (torch.arange(n, device=device) - window).clamp(0, m_keys - 1)].unsqueeze(-1)
                gate = exp_nonpositive(c.unsqueeze(-2) - c_row, fe_f)  # [B, H, N, M]: e^{c_j - c_{i-w}}
            fk = _exp_masked(phi_k - c.unsqueeze(-1), fk_keep, recorded)  # [B, H, M, D], <= 1
            f = (fq @ fk.transpose(-1, -2)) * gate
        else:
            with torch.no_grad():
                c_row = key_max.amax(-1, keepdim=True).unsqueeze(-1)  # [B, H, 1, 1]
                c_row = torch.where(torch.isfinite(c_row), c_row, torch.zeros_like(c_row))
            fk = _exp_masked(phi_k - c_row, fk_keep, recorded)
            f = (fq @ fk.transpose(-1, -2)) * fe_f
        m_f = a + c_row  # [B, H, N, 1]: the feature part's scale
    else:
        f = (phi_q @ phi_k.transpose(-1, -2)) * fe_f
        m_f = torch.zeros_like(m_e)
    den_e, den_f = e.sum(-1, keepdim=True), f.sum(-1, keepdim=True)  # [B, H, N, 1]
    with torch.no_grad():
        top = torch.maximum(m_e + den_e.log(), m_f + den_f.abs().log())
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows with no allowed key
        cap = 0.5 * math.log(torch.finfo(dtype).max)
        w_e = torch.where(den_e > 0, (m_e - top).clamp(max=0.0).exp(), torch.zeros_like(top))
        w_f = (m_f - top).clamp(max=cap).exp()
    w = e * w_e + f * w_f  # the two sets are disjoint
    den = den_e * w_e + den_f * w_f  # [B, H, N, 1], in [1, 2] for positive maps
    out = (w @ v) / torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, out, torch.zeros_like(out))


def window_weights_rows(
    q_rows: torch.Tensor,
    k: torch.Tensor,
    phi_q_rows: torch.Tensor,
    phi_k: torch.Tensor,
    rows: torch.Tensor,
    *,
    log_space: bool,
    window: int,
    global_tokens: int,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    global_offset: torch.Tensor | None = None,
    heavy: HeavyKeys | None = None,
) -> torch.Tensor:
    """The normalised weights ``[B, H, R, M]`` of the query positions ``rows`` alone.

    Row :math:`i` of the weight matrix of :func:`window_attention_blocked` (its
    output for one-hot values), formed directly in :math:`O(R M (d + D))`: the logits
    :math:`s_{ij}` on the exact set, the feature scores elsewhere, one stabiliser per
    row. For log-space maps the feature score is
    :math:`e^{a_i + c_j} \\sum_D e^{l_{q,i} - a_i} e^{l_{k,j} - c_j}` with the per-token
    maxima :math:`a_i = \\max_D l_{q,i}`, :math:`c_j = \\max_D l_{k,j}` (the whole row is
    formed at once, so no causal restatement is needed), and the row is scaled by
    :math:`e^{-m_i}`, :math:`m_i` the largest exact logit or :math:`a_i + c_j` of the row.

    Parameters
    ----------
    q_rows : Tensor ``[B, H, R, d]``
        Scaled queries at the positions ``rows``.
    k : Tensor ``[B, H, M, d]``
    phi_q_rows, phi_k : Tensor ``[B, H, R, D]``, ``[B, H, M, D]``
        Features (log-features when ``log_space``) of those queries and of every key.
    rows : Tensor of int ``[R]``
        Query positions.
    global_offset : Tensor ``[B]`` of int, optional
        Per-row start of the global tokens, as in :func:`window_attention_blocked`.
    heavy : HeavyKeys, optional
        Non-causal: each head's heavy keys, as in :func:`window_attention_blocked`.

    Returns
    -------
    Tensor ``[B, H, R, M]``; a row with no allowed key is zero.
    """
    exact, feat = _pair_sets(rows.to(q_rows.device), k.shape[-2], window, global_tokens, causal, global_offset)
    if global_offset is None:
        exact, feat = exact[None, None], feat[None, None]
    ex, fe = exact, feat  # [1 or B, 1, R, M]
    if key_padding_mask is not None:
        valid = ~key_padding_mask[:, None, None, :]
        ex, fe = ex & valid, fe & valid
    if heavy is not None:
        if causal:
            raise ValueError("heavy keys are defined for non-causal attention only")
        hk = heavy.mask(k.shape[-2])[:, :, None, :]  # [B, H, 1, M]
        ex, fe = ex | hk, fe & ~hk
    s = (q_rows @ k.transpose(-1, -2)).masked_fill(~ex, NEG)  # [B, H, R, M]
    if log_space:
        a = phi_q_rows.detach().amax(-1, keepdim=True)  # [B, H, R, 1]
        a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
        c = phi_k.detach().amax(-1)  # [B, H, M]
        c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
        f = (phi_q_rows - a).exp() @ (phi_k - c.unsqueeze(-1)).exp().transpose(-1, -2)  # [B, H, R, M]
        top = (a + c.unsqueeze(-2)).masked_fill(~fe, NEG)  # [B, H, R, M]: log of the feature scale
    else:
        f = phi_q_rows @ phi_k.transpose(-1, -2)
        top = torch.zeros_like(f).masked_fill(~fe, NEG)
    m = torch.maximum(s.detach().amax(-1, keepdim=True), top.amax(-1, keepdim=True))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows with no allowed key
    w = (s - m).exp() + f.masked_fill(~fe, 0.0) * (top - m).exp()
    den = w.sum(-1, keepdim=True)
    return w / torch.where(den > 0, den, torch.ones_like(den))


# ---------------------------------------------------------------------- decoding
@dataclass
class WindowState:
    """Decoding state of causal ``sliding-window`` attention: constant size, whatever the
    number of positions consumed.

    For the next position :math:`p` the exact set is the last ``w`` positions
    (:math:`p - w < j \\le p`) and the first ``g`` after the row's leading padding (global
    tokens); every other earlier position enters through the features, summed once and for
    all when it leaves the window.

    Attributes
    ----------
    keys, values : Tensor ``[B, H, w, d]``, ``[B, H, w, dv]``
        Ring buffer of the last ``w`` positions (scaled keys): position ``j`` lives in slot
        ``j mod w``. Empty, padded and non-finite slots hold zeros.
    valid : Tensor ``[B, H, w]`` of bool
        Slots holding a key that may be attended (filled, not padded, finite, not global).
    sink_keys, sink_values, sink_valid : Tensor ``[B, H, g, .]``
        The global tokens (positions ``lead .. lead + g - 1`` of each row), exact for every
        later position.
    features : CausalState or None
        :math:`\\sum \\phi_k(k_j) v_j^\\top`, :math:`\\sum \\phi_k(k_j)` and the stabiliser of
        the positions ``g <= j <= p - w`` (:func:`~kernelattn_core.engine.torch_backend.absorb_keys`);
        ``None`` until a position leaves the window.
    length : int
        Positions consumed.
    poisoned : Tensor ``[B, H]`` of bool
        A non-finite key or value was consumed: every later row is NaN, as in the forward.
    owner : StateOwner, optional
        Set by :meth:`~kernelattn_hybrid.SlidingWindowAttention.step`.
    lead : Tensor ``[B]`` of int64, optional
        Each row's leading padding so far: the number of padded positions before its first
        position that is not (``length`` while a row has been all padding, as a left-padded
        prompt's row starts); its global tokens are the ``g`` positions from there. Set
        once a padding mask has been given; ``None``: 0 for every row.
    """

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    sink_valid: torch.Tensor
    features: Any
    length: int
    poisoned: torch.Tensor
    owner: Any = None
    lead: torch.Tensor | None = None


def empty_window_state(
    b: int, h: int, d: int, dv: int, window: int, global_tokens: int, dtype: torch.dtype, device: torch.device
) -> WindowState:
    """The state before any position."""
    new = {"dtype": dtype, "device": device}
    return WindowState(
        torch.zeros(b, h, window, d, **new),
        torch.zeros(b, h, window, dv, **new),
        torch.zeros(b, h, window, dtype=torch.bool, device=device),
        torch.zeros(b, h, global_tokens, d, **new),
        torch.zeros(b, h, global_tokens, dv, **new),
        torch.zeros(b, h, global_tokens, dtype=torch.bool, device=device),
        None,
        0,
        torch.zeros(b, h, dtype=torch.bool, device=device),
    )


def window_step_finite(
    state: WindowState,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor,
    key_features: Any,
    *,
    log_space: bool,
    window: int,
    global_tokens: int,
    clean: bool = False,
) -> tuple[torch.Tensor, WindowState] | None:
    """:func:`window_step_one` of a position past the start, on the assumption that every
    value is finite and every slot attendable, or ``None`` when it fails (the caller then
    takes :func:`window_step_one` with its quarantine, which gives the same row and state,
    up to rounding, wherever this one returns).

    A decoding step is dominated by the number of tensor operations, not their size;
    this one skips the masks, the selections on data and the copies that change nothing
    when the ring buffer is full and valid: the key at :math:`p - w` moves to the
    features (:math:`S' = S + e^{l_k - c} v^\\top`, :math:`z' = z + e^{l_k - c}` at the
    stabiliser :math:`c` unchanged; when a feature exceeds 1 the step is redone with
    :math:`c' = \\max(c, \\max_D l_k)` and :math:`S' = e^{c - c'} S + e^{l_k - c'} v^\\top`,
    as :func:`~kernelattn_core.toolkit.absorb_one_finite` does), the new key takes its slot,
    and the row combines the exact part (at its largest logit :math:`m_e`) and the feature
    part (at :math:`m_f`) as
    :math:`(\\mathrm{num}_e + r\\,\\mathrm{num}_f) / (\\mathrm{den}_e + r\\,\\mathrm{den}_f)` with
    :math:`r = e^{m_f - m_e}`, the ratio :func:`window_step_one` forms at one
    log-normaliser. One synchronisation decides at the end: a non-finite row or key
    feature (a non-finite input, or an ``r`` that overflows, reaches one of them), an
    invalid slot, a poisoned head or a denominator :math:`\\le 0` returns ``None``. While
    the buffer fills (:math:`p < w`: no position has left, no feature part) the row is
    the exact part alone over the valid slots (:func:`_filling_step`).

    Parameters
    ----------
    state : WindowState
        Of ``p = state.length >= global_tokens`` positions (the new key goes to the ring
        buffer, not to the global tokens; with ``state.lead``, that ``p`` is past every
        row's global tokens is part of the final check); for ``p >= window`` with
        ``features`` (a position has left the window) and ``p - window >= global_tokens``
        (the leaving position is not global).
    q, k, v, phi_q, key_features, log_space, window, global_tokens
        As :func:`window_step_one` (``window > 0``).
    clean : bool
        The caller has seen these flag tensors (``valid``, ``poisoned``, ``sink_valid``,
        ``lead``) pass the check at a position ``<= p``: it is not repeated (a decode's
        short steps hand the same flag tensors on).
    """
    p, f = state.length, state.features
    slot = p % window
    b, h, _, d = q.shape
    dv, bh = v.shape[-1], b * h
    if p < window:  # no position has left: no feature part (a state that has one is not ours to shortcut)
        return _filling_step(state, q, k, v, slot, global_tokens) if f is None else None
    # the position p - w leaves the window for the features
    lk = key_features(state.keys[:, :, slot : slot + 1])  # [B, H, 1, D]
    d_feat = lk.shape[-1]
    if not (lk.dtype == phi_q.dtype == q.dtype == f.kv.dtype) or phi_q.shape[-1] != d_feat:
        return None  # a map that changes the dtype or the width: the guarded step casts and checks
    leaving = state.values[:, :, slot : slot + 1]
    lk3 = lk.reshape(bh, 1, d_feat)
    kv, z = f.kv.reshape(bh, d_feat, dv), f.z.reshape(bh, 1, d_feat)
    if log_space:  # at the stabiliser as it is; a feature above 1 redoes the step below
        fk = (lk3 - f.m.reshape(bh, 1, 1)).exp_()
        kv, z = torch.addcmul(kv, fk.mT, leaving.reshape(bh, 1, dv)), z + fk
        features = replace(f, kv=kv.view(b, h, d_feat, dv), z=z.view(b, h, d_feat), length=f.length + 1)
    else:
        fk = None
        features = absorb_one_finite(f, lk, leaving, log_space=False)
    # the new key takes the slot (the slot stays valid: the check below covers it)
    keys = torch.slice_scatter(state.keys, k, 2, slot, slot + 1)
    values = torch.slice_scatter(state.values, v, 2, slot, slot + 1)
    # exact part: the window and the global tokens, at the row's largest logit
    q3 = q.reshape(bh, 1, d)
    ex_k, ex_v = keys.reshape(bh, window, d), values.reshape(bh, window, dv)
    if global_tokens:
        ex_k = torch.cat([ex_k, state.sink_keys.reshape(bh, global_tokens, d)], 1)
        ex_v = torch.cat([ex_v, state.sink_values.reshape(bh, global_tokens, dv)], 1)
    s = torch.bmm(q3, ex_k.mT)  # [BH, 1, w + g]
    m_e = s.amax(-1, keepdim=True)
    e = (s - m_e).exp_()
    den_e = e.sum(-1, keepdim=True)  # [BH, 1, 1], >= 1
    num_e = torch.bmm(e, ex_v)  # [BH, 1, dv]
    # feature part, at m_f = a + c, weighed against the exact part by r = e^{m_f - m_e}
    lq = phi_q.reshape(bh, 1, d_feat)
    if log_space:
        a = lq.amax(-1, keepdim=True)
        fq = (lq - a).exp_()
        shift = a - m_e  # r = e^{shift + c}
    else:
        fq, shift = lq, -m_e

    def row(features: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r = (shift + features.m.view(bh, 1, 1) if log_space else shift).exp()
        num_f = torch.bmm(fq, features.kv.view(bh, d_feat, dv))
        den_f = torch.bmm(fq, features.z.view(bh, d_feat, 1))
        num, den = torch.addcmul(num_e, num_f, r), torch.addcmul(den_e, den_f, r)
        out = num / den
        return out, out.sum() + lk3.sum(), den.amin()

    out, total, low = row(features)
    checks = [total, low]
    if not clean:
        ok = state.valid.all() & ~state.poisoned.any()
        if global_tokens:
            ok = ok & state.sink_valid.all()
            if state.lead is not None:  # the new position is past every row's global tokens
                ok = ok & (state.lead <= p - global_tokens).all()
        checks.append(ok.to(total.dtype))
    if fk is not None:
        checks.append(fk.amax())
    got = torch.stack(checks).tolist()
    if fk is not None and not got.pop() <= 1.0:  # a feature above the stabiliser (or NaN): raise it
        features = absorb_one_finite(f, lk, leaving, log_space=True)
        out, total, low = row(features)
        got[:2] = torch.stack([total, low]).tolist()
    if not (math.isfinite(got[0]) and got[1] > 0 and (clean or got[2] == 1.0)):
        return None
    new = WindowState(
        keys,
        values,
        state.valid,
        state.sink_keys,
        state.sink_values,
        state.sink_valid,
        features,
        p + 1,
        state.poisoned,
        state.owner,
        state.lead,
    )
    return out.reshape(b, h, 1, dv), new


def _filling_step(
    state: WindowState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int, global_tokens: int
) -> tuple[torch.Tensor, WindowState] | None:
    """The short step while the ring buffer fills (no feature part yet): the new key takes
    its empty slot, and the row is softmax attention over the valid slots and the global
    tokens (padded earlier positions stay invalid, so they are masked here, not declined).
    ``None`` for a non-finite input or a poisoned head."""
    b, h, _, d = q.shape
    dv, bh = v.shape[-1], b * h
    keys, values, valid = state.keys.clone(), state.values.clone(), state.valid.clone()
    keys[:, :, slot] = k[:, :, 0]
    values[:, :, slot] = v[:, :, 0]
    valid[:, :, slot] = True
    ex_k, ex_v, ex_ok = keys, values, valid
    if global_tokens:
        ex_k = torch.cat([keys, state.sink_keys], 2)
        ex_v = torch.cat([values, state.sink_values], 2)
        ex_ok = torch.cat([valid, state.sink_valid], 2)
    s = torch.bmm(q.reshape(bh, 1, d), ex_k.reshape(bh, -1, d).mT).masked_fill(~ex_ok.reshape(bh, 1, -1), NEG)
    e = (s - s.amax(-1, keepdim=True)).exp_()  # the new key is valid: the largest logit is finite
    num = torch.bmm(e, ex_v.reshape(bh, -1, dv))  # [BH, 1, dv]
    den = e.sum(-1, keepdim=True)  # [BH, 1, 1], >= 1
    ok = torch.isfinite(q.sum() + k.sum() + v.sum() + num.sum()) & ~state.poisoned.any()
    if global_tokens and state.lead is not None:  # the new position is past every row's global tokens
        ok = ok & (state.lead <= state.length - global_tokens).all()
    if not bool(ok):
        return None
    out = (num / den).reshape(b, h, 1, dv)
    new = WindowState(
        keys,
        values,
        valid,
        state.sink_keys,
        state.sink_values,
        state.sink_valid,
        None,
        state.length + 1,
        state.poisoned,
        state.owner,
        state.lead,
    )
    return out, new


def window_step_one(
    state: WindowState,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor,
    key_features: Any,
    *,
    log_space: bool,
    window: int,
    global_tokens: int,
    keep: torch.Tensor,
    padded: torch.Tensor | None = None,
) -> tuple[torch.Tensor, WindowState]:
    """Causal sliding-window attention of one new position ``p = state.length``.

    Parameters
    ----------
    state : WindowState
        Of the positions ``< p`` (tensors in the compute dtype).
    q, k : Tensor ``[B, H, 1, d]``
        Scaled query and key of position ``p``, finite (non-finite ones were zeroed by the
        caller, which poisons their rows and sets ``poisoned``).
    v : Tensor ``[B, H, 1, dv]``
    phi_q : Tensor ``[B, H, 1, D]``
        Query features (log-features when ``log_space``).
    key_features : callable
        ``k [B, H, T, d] -> [B, H, T, D]``: the key map, applied to the position that
        leaves the window.
    keep : Tensor ``[B, H, 1]`` of bool
        Whether the new key may be attended (not padding, finite).
    padded : Tensor ``[B]`` of bool, optional
        The key padding mask of the new position: a padded position that follows only
        padding extends its row's leading padding (``state.lead``), after which the row's
        global tokens start.

    Returns
    -------
    out : Tensor ``[B, H, 1, dv]``
        Equal to row ``p`` of the causal forward (the module docstring's combination: the
        exact part at its largest logit, the feature part at :math:`a + c`, both restated at
        the row's log-normaliser).
    state : WindowState
        Continued with position ``p`` (a new object; ``state`` is not modified).
    """
    from kernelattn_core.toolkit import absorb_keys

    p = state.length
    g = global_tokens
    features = state.features
    keys, values, valid = state.keys, state.values, state.valid
    sink_keys, sink_values, sink_valid = state.sink_keys, state.sink_values, state.sink_valid
    lead = state.lead
    if lead is None and padded is not None and p == 0:
        lead = torch.zeros(padded.shape[0], dtype=torch.long, device=padded.device)
    in_sink = None  # [B, g]: the sink slot that the new position fills, per row (None: slot p if p < g)
    if lead is not None:  # per-row global tokens: the positions lead .. lead + g - 1
        if padded is not None:
            lead = torch.where(padded & (lead == p), lead + 1, lead)
        in_sink = torch.arange(g, device=lead.device) == (p - lead)[:, None]  # [B, g]
        is_global = in_sink.any(-1)[:, None, None]  # [B, 1, 1]
    else:
        is_global = p < g
    if window == 0:  # the new position is a feature key for itself
        if in_sink is not None:
            features = absorb_keys(features, key_features(k), v, log_space=log_space, drop=~keep | is_global)
        elif p >= g:
            features = absorb_keys(features, key_features(k), v, log_space=log_space, drop=~keep)
    else:
        slot = p % window
        if p >= window:  # position p - w leaves the window: to the features (unless global, padded, ...)
            leaving = valid[:, :, slot : slot + 1]  # [B, H, 1]
            lk = key_features(keys[:, :, slot : slot + 1])
            features = absorb_keys(features, lk, values[:, :, slot : slot + 1], log_space=log_space, drop=~leaving)
        keys, values, valid = keys.clone(), values.clone(), valid.clone()
        keys[:, :, slot : slot + 1] = k
        values[:, :, slot : slot + 1] = v
        valid[:, :, slot : slot + 1] = keep & ~is_global if in_sink is not None else keep & (p >= g)
    if in_sink is not None:
        if g:
            sink_keys = torch.where(in_sink[:, None, :, None], k, sink_keys)  # [B, H, g, d]
            sink_values = torch.where(in_sink[:, None, :, None], v, sink_values)
            sink_valid = torch.where(in_sink[:, None, :], keep, sink_valid)
    elif p < g:
        sink_keys, sink_values, sink_valid = sink_keys.clone(), sink_values.clone(), sink_valid.clone()
        sink_keys[:, :, p : p + 1] = k
        sink_values[:, :, p : p + 1] = v
        sink_valid[:, :, p : p + 1] = keep

    # exact part: the window (non-global positions) and the global tokens, at their largest logit
    ex_k = torch.cat([keys, sink_keys], dim=2)  # [B, H, w + g, d]
    ex_v = torch.cat([values, sink_values], dim=2)
    ex_ok = torch.cat([valid, sink_valid], dim=2)  # [B, H, w + g]
    s = (q @ ex_k.transpose(-1, -2)).squeeze(-2).masked_fill(~ex_ok, NEG)  # [B, H, w + g]
    if s.shape[-1]:
        top_e = s.detach().amax(-1, keepdim=True)
        m_e = torch.where(torch.isfinite(top_e), top_e, torch.zeros_like(top_e))  # [B, H, 1]
    else:  # no exact key at all (window 0, no global token)
        m_e = s.new_zeros((*s.shape[:-1], 1))
    e = (s - m_e).exp()  # [B, H, w + g], 0 off the set
    den_e = e.sum(-1, keepdim=True)  # [B, H, 1]
    num_e = (e.unsqueeze(-2) @ ex_v).squeeze(-2)  # [B, H, dv]

    # feature part: every earlier position that left the window, at a + c
    if features is not None:
        lq = phi_q.squeeze(-2)  # [B, H, D]
        if log_space:
            a = lq.detach().amax(-1, keepdim=True)
            a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
            fq = (lq - a).exp()
            c = features.m  # [B, H, 1]
            c_ok = torch.isfinite(c)
            m_f = a + torch.where(c_ok, c, torch.zeros_like(c))
        else:
            fq = lq
            c_ok = torch.ones_like(m_e, dtype=torch.bool)
            m_f = torch.zeros_like(m_e)
        kv, z = features.kv.to(fq.dtype), features.z.to(fq.dtype)
        num_f = (fq.unsqueeze(-2) @ kv).squeeze(-2) * c_ok  # [B, H, dv]
        den_f = (fq * z).sum(-1, keepdim=True) * c_ok  # [B, H, 1]
    else:
        num_f = torch.zeros_like(num_e)
        den_f = torch.zeros_like(den_e)
        m_f = torch.zeros_like(m_e)

    # one log-normaliser for the row (as the blocked forward)
    with torch.no_grad():
        top = torch.maximum(m_e + den_e.log(), m_f + den_f.abs().log())
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        cap = 0.5 * math.log(torch.finfo(top.dtype).max)
        w_e = torch.where(den_e > 0, (m_e - top).clamp(max=0.0).exp(), torch.zeros_like(top))
        w_f = (m_f - top).clamp(max=cap).exp()
    num = num_e * w_e + num_f * w_f
    den = den_e * w_e + den_f * w_f  # [B, H, 1]
    safe = torch.where(den > 0, den, torch.ones_like(den))
    out = torch.where(den > 0, num / safe, torch.zeros_like(num)).unsqueeze(-2)  # [B, H, 1, dv]
    new = WindowState(
        keys, values, valid, sink_keys, sink_values, sink_valid, features, p + 1, state.poisoned, state.owner, lead
    )
    return out, new
