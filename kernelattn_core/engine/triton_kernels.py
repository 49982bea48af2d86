"""Triton kernels of feature-map attention (imported only by :mod:`.triton_backend`).

One program per ``(batch·head, block of d_v columns)`` walks the sequence in chunks
of ``BT`` positions and keeps the running state :math:`S \\in \\mathbb{R}^{D \\times
BV}`, :math:`z \\in \\mathbb{R}^D` on chip. Features come either from memory
(``FEAT = 0``: :math:`\\phi` or :math:`\\log\\phi`, ``[N, D]``) or are computed on chip
from ``x' [N, E]``, the frequencies ``ω [D, E]`` and a per-row term (``FEAT = 1``:
:math:`\\log\\phi = x'\\omega^\\top + \\beta`; ``FEAT = 2``:
:math:`\\phi = \\rho \\cos(x'\\omega^\\top + b)`), so the ``[N, D]`` features never go
to memory.

Log-space stabilisers are those of :mod:`.torch_backend`: queries scaled by
:math:`e^{-\\max_D l_{q,t}}`; keys stored as :math:`e^{l_{k,j} - m_j}` with the prefix
maximum :math:`m_t = \\max_{j \\le t}\\max_D l_{k,j}` (causal) or the global maximum
(non-causal); the gate :math:`e^{m_j - m_t}` inside a chunk; the state stated at the
previous chunk's last :math:`m`. A stabiliser with no valid key yet is ``FLOOR``
instead of :math:`-\\infty`, and every exponent that is :math:`\\le 0` in exact
arithmetic is clamped to :math:`\\le 0`, so rows outside the sequence never produce
an ``inf`` (hence no ``0·inf`` NaN reaches a valid row).

Gradients: the backward kernels recompute the features and the running state; the
causal one sweeps forward (query gradients, with :math:`S`) and then backward (key and
value gradients, with the reverse state
:math:`R = \\sum_{t \\ge s} e^{r - m_t} \\hat\\phi_q(q_t) \\, \\bar{\\mathrm{num}}_t^\\top`
stated at :math:`r = m_s`, the first position of the later chunks). Query and key
gradients are partial over the ``d_v`` blocks (written to one slot per block and summed
by the caller); value gradients are complete.
"""

from __future__ import annotations

import triton
import triton.language as tl

FLOOR_VALUE = -1.0e30
#: the stabiliser before any valid key (a global must be constexpr inside a compiled kernel)
FLOOR: tl.constexpr = tl.constexpr(FLOOR_VALUE)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _load_w(W, D, E, ACC: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr):
    """The frequencies ``ω [BD, BE]``, loaded once per program (fused maps)."""
    offs_d = tl.arange(0, BD)
    offs_e = tl.arange(0, BE)
    mask = (offs_d < D)[:, None] & (offs_e < E)[None, :]
    return tl.load(W + offs_d[:, None] * E + offs_e[None, :], mask=mask, other=0.0).to(ACC)


