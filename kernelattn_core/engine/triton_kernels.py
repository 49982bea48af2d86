"""Triton kernels of feature-map attention (imported only by :mod:`.triton_backend`).

Chunk-parallel, in the manner of flash-linear-attention's chunk kernels: the sequence
is cut into chunks of ``BT`` positions; the in-chunk products and the outputs run one
program per chunk, and a separate *state pass* carries the running sums from chunk to
chunk. Seven kernels, each tiled over the features ``D`` (``BK``), the values ``d_v``
(``BV``) and the map's input ``d'`` (``BE``), so the on-chip work space of a program
depends on the tiles only, never on the shape:

=================  =========================  ==================================================
kernel             grid                       computes
=================  =========================  ==================================================
``prep``           (row blocks, B·H)          per row: the maximum of the log-features and
                                              whether the row holds a NaN/inf (features or value)
``state_fwd``      (D tiles, d_v tiles, B·H)  :math:`S_c` entering each chunk (causal) or the
                                              one sum :math:`S` (non-causal); the final state
``out_fwd``        (d_v tiles, chunks, B·H)   numerator and denominator of each chunk
``state_bwd``      (D tiles, d_v tiles, B·H)  :math:`\\bar S` leaving each chunk, backwards
``bwd_dv``         (d_v tiles, chunks, B·H)   value gradients
``bwd_dqk``        (d' tiles, chunks, B·H)    query (``SIDE = 0``) or key (``SIDE = 1``)
                                              gradients, chained to ``x'`` and the row term
=================  =========================  ==================================================

Features come from memory (``FEAT = 0``: features; ``FEAT = 1``: log-features) or are
computed on chip from ``x' [N, d']``, the frequencies ``ω [D, d']`` and a per-row term
(``FEAT = 2``: :math:`\\log\\phi = x'\\omega^\\top + \\beta`; ``FEAT = 3``:
:math:`\\phi = \\rho\\cos(x'\\omega^\\top + b)`), so the ``[N, D]`` features never go to
memory, forward or backward.

Notation (log maps; plain maps drop every stabiliser): per row :math:`t`,
:math:`\\hat q_t = e^{l_{q,t} - \\mu_t}` with :math:`\\mu_t = \\max_D l_{q,t}`
(``MQ``), :math:`\\hat k_j = e^{l_{k,j} - m_j}` with the prefix maximum
:math:`m_j = \\max_{i \\le j}\\max_D l_{k,i}` (``MK``; non-causal: one maximum over all
keys), the state :math:`S_c` entering chunk ``c`` stated at :math:`M_{c-1}` (``MC``, the
:math:`m` of the previous chunk's last row), the gate
:math:`G_{tj} = [j \\le t]\\, e^{m_j - m_t}`. For a row :math:`t` of chunk ``c``:

.. math::
    \\mathrm{num}_t = \\sum_{j \\in c} G_{tj} (\\hat q_t \\cdot \\hat k_j) v_j
    + e^{M_{c-1} - m_t} S_c^\\top \\hat q_t, \\qquad
    S_{c+1} = e^{M_{c-1} - M_c} S_c + \\sum_{j \\in c} e^{l_{k,j} - M_c} v_j^\\top,

and the denominator with :math:`z` and :math:`v_j = 1`. Every exponent is
:math:`\\le 0` in exact arithmetic and clamped to :math:`\\le 0`, so nothing overflows.
The backward pass (:math:`\\bar o_t = (\\overline{\\mathrm{num}}_t, \\overline{\\mathrm{den}}_t)`,
:math:`\\tilde v_j = (v_j, 1)`, :math:`P = (\\hat q \\hat k^\\top) \\circ G`,
:math:`\\bar P = (\\bar o \\tilde v^\\top) \\circ G`):

.. math::
    \\bar S_c = \\sum_{t \\in c} e^{M_{c-1} - m_t} \\hat q_t \\bar o_t^\\top
    + e^{M_{c-1} - M_c} \\bar S_{c+1}, \\qquad
    \\bar{\\hat q} = \\bar P \\hat k + e^{M_{c-1} - m_t} \\bar o \\tilde S_c^\\top,

.. math::
    \\bar{\\hat k} = \\bar P^\\top \\hat q + e^{m_j - M_c} \\tilde v \\bar{S}_{c+1}^\\top, \\qquad
    \\bar v = P^\\top \\overline{\\mathrm{num}} + e^{m_j - M_c} \\hat k \\bar S_{c+1},

then :math:`\\bar l = \\bar{\\hat q} \\circ \\hat q` (log maps; the stabilisers are
constants) and, fused, :math:`\\bar x' = \\bar u\\, \\omega`.

**Non-finite rows.** ``prep`` flags rows holding NaN or inf (``-inf`` is a valid
log-feature); the caller turns the flags into ``QP`` (the query rows that are NaN:
their features are zeroed and their incoming gradient ignored) and ``KD`` (dropped keys:
padded or non-finite; features and values zeroed before any product), so a NaN never
meets a product as :math:`0 \\cdot \\mathrm{NaN}`.

**Operand precision.** ``tl.dot`` takes the operands in ``OPF`` (bounded operands:
log-space features :math:`\\le 1`, gated products, values) or ``OPS`` (state sums and
gradients, which may exceed float16's range), with ``ACC`` accumulation: bfloat16 /
bfloat16 for bfloat16 inputs, float16 / TF32 for float16 inputs (TF32 for both with
plain maps, whose features are unbounded), IEEE float32 for float32, float64 under the
interpreter. ``EMU`` (interpreter only) computes bfloat16 products in float32 from the
rounded operands, as the tensor cores do (the interpreter's own bfloat16 ``dot`` is
wrong), and with ``EMU = 2`` rounds TF32 operands to TF32 (``cvt.rna``).

Every integer argument is left unspecialised (``do_not_specialize``), so one compiled
binary per table entry serves every shape: the compile test covers exactly what runs.
"""