@triton.jit
def _raw(
    F,
    X,
    ROW,
    W,
    PH,
    bh,
    offs_t,
    t_ok,
    N,
    D,
    E,
    FEAT: tl.constexpr,
    ACC: tl.constexpr,
    BD: tl.constexpr,
    BE: tl.constexpr,
    PREC: tl.constexpr,
):
    """``[BT, BD]`` features (or log-features) of rows ``offs_t``; garbage where not ``t_ok``."""
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    if FEAT == 0:
        ptr = F + bh * N * D + offs_t[:, None] * D + offs_d[None, :]
        f = tl.load(ptr, mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(ACC)
    else:
        offs_e = tl.arange(0, BE)
        e_ok = offs_e < E
        x = tl.load(
            X + bh * N * E + offs_t[:, None] * E + offs_e[None, :], mask=t_ok[:, None] & e_ok[None, :], other=0.0
        ).to(ACC)
        w = W  # the [BD, BE] tile, loaded once per program
        u = tl.dot(x, tl.trans(w), input_precision=PREC, out_dtype=ACC)  # [BT, BD]
        row = tl.load(ROW + bh * N + offs_t, mask=t_ok, other=0.0).to(ACC)
        if FEAT == 1:
            f = u + row[:, None]
        else:
            ph = tl.load(PH + offs_d, mask=d_ok, other=0.0).to(ACC)
            f = row[:, None] * tl.cos(u + ph[None, :])
    return f


@triton.jit
def _raw_grad(
    g,
    DF,
    DX,
    DROW,
    X,
    ROW,
    W,
    PH,
    slot,
    bh,
    offs_t,
    t_ok,
    N,
    D,
    E,
    FEAT: tl.constexpr,
    ACC: tl.constexpr,
    BD: tl.constexpr,
    BE: tl.constexpr,
    PREC: tl.constexpr,
):
    """Write the gradient ``g [BT, BD]`` with respect to the raw features into slot ``slot``:
    as it is (``FEAT = 0``) or chained to ``x'`` and the row term (fused maps)."""
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    g = tl.where(t_ok[:, None] & d_ok[None, :], g, 0.0)
    if FEAT == 0:
        ptr = DF + slot * N * D + bh * N * D + offs_t[:, None] * D + offs_d[None, :]
        tl.store(ptr, g, mask=t_ok[:, None] & d_ok[None, :])
    else:
        offs_e = tl.arange(0, BE)
        e_ok = offs_e < E
        w = W  # the [BD, BE] tile, loaded once per program
        if FEAT == 1:
            du = g
            drow = tl.sum(g, 1)
        else:
            x = tl.load(
                X + bh * N * E + offs_t[:, None] * E + offs_e[None, :], mask=t_ok[:, None] & e_ok[None, :], other=0.0
            ).to(ACC)
            u = tl.dot(x, tl.trans(w), input_precision=PREC, out_dtype=ACC)
            ph = tl.load(PH + offs_d, mask=d_ok, other=0.0).to(ACC)
            row = tl.load(ROW + bh * N + offs_t, mask=t_ok, other=0.0).to(ACC)
            drow = tl.sum(tl.cos(u + ph[None, :]) * g, 1)
            du = -row[:, None] * tl.sin(u + ph[None, :]) * g
        dx = tl.dot(du, w, input_precision=PREC, out_dtype=ACC)  # [BT, BE]
        tl.store(
            DX + slot * N * E + bh * N * E + offs_t[:, None] * E + offs_e[None, :],
            dx,
            mask=t_ok[:, None] & e_ok[None, :],
        )
        tl.store(DROW + slot * N + bh * N + offs_t, drow, mask=t_ok)


@triton.jit
def _query_side(lq, t_ok, D, LOG: tl.constexpr, BD: tl.constexpr):
    """:math:`e^{l_q - \\max_D l_q}` (log maps) or the features; zero outside the tile."""
    d_ok = tl.arange(0, BD) < D
    ok = t_ok[:, None] & d_ok[None, :]
    if LOG:
        lq = tl.where(ok, lq, float("-inf"))
        mq = tl.max(lq, 1)
        mq = tl.where(t_ok, mq, 0.0)
        fq = tl.exp(lq - mq[:, None])
    else:
        fq = lq
    return tl.where(ok, fq, 0.0)


@triton.jit
def _key_side(lk, valid, m_prev, D, LOG: tl.constexpr, BD: tl.constexpr):
    """Keys of a chunk: ``(fk, m)`` with :math:`f_k = e^{l_k - m_j}` and the running
    prefix maximum ``m [BT]`` (log maps), or the masked features."""
    d_ok = tl.arange(0, BD) < D
    ok = valid[:, None] & d_ok[None, :]
    if LOG:
        lk = tl.where(ok, lk, float("-inf"))
        rmax = tl.max(lk, 1)  # [BT]
        mc = tl.associative_scan(rmax, 0, _maximum)
        mc = tl.maximum(tl.maximum(mc, m_prev), FLOOR)
        fk = tl.exp(lk - mc[:, None])
    else:
        mc = tl.zeros_like(m_prev) + tl.zeros([lk.shape[0]], dtype=m_prev.dtype)
        fk = lk
    return tl.where(ok, fk, 0.0), mc


@triton.jit
def _gate(mc, offs_t, t_ok, LOG: tl.constexpr):
    """``[t, j]``: :math:`e^{m_j - m_t}` on ``j <= t`` (1 for plain maps), 0 elsewhere."""
    keep = (offs_t[None, :] <= offs_t[:, None]) & t_ok[:, None] & t_ok[None, :]
    if LOG:
        g = tl.exp(tl.minimum(mc[None, :] - mc[:, None], 0.0))
    else:
        g = tl.zeros_like(mc)[None, :] + tl.zeros_like(mc)[:, None] + 1.0
    return tl.where(keep, g, 0.0)


@triton.jit
def _valid_keys(MASK, b, M, offs_t, t_ok, HAS_MASK: tl.constexpr):
    if HAS_MASK:
        pad = tl.load(MASK + b * M + offs_t, mask=t_ok, other=1)
        return t_ok & (pad == 0)
    return t_ok


@triton.jit
def causal_fwd_kernel(
    FQ,
    XQ,
    RQ,
    FK,
    XK,
    RK,
    W,
    PH,
    V,
    MASK,
    NUM,
    DEN,
    MOUT,
    S0,
    Z0,
    M0,
    S1,
    Z1,
    M1,
    H,
    N,
    D,
    E,
    DV,
    FEAT: tl.constexpr,
    LOG: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_STATE: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    BE: tl.constexpr,
    BV: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    pv = tl.program_id(1)
    b = bh // H
    if FEAT != 0:
        W = _load_w(W, D, E, ACC, BD, BE)
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    offs_v = pv * BV + tl.arange(0, BV)
    v_ok = offs_v < DV
    sd = offs_d[:, None] * DV + offs_v[None, :]
    sok = d_ok[:, None] & v_ok[None, :]
    if HAS_STATE:
        s = tl.load(S0 + bh * D * DV + sd, mask=sok, other=0.0).to(ACC)
        z = tl.load(Z0 + bh * D + offs_d, mask=d_ok, other=0.0).to(ACC)
        m_prev = tl.maximum(tl.load(M0 + bh + tl.arange(0, 1)).to(ACC), FLOOR)
    else:
        s = tl.zeros([BD, BV], dtype=ACC)
        z = tl.zeros([BD], dtype=ACC)
        m_prev = tl.zeros([1], dtype=ACC) + FLOOR * LOG  # plain maps: 0, every factor is 1
    for t0 in range(0, N, BT):
        offs_t = t0 + tl.arange(0, BT)
        t_ok = offs_t < N
        valid = _valid_keys(MASK, b, N, offs_t, t_ok, HAS_MASK)
        fq = _query_side(_raw(FQ, XQ, RQ, W, PH, bh, offs_t, t_ok, N, D, E, FEAT, ACC, BD, BE, PREC), t_ok, D, LOG, BD)
        lk = _raw(FK, XK, RK, W, PH, bh, offs_t, t_ok, N, D, E, FEAT, ACC, BD, BE, PREC)
        fk, mc = _key_side(lk, valid, m_prev, D, LOG, BD)
        v = tl.load(
            V + bh * N * DV + offs_t[:, None] * DV + offs_v[None, :], mask=t_ok[:, None] & v_ok[None, :], other=0.0
        ).to(ACC)
        v = tl.where(valid[:, None], v, 0.0)  # a padded value never reaches an output (NaN included)
        a = tl.dot(fq, tl.trans(fk), input_precision=PREC, out_dtype=ACC) * _gate(mc, offs_t, t_ok, LOG)
        past = tl.exp(tl.minimum(m_prev - mc, 0.0))  # [BT]
        num = (
            tl.dot(a, v, input_precision=PREC, out_dtype=ACC)
            + tl.dot(fq, s, input_precision=PREC, out_dtype=ACC) * past[:, None]
        )
        den = tl.sum(a, 1) + tl.sum(fq * z[None, :], 1) * past
        tl.store(NUM + bh * N * DV + offs_t[:, None] * DV + offs_v[None, :], num, mask=t_ok[:, None] & v_ok[None, :])
        tl.store(DEN + bh * N + offs_t, den, mask=offs_t < tl.where(pv == 0, N, 0))
        tl.store(MOUT + bh * N + offs_t, mc, mask=offs_t < tl.where(pv == 0, N, 0))
        m_new = tl.max(tl.where(t_ok, mc, FLOOR), 0, keep_dims=True)  # [1]
        decay = tl.exp(tl.minimum(m_prev - m_new, 0.0))
        kr = fk * tl.exp(tl.minimum(mc - m_new, 0.0))[:, None]
        s = s * decay[:, None] + tl.dot(tl.trans(kr), v, input_precision=PREC, out_dtype=ACC)
        z = z * decay + tl.sum(kr, 0)
        m_prev = m_new
    tl.store(S1 + bh * D * DV + sd, s, mask=sok)
    tl.store(Z1 + bh * D + offs_d, z, mask=offs_d < tl.where(pv == 0, D, 0))
    tl.store(M1 + bh + tl.arange(0, 1), m_prev, mask=tl.arange(0, 1) < tl.where(pv == 0, 1, 0))


@triton.jit
def causal_bwd_kernel(
    FQ,
    XQ,
    RQ,
    FK,
    XK,
    RK,
    W,
    PH,
    V,
    MASK,
    MOUT,
    DNUM,
    DDEN,
    S0,
    Z0,
    M0,
    DS1,
    DZ1,
    M1,
    DFQ,
    DXQ,
    DRQ,
    DFK,
    DXK,
    DRK,
    DVV,
    DS0,
    DZ0,
    H,
    N,
    D,
    E,
    DV,
    FEAT: tl.constexpr,
    LOG: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_STATE: tl.constexpr,
    HAS_DSTATE: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    BE: tl.constexpr,
    BV: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    pv = tl.program_id(1)
    slot = pv.to(tl.int64) * tl.num_programs(0)
    b = bh // H
    if FEAT != 0:
        W = _load_w(W, D, E, ACC, BD, BE)
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    offs_v = pv * BV + tl.arange(0, BV)
    v_ok = offs_v < DV
    sd = offs_d[:, None] * DV + offs_v[None, :]
    sok = d_ok[:, None] & v_ok[None, :]
    first = pv == 0
    # ---- sweep 1 (forward): query gradients, with the running state recomputed
    if HAS_STATE:
        s = tl.load(S0 + bh * D * DV + sd, mask=sok, other=0.0).to(ACC)
        z = tl.load(Z0 + bh * D + offs_d, mask=d_ok, other=0.0).to(ACC)
        m_prev = tl.maximum(tl.load(M0 + bh + tl.arange(0, 1)).to(ACC), FLOOR)
    else:
        s = tl.zeros([BD, BV], dtype=ACC)
        z = tl.zeros([BD], dtype=ACC)
        m_prev = tl.zeros([1], dtype=ACC) + FLOOR * LOG  # plain maps: 0, every factor is 1
    for t0 in range(0, N, BT):
        offs_t = t0 + tl.arange(0, BT)
        t_ok = offs_t < N
        valid = _valid_keys(MASK, b, N, offs_t, t_ok, HAS_MASK)
        lq = _raw(FQ, XQ, RQ, W, PH, bh, offs_t, t_ok, N, D, E, FEAT, ACC, BD, BE, PREC)
        fq = _query_side(lq, t_ok, D, LOG, BD)
        fk, mc = _key_side(
            _raw(FK, XK, RK, W, PH, bh, offs_t, t_ok, N, D, E, FEAT, ACC, BD, BE, PREC), valid, m_prev, D, LOG, BD
        )
        v = tl.load(
            V + bh * N * DV + offs_t[:, None] * DV + offs_v[None, :], mask=t_ok[:, None] & v_ok[None, :], other=0.0
        ).to(ACC)
        v = tl.where(valid[:, None], v, 0.0)
        dnum = tl.load(
            DNUM + bh * N * DV + offs_t[:, None] * DV + offs_v[None, :], mask=t_ok[:, None] & v_ok[None, :], other=0.0
        ).to(ACC)
        dden = tl.load(DDEN + bh * N + offs_t, mask=offs_t < tl.where(first, N, 0), other=0.0).to(ACC)
        gate = _gate(mc, offs_t, t_ok, LOG)
        da = (tl.dot(dnum, tl.trans(v), input_precision=PREC, out_dtype=ACC) + dden[:, None]) * gate  # [t, j]
        past = tl.exp(tl.minimum(m_prev - mc, 0.0))
        dfq = (
            tl.dot(da, fk, input_precision=PREC, out_dtype=ACC)
            + (tl.dot(dnum, tl.trans(s), input_precision=PREC, out_dtype=ACC) + dden[:, None] * z[None, :])
            * past[:, None]
        )
        if LOG:
            dfq = dfq * fq
        _raw_grad(dfq, DFQ, DXQ, DRQ, XQ, RQ, W, PH, slot, bh, offs_t, t_ok, N, D, E, FEAT, ACC, BD, BE, PREC)
        m_new = tl.max(tl.where(t_ok, mc, FLOOR), 0, keep_dims=True)
        decay = tl.exp(tl.minimum(m_prev - m_new, 0.0))
        kr = fk * tl.exp(tl.minimum(mc - m_new, 0.0))[:, None]
        s = s * decay[:, None] + tl.dot(tl.trans(kr), v, input_precision=PREC, out_dtype=ACC)
        z = z * decay + tl.sum(kr, 0)
        m_prev = m_new
    # ---- sweep 2 (backward): key and value gradients with the reverse state R stated at r
    r = m_prev
    if HAS_DSTATE:
        rs = tl.load(DS1 + bh * D * DV + sd, mask=sok, other=0.0).to(ACC)
        rz = tl.load(DZ1 + bh * D + offs_d, mask=offs_d < tl.where(first, D, 0), other=0.0).to(ACC)
    else:
        rs = tl.zeros([BD, BV], dtype=ACC)
        rz = tl.zeros([BD], dtype=ACC)
    nchunks = tl.cdiv(N, BT)
    for i in range(0, nchunks):
        t0 = (nchunks - 1 - i) * BT
        offs_t = t0 + tl.arange(0, BT)
        t_ok = offs_t < N
        valid = _valid_keys(MASK, b, N, offs_t, t_ok, HAS_MASK)
        mc = tl.load(MOUT + bh * N + offs_t, mask=t_ok, other=FLOOR).to(ACC)
        fq = _query_side(_raw(FQ, XQ, RQ, W, PH, bh, offs_t, t_ok, N, D, E, FEAT, ACC, BD, BE, PREC), t_ok, D, LOG, BD)
        lk = _raw(FK, XK, RK, W, PH, bh, offs_t, t_ok, N, D, E, FEAT, ACC, BD, BE, PREC)
        ok = valid[:, None] & d_ok[None, :]
        if LOG:
            fk = tl.where(ok, tl.exp(tl.minimum(tl.where(ok, lk, float("-inf")) - mc[:, None], 0.0)), 0.0)
        else:
            fk = tl.where(ok, lk, 0.0)
        v = tl.load(
            V + bh * N * DV + offs_t[:, None] * DV + offs_v[None, :], mask=t_ok[:, None] & v_ok[None, :], other=0.0
        ).to(ACC)
        v = tl.where(valid[:, None], v, 0.0)
        dnum = tl.load(
            DNUM + bh * N * DV + offs_t[:, None] * DV + offs_v[None, :], mask=t_ok[:, None] & v_ok[None, :], other=0.0
        ).to(ACC)
        dden = tl.load(DDEN + bh * N + offs_t, mask=offs_t < tl.where(first, N, 0), other=0.0).to(ACC)
        gate = _gate(mc, offs_t, t_ok, LOG)
        a = tl.dot(fq, tl.trans(fk), input_precision=PREC, out_dtype=ACC) * gate
        da = (tl.dot(dnum, tl.trans(v), input_precision=PREC, out_dtype=ACC) + dden[:, None]) * gate
        later = tl.exp(tl.minimum(mc - r, 0.0))  # [BT]: e^{m_j - r} <= 1
        fkl = fk * later[:, None]
        dv = tl.dot(tl.trans(a), dnum, input_precision=PREC, out_dtype=ACC) + tl.dot(
            fkl, rs, input_precision=PREC, out_dtype=ACC
        )
        dv = tl.where(valid[:, None], dv, 0.0)
        tl.store(DVV + bh * N * DV + offs_t[:, None] * DV + offs_v[None, :], dv, mask=t_ok[:, None] & v_ok[None, :])
        dfk = (
            tl.dot(tl.trans(da), fq, input_precision=PREC, out_dtype=ACC)
            + (tl.dot(v, tl.trans(rs), input_precision=PREC, out_dtype=ACC) + rz[None, :]) * later[:, None]
        )
        if LOG:
            dfk = dfk * fk
        dfk = tl.where(valid[:, None], dfk, 0.0)
        _raw_grad(dfk, DFK, DXK, DRK, XK, RK, W, PH, slot, bh, offs_t, t_ok, N, D, E, FEAT, ACC, BD, BE, PREC)
        r_new = tl.min(tl.where(t_ok, mc, -FLOOR), 0, keep_dims=True)  # m at the chunk's first position
        back = tl.exp(tl.minimum(r_new - r, 0.0))
        fqe = fq * tl.exp(tl.minimum(r_new - mc, 0.0))[:, None]
        rs = rs * back[:, None] + tl.dot(tl.trans(fqe), dnum, input_precision=PREC, out_dtype=ACC)
        rz = rz * back + tl.sum(fqe * dden[:, None], 0)
        r = r_new
    if HAS_STATE:
        m0 = tl.maximum(tl.load(M0 + bh + tl.arange(0, 1)).to(ACC), FLOOR)
        back = tl.exp(tl.minimum(m0 - r, 0.0))
        tl.store(DS0 + bh * D * DV + sd, rs * back[:, None], mask=sok)
        tl.store(DZ0 + bh * D + offs_d, rz * back, mask=offs_d < tl.where(first, D, 0))


@triton.jit
def noncausal_fwd_kernel(
    FQ,
    XQ,
    RQ,
    FK,
    XK,
    RK,
    W,
    PH,
    V,
    MASK,
    NUM,
    DEN,
    H,
    N,
    M,
    D,
    E,
    DV,
    FEAT: tl.constexpr,
    LOG: tl.constexpr,
    HAS_MASK: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    BE: tl.constexpr,
    BV: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    pv = tl.program_id(1)
    b = bh // H
    if FEAT != 0:
        W = _load_w(W, D, E, ACC, BD, BE)
    offs_v = pv * BV + tl.arange(0, BV)
    v_ok = offs_v < DV
    s, z, _ = _kv_state(
        FK, XK, RK, W, PH, V, MASK, bh, b, M, D, E, DV, offs_v, v_ok, FEAT, LOG, HAS_MASK, ACC, PREC, BT, BD, BE, BV
    )
    for t0 in range(0, N, BT):
        offs_t = t0 + tl.arange(0, BT)
        t_ok = offs_t < N
        fq = _query_side(_raw(FQ, XQ, RQ, W, PH, bh, offs_t, t_ok, N, D, E, FEAT, ACC, BD, BE, PREC), t_ok, D, LOG, BD)
        num = tl.dot(fq, s, input_precision=PREC, out_dtype=ACC)
        den = tl.sum(fq * z[None, :], 1)
        tl.store(NUM + bh * N * DV + offs_t[:, None] * DV + offs_v[None, :], num, mask=t_ok[:, None] & v_ok[None, :])
        tl.store(DEN + bh * N + offs_t, den, mask=offs_t < tl.where(pv == 0, N, 0))


@triton.jit
def _kv_state(
    FK,
    XK,
    RK,
    W,
    PH,
    V,
    MASK,
    bh,
    b,
    M,
    D,
    E,
    DV,
    offs_v,
    v_ok,
    FEAT: tl.constexpr,
    LOG: tl.constexpr,
    HAS_MASK: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    BE: tl.constexpr,
    BV: tl.constexpr,
):
    """:math:`S = \\sum_j e^{l_{k,j} - c} v_j^\\top`, :math:`z`, and :math:`c`, the maximum over
    all valid keys, in one pass (the sums are restated when the maximum grows)."""
    d_ok = tl.arange(0, BD) < D
    s = tl.zeros([BD, BV], dtype=ACC)
    z = tl.zeros([BD], dtype=ACC)
    c = tl.zeros([1], dtype=ACC) + FLOOR
    for t0 in range(0, M, BT):
        offs_t = t0 + tl.arange(0, BT)
        t_ok = offs_t < M
        valid = _valid_keys(MASK, b, M, offs_t, t_ok, HAS_MASK)
        lk = _raw(FK, XK, RK, W, PH, bh, offs_t, t_ok, M, D, E, FEAT, ACC, BD, BE, PREC)
        ok = valid[:, None] & d_ok[None, :]
        v = tl.load(
            V + bh * M * DV + offs_t[:, None] * DV + offs_v[None, :], mask=t_ok[:, None] & v_ok[None, :], other=0.0
        ).to(ACC)
        v = tl.where(valid[:, None], v, 0.0)
        if LOG:
            lk = tl.where(ok, lk, float("-inf"))
            c_new = tl.maximum(c, tl.max(tl.max(lk, 1), 0, keep_dims=True))
            fk = tl.where(ok, tl.exp(lk - c_new), 0.0)
            decay = tl.exp(tl.minimum(c - c_new, 0.0))
            s = s * decay[:, None]
            z = z * decay
            c = c_new
        else:
            fk = tl.where(ok, lk, 0.0)
        s += tl.dot(tl.trans(fk), v, input_precision=PREC, out_dtype=ACC)
        z += tl.sum(fk, 0)
    return s, z, c


@triton.jit
def noncausal_bwd_kernel(
    FQ,
    XQ,
    RQ,
    FK,
    XK,
    RK,
    W,
    PH,
    V,
    MASK,
    DNUM,
    DDEN,
    DFQ,
    DXQ,
    DRQ,
    DFK,
    DXK,
    DRK,
    DVV,
    H,
    N,
    M,
    D,
    E,
    DV,
    FEAT: tl.constexpr,
    LOG: tl.constexpr,
    HAS_MASK: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    BE: tl.constexpr,
    BV: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    pv = tl.program_id(1)
    slot = pv.to(tl.int64) * tl.num_programs(0)
    b = bh // H
    if FEAT != 0:
        W = _load_w(W, D, E, ACC, BD, BE)
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    offs_v = pv * BV + tl.arange(0, BV)
    v_ok = offs_v < DV
    first = pv == 0
    s, z, c = _kv_state(
        FK, XK, RK, W, PH, V, MASK, bh, b, M, D, E, DV, offs_v, v_ok, FEAT, LOG, HAS_MASK, ACC, PREC, BT, BD, BE, BV
    )
    ds = tl.zeros([BD, BV], dtype=ACC)
    dz = tl.zeros([BD], dtype=ACC)
    for t0 in range(0, N, BT):
        offs_t = t0 + tl.arange(0, BT)
        t_ok = offs_t < N
        fq = _query_side(_raw(FQ, XQ, RQ, W, PH, bh, offs_t, t_ok, N, D, E, FEAT, ACC, BD, BE, PREC), t_ok, D, LOG, BD)
        dnum = tl.load(
            DNUM + bh * N * DV + offs_t[:, None] * DV + offs_v[None, :], mask=t_ok[:, None] & v_ok[None, :], other=0.0
        ).to(ACC)
        dden = tl.load(DDEN + bh * N + offs_t, mask=offs_t < tl.where(first, N, 0), other=0.0).to(ACC)
        dfq = tl.dot(dnum, tl.trans(s), input_precision=PREC, out_dtype=ACC) + dden[:, None] * z[None, :]
        if LOG:
            dfq = dfq * fq
        _raw_grad(dfq, DFQ, DXQ, DRQ, XQ, RQ, W, PH, slot, bh, offs_t, t_ok, N, D, E, FEAT, ACC, BD, BE, PREC)
        ds += tl.dot(tl.trans(fq), dnum, input_precision=PREC, out_dtype=ACC)
        dz += tl.sum(fq * dden[:, None], 0)
    for t0 in range(0, M, BT):
        offs_t = t0 + tl.arange(0, BT)
        t_ok = offs_t < M
        valid = _valid_keys(MASK, b, M, offs_t, t_ok, HAS_MASK)
        lk = _raw(FK, XK, RK, W, PH, bh, offs_t, t_ok, M, D, E, FEAT, ACC, BD, BE, PREC)
        ok = valid[:, None] & d_ok[None, :]
        if LOG:
            fk = tl.where(ok, tl.exp(tl.minimum(tl.where(ok, lk, float("-inf")) - c, 0.0)), 0.0)
        else:
            fk = tl.where(ok, lk, 0.0)
        v = tl.load(
            V + bh * M * DV + offs_t[:, None] * DV + offs_v[None, :], mask=t_ok[:, None] & v_ok[None, :], other=0.0
        ).to(ACC)
        v = tl.where(valid[:, None], v, 0.0)
        dv = tl.where(valid[:, None], tl.dot(fk, ds, input_precision=PREC, out_dtype=ACC), 0.0)
        tl.store(DVV + bh * M * DV + offs_t[:, None] * DV + offs_v[None, :], dv, mask=t_ok[:, None] & v_ok[None, :])
        dfk = tl.dot(v, tl.trans(ds), input_precision=PREC, out_dtype=ACC) + dz[None, :]
        if LOG:
            dfk = dfk * fk
        dfk = tl.where(valid[:, None], dfk, 0.0)
        _raw_grad(dfk, DFK, DXK, DRK, XK, RK, W, PH, slot, bh, offs_t, t_ok, M, D, E, FEAT, ACC, BD, BE, PREC)


__all__ = [
    "FLOOR",
    "FLOOR_VALUE",
    "causal_bwd_kernel",
    "causal_fwd_kernel",
    "noncausal_bwd_kernel",
    "noncausal_fwd_kernel",
    "triton",
]