from __future__ import annotations

import triton
import triton.language as tl

FLOOR_VALUE = -1.0e30
#: the stabiliser before any valid key (a global must be constexpr inside a compiled kernel)
FLOOR: tl.constexpr = tl.constexpr(FLOOR_VALUE)

#: integer arguments of every kernel (never specialised, see the module docstring)
_INTS = ["R", "D", "E", "DV", "LD", "LE", "LV", "NC", "NCH", "causal", "has_v"]


def _jit(fn):  # type: ignore[no-untyped-def]
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    return triton.jit(do_not_specialize=[n for n in _INTS if n in names])(fn)


@triton.jit
def _tf32(x):
    """``x`` rounded to TF32 (10-bit mantissa, to nearest, ties away: ``cvt.rna.tf32.f32``)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x1000) & -8192
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, OP: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, ACC: tl.constexpr):
    """``a @ b`` with operands in ``OP`` and ``ACC`` accumulation (see the module docstring)."""
    a = a.to(OP)
    b = b.to(OP)
    if EMU:
        if OP == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if EMU == 2 and PREC == "tf32":
            a = _tf32(a)
            b = _tf32(b)
    return tl.dot(a, b, out_dtype=ACC, input_precision=PREC)


@triton.jit
def _features(
    F,
    X,
    ROW,
    W,
    PH,
    rows,
    r_ok,
    k0,
    D,
    E,
    LD,
    LE,
    FEAT: tl.constexpr,
    ACC: tl.constexpr,
    OPX: tl.constexpr,
    PX: tl.constexpr,
    EMU: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BE: tl.constexpr,
):
    """Raw features ``[BT, BK]`` of ``rows`` (columns ``k0 .. k0 + BK``) and, for trig maps,
    the angle :math:`u + b`; ``F``, ``X``, ``ROW`` point at this ``(batch, head)``. Garbage
    (not NaN-free) outside ``r_ok``: callers mask."""
    offs_k = k0 + tl.arange(0, BK)
    k_ok = offs_k < D
    if FEAT <= 1:
        # columns up to the padded stride LD (zeros past D; callers mask by D): vector loads
        k_in = offs_k < LD
        f = tl.load(F + rows[:, None] * LD + offs_k[None, :], mask=r_ok[:, None] & k_in[None, :], other=0.0).to(ACC)
        ang = f
    else:
        u = tl.zeros([BT, BK], dtype=ACC)
        for e0 in range(0, E, BE):
            offs_e = e0 + tl.arange(0, BE)
            e_in = offs_e < LE  # zeros past d' in x' and ω
            x = tl.load(X + rows[:, None] * LE + offs_e[None, :], mask=r_ok[:, None] & e_in[None, :], other=0.0)
            w = tl.load(W + offs_k[:, None] * LE + offs_e[None, :], mask=k_ok[:, None] & e_in[None, :], other=0.0)
            u += _dot(x, tl.trans(w), OPX, PX, EMU, ACC)
        row = tl.load(ROW + rows, mask=r_ok, other=0.0).to(ACC)
        if FEAT == 2:
            f = u + row[:, None]
            ang = u
        else:
            ph = tl.load(PH + offs_k, mask=k_ok, other=0.0).to(ACC)
            ang = u + ph[None, :]
            f = row[:, None] * tl.cos(ang)
    return f, ang


@triton.jit
def _hat(f, m, keep, LOG: tl.constexpr):
    """:math:`e^{f - m}` (log maps, exponent clamped to ``<= 0``) or ``f``; 0 where not ``keep``."""
    if LOG:
        f = tl.exp(tl.minimum(f - m[:, None], 0.0))
    return tl.where(keep, f, 0.0)


@triton.jit
def _gate(mt, rows, r_ok, LOG: tl.constexpr):
    """``[t, j]``: :math:`e^{m_j - m_t}` on ``j <= t`` (1 for plain maps), 0 elsewhere."""
    keep = (rows[None, :] <= rows[:, None]) & r_ok[:, None] & r_ok[None, :]
    if LOG:
        g = tl.exp(tl.minimum(mt[None, :] - mt[:, None], 0.0))
        return tl.where(keep, g, 0.0)
    return tl.where(keep, 1.0, 0.0)


@triton.jit
def _on(rows, flag):
    """``[BT]`` of ``flag != 0`` (a scalar flag broadcast to a boolean vector; ``r_ok & (flag != 0)``
    gives integers under the interpreter)."""
    return (rows * 0 + flag) != 0


@triton.jit
def _last_m(MK, c, R, BT: tl.constexpr):
    """:math:`M_c`: the stabiliser at the last row of chunk ``c``."""
    return tl.load(MK + tl.minimum(c * BT + BT, R) - 1)


# ------------------------------------------------------------------------------------ prep
@_jit
def prep_kernel(
    F,
    X,
    ROW,
    W,
    PH,
    V,
    MX,
    BAD,
    R,
    D,
    E,
    DV,
    LD,
    LE,
    LV,
    has_v,
    FEAT: tl.constexpr,
    ACC: tl.constexpr,
    OPX: tl.constexpr,
    PX: tl.constexpr,
    EMU: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BE: tl.constexpr,
    BV: tl.constexpr,
):
    """Per row of ``R``: ``MX`` the maximum over ``D`` of the finite log-features (``-inf``
    if none; log maps) and ``BAD`` whether the row's features (NaN or ``+inf`` for log
    maps, NaN or ``±inf`` otherwise) or, with ``has_v``, its value hold a non-finite number."""
    LD = LD // 16 * 16  # row strides: multiples of 16 (the host pads), which the compiler now knows
    LE = LE // 16 * 16
    LV = LV // 16 * 16
    LOG: tl.constexpr = FEAT == 1 or FEAT == 2
    pr = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = pr * BT + tl.arange(0, BT)
    r_ok = rows < R
    F += bh * R * LD
    X += bh * R * LE
    ROW += bh * R
    V += bh * R * LV
    mx = tl.full([BT], float("-inf"), ACC)
    bad = tl.zeros([BT], dtype=tl.int32)
    for k0 in range(0, D, BK):
        f, _ = _features(F, X, ROW, W, PH, rows, r_ok, k0, D, E, LD, LE, FEAT, ACC, OPX, PX, EMU, BT, BK, BE)
        ok = r_ok[:, None] & ((k0 + tl.arange(0, BK)) < D)[None, :]
        if LOG:
            nonfinite = (f != f) | (f == float("inf"))
            mx = tl.maximum(mx, tl.max(tl.where(ok & ~nonfinite, f, float("-inf")), 1))
        else:
            nonfinite = (f != f) | (tl.abs(f) == float("inf"))
        bad = tl.maximum(bad, tl.max(tl.where(ok & nonfinite, 1, 0), 1))
    if has_v != 0:
        for v0 in range(0, DV, BV):
            offs_v = v0 + tl.arange(0, BV)
            ok = r_ok[:, None] & (offs_v < LV)[None, :]
            v = tl.load(V + rows[:, None] * LV + offs_v[None, :], mask=ok, other=0.0).to(ACC)
            nonfinite = (v != v) | (tl.abs(v) == float("inf"))
            bad = tl.maximum(bad, tl.max(tl.where(ok & nonfinite, 1, 0), 1))
    tl.store(MX + bh * R + rows, mx, mask=r_ok)
    tl.store(BAD + bh * R + rows, bad.to(tl.int8), mask=r_ok)


# ------------------------------------------------------------------------------- forward
@_jit
def state_fwd_kernel(
    FK,
    XK,
    RK,
    W,
    PH,
    V,
    KD,
    MK,
    S0,
    Z0,
    M0,
    H,
    HZ,
    S1,
    Z1,
    R,
    D,
    E,
    DV,
    LD,
    LE,
    LV,
    NC,
    causal,
    FEAT: tl.constexpr,
    ACC: tl.constexpr,
    OPX: tl.constexpr,
    PX: tl.constexpr,
    OPF: tl.constexpr,
    PF: tl.constexpr,
    EMU: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BE: tl.constexpr,
    BV: tl.constexpr,
):
    """The state pass: from ``(S0, Z0)`` stated at ``M0``, the states entering each chunk
    (``H``, ``HZ``, causal only) and the final one (``S1``, ``Z1``, stated at
    :math:`M_{\\mathrm{last}}`; non-causal: the sum over all keys at the one maximum)."""
    LD = LD // 16 * 16  # row strides: multiples of 16 (the host pads), which the compiler now knows
    LE = LE // 16 * 16
    LV = LV // 16 * 16
    LOG: tl.constexpr = FEAT == 1 or FEAT == 2
    pk = tl.program_id(0)
    pv = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    offs_k = pk * BK + tl.arange(0, BK)
    k_ok = offs_k < D
    offs_v = pv * BV + tl.arange(0, BV)
    v_ok = offs_v < LV  # zeros past d_v (the host pads)
    sd = offs_k[:, None] * LV + offs_v[None, :]
    sok = k_ok[:, None] & v_ok[None, :]
    zok = offs_k < tl.where(pv == 0, D, 0)  # z: the first d_v block writes it
    FK += bh * R * LD
    XK += bh * R * LE
    RK += bh * R
    V += bh * R * LV
    KD += bh * R
    MK += bh * R
    s = tl.load(S0 + bh * D * LV + sd, mask=sok, other=0.0).to(ACC)
    z = tl.load(Z0 + bh * D + offs_k, mask=k_ok, other=0.0).to(ACC)
    m_prev = tl.load(M0 + bh).to(ACC)
    for c in range(0, NC):
        if causal != 0:
            tl.store(H + (bh * NC + c) * D * LV + sd, s.to(H.dtype.element_ty), mask=sok)
            tl.store(HZ + (bh * NC + c) * D + offs_k, z, mask=zok)
        rows = c * BT + tl.arange(0, BT)
        r_ok = rows < R
        keep = (tl.load(KD + rows, mask=r_ok, other=1) == 0) & r_ok
        f, _ = _features(FK, XK, RK, W, PH, rows, r_ok, pk * BK, D, E, LD, LE, FEAT, ACC, OPX, PX, EMU, BT, BK, BE)
        if LOG:
            m_end = _last_m(MK, c, R, BT)
            decay = tl.exp(tl.minimum(m_prev - m_end, 0.0))
            s = s * decay
            z = z * decay
            m_prev = m_end
            fk = tl.where(keep[:, None] & k_ok[None, :], tl.exp(tl.minimum(f - m_end, 0.0)), 0.0)
        else:
            fk = tl.where(keep[:, None] & k_ok[None, :], f, 0.0)
        v = tl.load(V + rows[:, None] * LV + offs_v[None, :], mask=keep[:, None] & v_ok[None, :], other=0.0)
        s += _dot(tl.trans(fk), v, OPF, PF, EMU, ACC)  # [BK, BV]
        z += tl.sum(fk, 0)
    tl.store(S1 + bh * D * LV + sd, s, mask=sok)
    tl.store(Z1 + bh * D + offs_k, z, mask=zok)


@_jit
def out_fwd_kernel(
    FQ,
    XQ,
    RQ,
    FK,
    XK,
    RK,
    W,
    PH,
    V,
    QP,
    KD,
    MQ,
    MK,
    MC,
    H,
    HZ,
    NUM,
    DEN,
    R,
    D,
    E,
    DV,
    LD,
    LE,
    LV,
    NC,
    NCH,
    causal,
    FEAT: tl.constexpr,
    ACC: tl.constexpr,
    OPX: tl.constexpr,
    PX: tl.constexpr,
    OPF: tl.constexpr,
    PF: tl.constexpr,
    OPS: tl.constexpr,
    PS: tl.constexpr,
    EMU: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BE: tl.constexpr,
    BV: tl.constexpr,
):
    """Numerator ``[BT, BV]`` and denominator of the ``R`` query rows of one chunk: the
    state term (``H`` holds ``NCH`` states per head: one per chunk, or the non-causal sum)
    and, causal, the in-chunk term. Poisoned rows (``QP``) are NaN."""
    LD = LD // 16 * 16  # row strides: multiples of 16 (the host pads), which the compiler now knows
    LE = LE // 16 * 16
    LV = LV // 16 * 16
    LOG: tl.constexpr = FEAT == 1 or FEAT == 2
    pv = tl.program_id(0)
    c = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    rows = c * BT + tl.arange(0, BT)
    r_ok = rows < R
    offs_v = pv * BV + tl.arange(0, BV)
    v_ok = offs_v < LV  # zeros past d_v (the host pads)
    FQ += bh * R * LD
    XQ += bh * R * LE
    RQ += bh * R
    FK += bh * R * LD
    XK += bh * R * LE
    RK += bh * R
    V += bh * R * LV
    hc = bh * NCH + tl.minimum(c, NCH - 1)
    poisoned = tl.load(QP + bh * R + rows, mask=r_ok, other=1) != 0
    qkeep = r_ok & ~poisoned
    mq = tl.load(MQ + bh * R + rows, mask=r_ok, other=0.0).to(ACC)
    c_ok = r_ok & _on(rows, causal)  # key-side rows exist (N = M) only in causal calls
    kkeep = (tl.load(KD + bh * R + rows, mask=c_ok, other=1) == 0) & c_ok
    mt = tl.load(MK + bh * R + rows, mask=c_ok, other=FLOOR).to(ACC)
    o = tl.zeros([BT, BV], dtype=ACC)
    den = tl.zeros([BT], dtype=ACC)
    a = tl.zeros([BT, BT], dtype=ACC)
    for k0 in range(0, D, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < D
        f, _ = _features(FQ, XQ, RQ, W, PH, rows, r_ok, k0, D, E, LD, LE, FEAT, ACC, OPX, PX, EMU, BT, BK, BE)
        fq = _hat(f, mq, qkeep[:, None] & k_ok[None, :], LOG)  # [BT, BK]
        sd = offs_k[:, None] * LV + offs_v[None, :]
        s = tl.load(H + hc * D * LV + sd, mask=k_ok[:, None] & v_ok[None, :], other=0.0)
        z = tl.load(HZ + hc * D + offs_k, mask=k_ok, other=0.0).to(ACC)
        o += _dot(fq, s, OPS, PS, EMU, ACC)
        den += tl.sum(fq * z[None, :], 1)
        if causal != 0:
            g, _ = _features(FK, XK, RK, W, PH, rows, r_ok, k0, D, E, LD, LE, FEAT, ACC, OPX, PX, EMU, BT, BK, BE)
            fk = _hat(g, mt, kkeep[:, None] & k_ok[None, :], LOG)
            a += _dot(fq, tl.trans(fk), OPF, PF, EMU, ACC)  # [t, j]
    if causal != 0:
        if LOG:
            past = tl.exp(tl.minimum(tl.load(MC + bh * NC + c).to(ACC) - mt, 0.0))  # e^{M_{c-1} - m_t}
            o = o * past[:, None]
            den = den * past
        a = a * _gate(mt, rows, r_ok, LOG)
        v = tl.load(V + rows[:, None] * LV + offs_v[None, :], mask=kkeep[:, None] & v_ok[None, :], other=0.0)
        o += _dot(a, v, OPF, PF, EMU, ACC)
        den += tl.sum(a, 1)
    o = tl.where(poisoned[:, None], float("nan"), o)
    den = tl.where(poisoned, float("nan"), den)
    tl.store(NUM + bh * R * LV + rows[:, None] * LV + offs_v[None, :], o, mask=r_ok[:, None] & v_ok[None, :])
    tl.store(DEN + bh * R + rows, den, mask=rows < tl.where(pv == 0, R, 0))


# ------------------------------------------------------------------------------ backward
@_jit
def state_bwd_kernel(
    FQ,
    XQ,
    RQ,
    W,
    PH,
    QP,
    MQ,
    MK,
    MC,
    DNUM,
    DDEN,
    DS1,
    DZ1,
    DH,
    DHZ,
    DS0,
    DZ0,
    R,
    D,
    E,
    DV,
    LD,
    LE,
    LV,
    NC,
    causal,
    FEAT: tl.constexpr,
    ACC: tl.constexpr,
    OPX: tl.constexpr,
    PX: tl.constexpr,
    OPS: tl.constexpr,
    PS: tl.constexpr,
    EMU: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BE: tl.constexpr,
    BV: tl.constexpr,
):
    """The reverse state pass: from the final state's gradient ``(DS1, DZ1)``, the gradient
    :math:`\\bar S_{c+1}` of the state leaving each chunk (``DH``, ``DHZ``, causal) and the
    initial state's (``DS0``, ``DZ0``; non-causal: :math:`\\sum_t \\hat q_t \\bar o_t^\\top`)."""
    LD = LD // 16 * 16  # row strides: multiples of 16 (the host pads), which the compiler now knows
    LE = LE // 16 * 16
    LV = LV // 16 * 16
    LOG: tl.constexpr = FEAT == 1 or FEAT == 2
    pk = tl.program_id(0)
    pv = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    offs_k = pk * BK + tl.arange(0, BK)
    k_ok = offs_k < D
    offs_v = pv * BV + tl.arange(0, BV)
    v_ok = offs_v < LV  # zeros past d_v (the host pads)
    sd = offs_k[:, None] * LV + offs_v[None, :]
    sok = k_ok[:, None] & v_ok[None, :]
    zok = offs_k < tl.where(pv == 0, D, 0)
    FQ += bh * R * LD
    XQ += bh * R * LE
    RQ += bh * R
    MK += bh * R
    ds = tl.load(DS1 + bh * D * LV + sd, mask=sok, other=0.0).to(ACC)
    dz = tl.load(DZ1 + bh * D + offs_k, mask=k_ok, other=0.0).to(ACC)
    for i in range(0, NC):
        c = NC - 1 - i
        if causal != 0:
            tl.store(DH + (bh * NC + c) * D * LV + sd, ds.to(DH.dtype.element_ty), mask=sok)
            tl.store(DHZ + (bh * NC + c) * D + offs_k, dz, mask=zok)
        rows = c * BT + tl.arange(0, BT)
        r_ok = rows < R
        qkeep = (tl.load(QP + bh * R + rows, mask=r_ok, other=1) == 0) & r_ok
        mq = tl.load(MQ + bh * R + rows, mask=r_ok, other=0.0).to(ACC)
        f, _ = _features(FQ, XQ, RQ, W, PH, rows, r_ok, pk * BK, D, E, LD, LE, FEAT, ACC, OPX, PX, EMU, BT, BK, BE)
        fq = _hat(f, mq, qkeep[:, None] & k_ok[None, :], LOG)
        dn = tl.load(
            DNUM + bh * R * LV + rows[:, None] * LV + offs_v[None, :], mask=qkeep[:, None] & v_ok[None, :], other=0.0
        ).to(ACC)
        dd = tl.load(DDEN + bh * R + rows, mask=qkeep, other=0.0).to(ACC)
        if LOG:
            if causal != 0:
                mt = tl.load(MK + rows, mask=r_ok, other=FLOOR).to(ACC)
                m_prev = tl.load(MC + bh * NC + c).to(ACC)
                fq = fq * tl.exp(tl.minimum(m_prev - mt, 0.0))[:, None]  # e^{M_{c-1} - m_t}
                decay = tl.exp(tl.minimum(m_prev - _last_m(MK, c, R, BT), 0.0))
                ds = ds * decay
                dz = dz * decay
        ds += _dot(tl.trans(fq), dn, OPS, PS, EMU, ACC)
        dz += tl.sum(fq * dd[:, None], 0)
    tl.store(DS0 + bh * D * LV + sd, ds, mask=sok)
    tl.store(DZ0 + bh * D + offs_k, dz, mask=zok)


@_jit
def bwd_dv_kernel(
    FQ,
    XQ,
    RQ,
    FK,
    XK,
    RK,
    W,
    PH,
    QP,
    KD,
    MQ,
    MK,
    DH,
    DNUM,
    DVV,
    R,
    D,
    E,
    DV,
    LD,
    LE,
    LV,
    NCH,
    causal,
    FEAT: tl.constexpr,
    ACC: tl.constexpr,
    OPX: tl.constexpr,
    PX: tl.constexpr,
    OPF: tl.constexpr,
    PF: tl.constexpr,
    OPS: tl.constexpr,
    PS: tl.constexpr,
    EMU: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BE: tl.constexpr,
    BV: tl.constexpr,
):
    """Value gradients of the ``R`` key rows of one chunk:
    :math:`\\bar v = P^\\top \\overline{\\mathrm{num}} + e^{m_j - M_c} \\hat k \\bar S_{c+1}`."""
    LD = LD // 16 * 16  # row strides: multiples of 16 (the host pads), which the compiler now knows
    LE = LE // 16 * 16
    LV = LV // 16 * 16
    LOG: tl.constexpr = FEAT == 1 or FEAT == 2
    pv = tl.program_id(0)
    c = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    rows = c * BT + tl.arange(0, BT)
    r_ok = rows < R
    offs_v = pv * BV + tl.arange(0, BV)
    v_ok = offs_v < LV  # zeros past d_v (the host pads)
    FQ += bh * R * LD
    XQ += bh * R * LE
    RQ += bh * R
    FK += bh * R * LD
    XK += bh * R * LE
    RK += bh * R
    MK += bh * R
    hc = bh * NCH + tl.minimum(c, NCH - 1)
    c_ok = r_ok & _on(rows, causal)  # query-side rows exist (N = M) only in causal calls
    kkeep = (tl.load(KD + bh * R + rows, mask=r_ok, other=1) == 0) & r_ok
    qkeep = (tl.load(QP + bh * R + rows, mask=c_ok, other=1) == 0) & c_ok
    mt = tl.load(MK + rows, mask=r_ok, other=FLOOR).to(ACC)
    mq = tl.load(MQ + bh * R + rows, mask=c_ok, other=0.0).to(ACC)
    dv = tl.zeros([BT, BV], dtype=ACC)
    p = tl.zeros([BT, BT], dtype=ACC)
    for k0 in range(0, D, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < D
        g, _ = _features(FK, XK, RK, W, PH, rows, r_ok, k0, D, E, LD, LE, FEAT, ACC, OPX, PX, EMU, BT, BK, BE)
        fk = _hat(g, mt, kkeep[:, None] & k_ok[None, :], LOG)
        ds = tl.load(
            DH + hc * D * LV + offs_k[:, None] * LV + offs_v[None, :], mask=k_ok[:, None] & v_ok[None, :], other=0.0
        )
        dv += _dot(fk, ds, OPS, PS, EMU, ACC)
        if causal != 0:
            f, _ = _features(FQ, XQ, RQ, W, PH, rows, r_ok, k0, D, E, LD, LE, FEAT, ACC, OPX, PX, EMU, BT, BK, BE)
            fq = _hat(f, mq, qkeep[:, None] & k_ok[None, :], LOG)
            p += _dot(fq, tl.trans(fk), OPF, PF, EMU, ACC)  # [t, j]
    if causal != 0:
        if LOG:
            dv = dv * tl.exp(tl.minimum(mt - _last_m(MK, c, R, BT), 0.0))[:, None]  # e^{m_j - M_c}
        p = p * _gate(mt, rows, r_ok, LOG)
        dn = tl.load(
            DNUM + bh * R * LV + rows[:, None] * LV + offs_v[None, :], mask=qkeep[:, None] & v_ok[None, :], other=0.0
        )
        dv += _dot(tl.trans(p), dn, OPS, PS, EMU, ACC)
    dv = tl.where(kkeep[:, None], dv, 0.0)
    tl.store(DVV + bh * R * LV + rows[:, None] * LV + offs_v[None, :], dv, mask=r_ok[:, None] & v_ok[None, :])


@_jit
def bwd_dqk_kernel(
    FQ,
    XQ,
    RQ,
    FK,
    XK,
    RK,
    W,
    PH,
    V,
    QP,
    KD,
    MQ,
    MK,
    MC,
    H,
    HZ,
    DNUM,
    DDEN,
    DF,
    DX,
    DROW,
    R,
    D,
    E,
    DV,
    LD,
    LE,
    LV,
    NC,
    NCH,
    causal,
    SIDE: tl.constexpr,
    FEAT: tl.constexpr,
    ACC: tl.constexpr,
    OPX: tl.constexpr,
    PX: tl.constexpr,
    OPS: tl.constexpr,
    PS: tl.constexpr,
    EMU: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BE: tl.constexpr,
    BV: tl.constexpr,
):
    """Gradients of the query (``SIDE = 0``; ``H`` the states :math:`S_c`) or key
    (``SIDE = 1``; ``H`` the gradients :math:`\\bar S_{c+1}`) features of one chunk's
    ``R`` rows, written as they are (``DF``) or chained to ``x'`` (``DX``, the ``d'``
    block of this program) and the row term (``DROW``)."""
    LD = LD // 16 * 16  # row strides: multiples of 16 (the host pads), which the compiler now knows
    LE = LE // 16 * 16
    LV = LV // 16 * 16
    LOG: tl.constexpr = FEAT == 1 or FEAT == 2
    pe = tl.program_id(0)
    c = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    rows = c * BT + tl.arange(0, BT)
    r_ok = rows < R
    FQ += bh * R * LD
    XQ += bh * R * LE
    RQ += bh * R
    FK += bh * R * LD
    XK += bh * R * LE
    RK += bh * R
    V += bh * R * LV
    DNUM += bh * R * LV
    MK += bh * R
    hc = bh * NCH + tl.minimum(c, NCH - 1)
    # the other side's rows exist (N = M) only in causal calls
    q_ok = r_ok & _on(rows, causal + (SIDE == 0))
    k_ok_rows = r_ok & _on(rows, causal + (SIDE == 1))
    qkeep = (tl.load(QP + bh * R + rows, mask=q_ok, other=1) == 0) & q_ok
    kkeep = (tl.load(KD + bh * R + rows, mask=k_ok_rows, other=1) == 0) & k_ok_rows
    mq = tl.load(MQ + bh * R + rows, mask=q_ok, other=0.0).to(ACC)
    mt = tl.load(MK + rows, mask=k_ok_rows, other=FLOOR).to(ACC)
    dd = tl.load(DDEN + bh * R + rows, mask=qkeep, other=0.0).to(ACC)
    # the in-chunk gradient dP [t, j] = (dnum_t . v_j + dden_t) G_tj, over every d_v block
    dp = tl.zeros([BT, BT], dtype=ACC)
    scale = tl.zeros([BT], dtype=ACC) + 1.0  # of the state term: e^{M_{c-1} - m_t} or e^{m_j - M_c}
    if causal != 0:
        for v0 in range(0, DV, BV):
            offs_v = v0 + tl.arange(0, BV)
            v_ok = offs_v < LV  # zeros past d_v (the host pads)
            dn = tl.load(DNUM + rows[:, None] * LV + offs_v[None, :], mask=qkeep[:, None] & v_ok[None, :], other=0.0)
            v = tl.load(V + rows[:, None] * LV + offs_v[None, :], mask=kkeep[:, None] & v_ok[None, :], other=0.0)
            dp += _dot(dn, tl.trans(v), OPS, PS, EMU, ACC)
        dp = (dp + dd[:, None]) * _gate(mt, rows, r_ok, LOG)
        if LOG:
            if SIDE == 0:
                scale = tl.exp(tl.minimum(tl.load(MC + bh * NC + c).to(ACC) - mt, 0.0))
            else:
                scale = tl.exp(tl.minimum(mt - _last_m(MK, c, R, BT), 0.0))
    offs_e = pe * BE + tl.arange(0, BE)
    e_ok = offs_e < LE
    dx = tl.zeros([BT, BE], dtype=ACC)
    drow = tl.zeros([BT], dtype=ACC)
    if SIDE == 0:
        keep = qkeep
        m_own = mq
    else:
        keep = kkeep
        m_own = mt
    for k0 in range(0, D, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < D
        ok = keep[:, None] & k_ok[None, :]
        # the state term: dnum S^T + dden z (queries) or v dS^T + dz (keys)
        g = tl.zeros([BT, BK], dtype=ACC)
        for v0 in range(0, DV, BV):
            offs_v = v0 + tl.arange(0, BV)
            v_ok = offs_v < LV  # zeros past d_v (the host pads)
            s = tl.load(
                H + hc * D * LV + offs_k[:, None] * LV + offs_v[None, :],
                mask=k_ok[:, None] & v_ok[None, :],
                other=0.0,
            )
            if SIDE == 0:
                rhs = tl.load(
                    DNUM + rows[:, None] * LV + offs_v[None, :], mask=qkeep[:, None] & v_ok[None, :], other=0.0
                )
            else:
                rhs = tl.load(V + rows[:, None] * LV + offs_v[None, :], mask=kkeep[:, None] & v_ok[None, :], other=0.0)
            g += _dot(rhs, tl.trans(s), OPS, PS, EMU, ACC)
        z = tl.load(HZ + hc * D + offs_k, mask=k_ok, other=0.0).to(ACC)
        if SIDE == 0:
            g += dd[:, None] * z[None, :]
        else:
            g += z[None, :]
        g = g * scale[:, None]
        if causal != 0:  # the in-chunk term: dP k (queries) or dP^T q (keys)
            if SIDE == 0:
                h, _ = _features(FK, XK, RK, W, PH, rows, r_ok, k0, D, E, LD, LE, FEAT, ACC, OPX, PX, EMU, BT, BK, BE)
                other = _hat(h, mt, kkeep[:, None] & k_ok[None, :], LOG)
                g += _dot(dp, other, OPS, PS, EMU, ACC)
            else:
                h, _ = _features(FQ, XQ, RQ, W, PH, rows, r_ok, k0, D, E, LD, LE, FEAT, ACC, OPX, PX, EMU, BT, BK, BE)
                other = _hat(h, mq, qkeep[:, None] & k_ok[None, :], LOG)
                g += _dot(tl.trans(dp), other, OPS, PS, EMU, ACC)
        if SIDE == 0:
            f, ang = _features(FQ, XQ, RQ, W, PH, rows, r_ok, k0, D, E, LD, LE, FEAT, ACC, OPX, PX, EMU, BT, BK, BE)
        else:
            f, ang = _features(FK, XK, RK, W, PH, rows, r_ok, k0, D, E, LD, LE, FEAT, ACC, OPX, PX, EMU, BT, BK, BE)
        if LOG:
            g = g * _hat(f, m_own, ok, LOG)  # d l = d(hat) * hat
        g = tl.where(ok, g, 0.0)
        if FEAT <= 1:
            tl.store(
                DF + bh * R * LD + rows[:, None] * LD + offs_k[None, :], g, mask=r_ok[:, None] & (offs_k < LD)[None, :]
            )
        else:
            if FEAT == 2:
                du = g
                drow += tl.sum(g, 1)
            else:
                if SIDE == 0:
                    row = tl.load(RQ + rows, mask=keep, other=0.0).to(ACC)
                else:
                    row = tl.load(RK + rows, mask=keep, other=0.0).to(ACC)
                du = tl.where(ok, -row[:, None] * tl.sin(ang) * g, 0.0)
                drow += tl.sum(tl.where(ok, tl.cos(ang) * g, 0.0), 1)
            w = tl.load(W + offs_k[:, None] * LE + offs_e[None, :], mask=k_ok[:, None] & e_ok[None, :], other=0.0)
            dx += _dot(du, w, OPS, PS, EMU, ACC)  # [BT, BE]
    if FEAT >= 2:
        tl.store(DX + bh * R * LE + rows[:, None] * LE + offs_e[None, :], dx, mask=r_ok[:, None] & e_ok[None, :])
        tl.store(DROW + bh * R + rows, drow, mask=rows < tl.where(pe == 0, R, 0))


KERNELS = {
    "prep": prep_kernel,
    "state_fwd": state_fwd_kernel,
    "out_fwd": out_fwd_kernel,
    "state_bwd": state_bwd_kernel,
    "bwd_dv": bwd_dv_kernel,
    "bwd_dqk": bwd_dqk_kernel,
}

__all__ = ["FLOOR", "FLOOR_VALUE", "KERNELS", "triton"]
