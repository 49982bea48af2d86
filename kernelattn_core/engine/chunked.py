"""Vectorised chunked causal linear attention with its own backward, and the causal call
around it.

This module owns the one causal recurrence every causal feature-map estimator feeds
(:func:`causal_linear_attention`, optionally with a per-position log-decay) and what a call
runs around it: :func:`prepare_causal` (masks, non-finite quarantine, stabilisers continued
from a :class:`CausalState`) and :func:`finish_causal` (numerator, denominator, the outgoing
state). The torch backend, the grouped engine, decoding steps and sequence parallelism all
call these three.

This module is the kernel of the causal torch backend; the module docstring of
:mod:`kernelattn_core.engine.torch_backend` states the whole recurrence (stabilisers,
forward and backward) and :func:`causal_linear_attention` is its implementation.

Notation (one batch element and head; ``C`` positions per chunk, ``n_c = N / C``
chunks, chunk ``c`` holds positions :math:`[cC, (c+1)C)`):

* :math:`q_t \\in \\mathbb{R}^D` query features, :math:`k_j \\in \\mathbb{R}^D` key
  features stated at the key's own stabiliser (:math:`k_j = e^{l_{k,j} - m_j}` in log
  space), :math:`v_j \\in \\mathbb{R}^{d_v}` values (the engine appends a column of
  ones so that the normaliser is the last column of the numerator);
* :math:`m_t` a non-decreasing stabiliser (the prefix maximum of the key
  log-features; :math:`m \\equiv 0` for plain features), :math:`M_c = m_{(c+1)C-1}` its
  value at the end of chunk ``c`` and :math:`M_{-1}` the value the initial state is
  stated at;
* :math:`g_{tj} = e^{m_j - m_t} \\le 1` for :math:`j \\le t` (the gate),
  :math:`p_t = e^{M_{c-1} - m_t} \\le 1` and :math:`r_j = e^{m_j - M_c} \\le 1` for
  :math:`t, j` in chunk ``c``, :math:`\\delta_c = e^{M_{c-1} - M_c} \\le 1`.

Forward, all chunks at once except the scan over the :math:`n_c` states:

.. math::
    A^{(c)}_{tj} = [j \\le t]\\, g_{tj}\\, q_t^\\top k_j, \\qquad
    U_c = \\sum_{j \\in c} r_j k_j v_j^\\top, \\qquad
    S_{c+1} = \\delta_c S_c + U_c \\;(S_0 \\text{ given}),

.. math::
    o_t = \\sum_{j \\in c} A^{(c)}_{tj} v_j + p_t\\, S_c^\\top q_t .

:math:`S_c` is :math:`\\sum_{j < cC} e^{m_j - M_{c-1}} k_j v_j^\\top` (every key before
chunk ``c``, restated at :math:`M_{c-1}`); every factor is :math:`\\le 1`, so nothing
overflows, and row ``t`` uses only :math:`m_{\\le t}`: a later key never changes it.

Backward, given :math:`\\bar o_t` and :math:`\\bar S_{n_c}` (the gradient of the final
state; zero unless the state is used), with :math:`P^{(c)}_{tj} = [j \\le t]\\, g_{tj}\\,
\\bar o_t^\\top v_j`:

.. math::
    W_c = \\sum_{t \\in c} p_t q_t \\bar o_t^\\top, \\qquad
    G_{n_c - 1} = \\bar S_{n_c}, \\qquad G_{c} = W_{c+1} + \\delta_{c+1} G_{c+1}
    \\quad (G_c = \\partial L / \\partial S_{c+1}),

.. math::
    \\bar q_t = \\sum_{j \\in c} P_{tj} k_j + p_t S_c \\bar o_t, \\qquad
    \\bar k_j = \\sum_{t \\in c} P_{tj} q_t + r_j G_c v_j, \\qquad
    \\bar v_j = \\sum_{t \\in c} A_{tj} \\bar o_t + r_j G_c^\\top k_j, \\qquad
    \\bar S_0 = W_0 + \\delta_0 G_0 .

**Per-position decay** (``log_decay``, gated linear attention, RFA-Gate): the state is
multiplied by :math:`e^{\\lambda_t}` (:math:`\\lambda_t \\le 0`) before position :math:`t`'s
key is added,

.. math::
    S_t = e^{\\lambda_t}\\, e^{m_{t-1} - m_t}\\, S_{t-1} + k_t v_t^\\top, \\qquad o_t = S_t^\\top q_t,

so pair :math:`(t, j)` carries :math:`e^{\\Lambda_t - \\Lambda_j + m_j - m_t}`,
:math:`\\Lambda_t = \\sum_{i \\le t} \\lambda_i`. The decay is a stabiliser: with
:math:`\\mu_t = m_t - \\Lambda^{(c)}_t` (:math:`\\Lambda^{(c)}` cumulated from the start of
chunk ``c`` only, so the exponents stay small however long the sequence) every formula
above holds with :math:`m_t \\to \\mu_t` inside the chunk and :math:`M_c \\to M_c -
\\Lambda^{(c)}_{\\text{end}}` at its end, :math:`M_{c-1}` unchanged at its start; :math:`\\mu` is
non-decreasing, so :math:`g, p, r, \\delta` stay :math:`\\le 1` (the decay across chunks is
:math:`\\delta_c = e^{M_{c-1} - M_c + \\Lambda^{(c)}_{\\text{end}}}`, applied in the scan).
Its gradient needs no new recurrence: every :math:`\\Lambda_t` enters as
:math:`+\\Lambda_t` through row :math:`t` and :math:`-\\Lambda_t` through key :math:`t`
(and :math:`+\\Lambda_{N-1}` through the final state), so

.. math::
    \\frac{\\partial L}{\\partial \\Lambda_t} = \\bar o_t^\\top o_t - k_t^\\top \\bar k_t
    + [t = N - 1]\\, \\langle S_N, \\bar S_N \\rangle, \\qquad
    \\bar\\lambda_i = \\sum_{t \\ge i} \\frac{\\partial L}{\\partial \\Lambda_t}

(a reversed cumulative sum; :math:`o_t` is recomputed from the recomputed states).

The states :math:`S_c` are recomputed in the backward pass rather than stored (unless a
caller of :func:`causal_linear_attention_forward` keeps a ``tape`` for a short call), so
training keeps only the inputs: :math:`O(N(D + d_v))` memory plus
:math:`O(N C + n_c D d_v)` transient work space.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InputError
from ..validation import finite_rows

_HALF = (torch.float16, torch.bfloat16)

#: chunk length used when the caller passes ``chunk_size=None`` and the values are wider
#: than 32 (see :func:`default_chunk`); chosen by measurement (PRF log-features, D = 128,
#: d_v = 64, N = 4096, one thread, forward and forward + backward interleaved on a shared
#: 2-core CPU: 32 and 64 within noise of each other, 128 slower by 15-30 %;
#: ``tests/benchmarks`` re-measures it).
DEFAULT_CHUNK = 64

#: chunk length for values of width 32 or less (:func:`default_chunk`)
NARROW_CHUNK = 32


def default_chunk(value_width: int) -> int:
    """The chunk length of a call that passes ``chunk_size=None``, for values of width
    ``value_width`` (:math:`d_v`, before the normaliser's column of ones).

    A chunk of :math:`C` positions costs each position :math:`C (D + d_v)` in its
    in-chunk products and about :math:`2 D d_v` in the chunk states, so narrow values
    want short chunks. Measured (2026-11-27, PRF, forward + backward, 2-core CPU): with
    :math:`d_v = 32` chunks of 32 beat 64 by 9-20 % at :math:`D` = 64 and N = 128-4096
    (tied or better at D = 32-256; one thread, batches of 4K positions), and with
    :math:`d_v = 64` chunks of 64 beat 32 by 2-8 % (D = 128, N = 512-4096; tied at 16K):
    :data:`NARROW_CHUNK` up to :math:`d_v = 32`, :data:`DEFAULT_CHUNK` above. One long
    sequence with two threads (B 1, 4 heads of 32, N 4K and 16K, D 64 and 128): the two
    within 5 % of each other (32 behind by 2-5 % at 4K, D 128).
    """
    return NARROW_CHUNK if value_width <= 32 else DEFAULT_CHUNK


def _gate(mc: torch.Tensor, tri: torch.Tensor, decayed: bool = False) -> torch.Tensor:
    """``[K, C, C]`` gate :math:`[j \\le t]\\, e^{m_j - m_t}` of the log-space form for the
    stabilisers ``mc [K, C]`` of ``K`` chunks.

    Without a decay the arguments go through :func:`exp_nonpositive` (the mask as a factor:
    the stabilisers are finite, and masking with ``-inf`` first sends half the exponentials
    down the CPU's slow path); with one, a gate below the dtype's range must be exactly 0
    (a decay of 0 forgets the keys before it), so it keeps ``-inf`` and ``exp``."""
    gap = mc.unsqueeze(-2) - mc.unsqueeze(-1)  # [K, C(t), C(j)]: m_j - m_t, > 0 only above the diagonal
    if decayed:
        return gap.masked_fill_(~tri, float("-inf")).exp_()  # masked before exp: no inf * 0
    return exp_nonpositive(gap, tri)


class _Gate:
    """The gate of the chunks whose stabiliser moves inside the chunk.

    Where :math:`m` is constant over a chunk, :math:`e^{m_j - m_t} = e^0 = 1` exactly, so
    the gate there *is* the causal mask: only the chunks where :math:`m` moves (a new
    running maximum; few after the first positions) get the exponential, gathered by
    index. The result is bit-identical to gating every chunk, whatever the data.
    """

    def __init__(self, mc: torch.Tensor, tri: torch.Tensor, decayed: bool = False) -> None:
        flat = mc.flatten(0, -2)  # [B * H * n_c, C]
        self.idx = (flat[:, 0] != flat[:, -1]).nonzero().squeeze(-1)  # m is non-decreasing
        self.full = self.idx.numel() == flat.shape[0]  # every chunk moves (a decay): no gather
        if self.full:
            self.gate = _gate(flat, tri, decayed)
        else:
            self.gate = _gate(flat.index_select(0, self.idx), tri, decayed) if self.idx.numel() else None

    def apply_(self, x: torch.Tensor, tri: torch.Tensor) -> torch.Tensor:
        """``x [.., C, C]`` times the gate, in place."""
        x.masked_fill_(~tri, 0.0)
        if self.full:
            return x.mul_(self.gate.view(x.shape))  # type: ignore[union-attr]
        if self.gate is not None:
            flat = x.view(-1, *x.shape[-2:])
            flat.index_copy_(0, self.idx, flat.index_select(0, self.idx).mul_(self.gate))
        return x


def _scan(u: torch.Tensor, decay: torch.Tensor | None, s0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """States before each chunk ``[B, H, n_c, D, dv]`` and the final state ``[B, H, D, dv]``."""
    if decay is None:  # plain features: a cumulative sum
        inclusive = u.cumsum_(2).add_(s0.unsqueeze(2))
        return torch.cat([s0.unsqueeze(2), inclusive[:, :, :-1]], dim=2), inclusive[:, :, -1].clone()
    states = torch.empty_like(u)  # every chunk is written below
    n_c = u.shape[2]
    states[:, :, 0] = s0
    for c in range(n_c - 1):  # n_c small updates written in place, no autograd inside
        torch.addcmul(u[:, :, c], states[:, :, c], decay[:, :, c, None, None], out=states[:, :, c + 1])
    return states, torch.addcmul(u[:, :, -1], states[:, :, -1], decay[:, :, -1, None, None])


def _reverse_scan(
    w: torch.Tensor, decay: torch.Tensor | None, s_bar: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``G [B, H, n_c, D, dv]`` (gradient of each chunk's outgoing state) and the gradient
    of the initial state."""
    if decay is None:
        tail = w.flip(2).cumsum(2).flip(2)  # tail[c] = sum_{c' >= c} W_c'
        g = torch.cat([tail[:, :, 1:], torch.zeros_like(tail[:, :, :1])], dim=2).add_(s_bar.unsqueeze(2))
        return g, tail[:, :, 0] + s_bar
    g = torch.empty_like(w)  # every chunk is written below
    g[:, :, -1] = s_bar
    for c in range(w.shape[2] - 1, 0, -1):  # G_{c-1} = W_c + delta_c G_c, written in place
        torch.addcmul(w[:, :, c], g[:, :, c], decay[:, :, c, None, None], out=g[:, :, c - 1])
    return g, torch.addcmul(w[:, :, 0], g[:, :, 0], decay[:, :, 0, None, None])  # dL/dS_0


def _stabilisers(
    m: torch.Tensor | None, m0: torch.Tensor | None, log_decay: torch.Tensor | None, n_c: int, c: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``mu [B,H,n_c,C]``, ``p [B,H,n_c,C]``, ``r [B,H,n_c,C]``, ``delta [B,H,n_c]`` (None for
    plain features without a decay).

    With a decay, ``mu`` is the stabiliser less the cumulative log-decay *within the chunk*
    (:math:`\\mu_t = m_t - \\Lambda^{(c)}_t`, non-decreasing), and the chunk's end is
    :math:`M_c - \\Lambda^{(c)}_{\text{end}}`: every factor stays :math:`e^{\\le 0}`."""
    if m is None and log_decay is None:
        return None, None, None, None
    if m is None:  # plain features with a decay: m = 0 throughout
        shape = (*log_decay.shape[:-1], n_c)  # type: ignore[union-attr]
        mc = log_decay.new_zeros(*shape, c)  # type: ignore[union-attr]
        m_end = m_prev = log_decay.new_zeros(shape)  # type: ignore[union-attr]
    else:
        mc = m.unflatten(-1, (n_c, c))
        m_end = mc[..., -1]  # [B, H, n_c]: M_c
        m_prev = torch.cat([m0, m_end[..., :-1]], dim=-1)  # type: ignore[list-item]  # [B, H, n_c]: M_{c-1}
    if log_decay is not None:
        lam = log_decay.unflatten(-1, (n_c, c)).cumsum(-1)  # [B, H, n_c, C]: Lambda within the chunk
        mc = mc - lam
        m_end = m_end - lam[..., -1]
    p = (m_prev.unsqueeze(-1) - mc).exp()
    r = (mc - m_end.unsqueeze(-1)).exp()
    return mc, p, r, (m_prev - m_end).exp()


#: positions per group of the core: chunks are processed in groups of this many positions
#: so that the transient work space (``C x C`` blocks, chunk states) stays bounded in
#: ``N``. Matters for direct callers of :func:`causal_linear_attention` (decoding, sequence
#: parallelism); the torch backend's grouped engine (:mod:`kernelattn_core.engine.grouped`)
#: hands the core one group of its own (at most a few thousand positions) at a time.
#: Slicing a group out of ``[B, H, N, D]`` makes the batched products copy their
#: operands, so groups are large (forward 25 % faster than groups of 1024 at N = 4096).
GROUP = 4096


class _Block:
    """The per-chunk pieces of one group of chunks (positions ``[g0, g1)``)."""

    def __init__(self, q, k, v, s_in, m, m_in, log_decay, chunk, tri):  # type: ignore[no-untyped-def]
        b, h, n, d_feat = q.shape
        dv = v.shape[-1]
        n_c = n // chunk
        self.decayed = log_decay is not None
        mc, self.p, self.r, self.decay = _stabilisers(m, m_in, log_decay, n_c, chunk)
        self.qc = q.view(b, h, n_c, chunk, d_feat)
        self.kc = k.view(b, h, n_c, chunk, d_feat)
        self.vc = v.view(b, h, n_c, chunk, dv)
        self.tri = tri
        self.gate = None if mc is None else _Gate(mc, tri, self.decayed)
        self.a: torch.Tensor | None = None  # the gated products, when a tape holds the block
        vr = self.vc if self.r is None else self.vc * self.r.unsqueeze(-1)  # keys restated at chunk end
        self.states, self.s_out = _scan(self.kc.transpose(-1, -2) @ vr, self.decay, s_in)

    def masked(self, x: torch.Tensor) -> torch.Tensor:
        """``x [.., C, C]`` times the gate (or the causal mask), in place."""
        return x.masked_fill_(~self.tri, 0.0) if self.gate is None else self.gate.apply_(x, self.tri)

    def forward(self, keep: bool = False) -> torch.Tensor:
        """The group's rows; ``keep``: hold the gated ``[.., C, C]`` products for
        :meth:`backward` (a tape), which then does not recompute them."""
        a = self.masked(self.qc @ self.kc.transpose(-1, -2))  # [B, H, n_c, C, C]
        self.a = a if keep else None
        inter = self.qc @ self.states  # [B, H, n_c, C, dv]
        if self.p is not None:
            inter.mul_(self.p.unsqueeze(-1))
        return torch.baddbmm(inter.flatten(0, 2), a.flatten(0, 2), self.vc.flatten(0, 2))

    def backward(self, o_bar: torch.Tensor, g_out: torch.Tensor):  # type: ignore[no-untyped-def]
        qc, kc, vc, p, r = self.qc, self.kc, self.vc, self.p, self.r
        oc = o_bar.reshape(vc.shape)
        a = self.a if self.a is not None else self.masked(qc @ kc.transpose(-1, -2))
        pm = self.masked(oc @ vc.transpose(-1, -2))  # [B, H, n_c, C, C]
        q_inter = oc @ self.states.transpose(-1, -2)  # [B, H, n_c, C, D]
        if p is not None:
            q_inter.mul_(p.unsqueeze(-1))
        q_bar = torch.baddbmm(q_inter.flatten(0, 2), pm.flatten(0, 2), kc.flatten(0, 2))
        qp = qc if p is None else qc * p.unsqueeze(-1)
        g, g_in = _reverse_scan(qp.transpose(-1, -2) @ oc, self.decay, g_out)  # [B, H, n_c, D, dv]
        k_inter = vc @ g.transpose(-1, -2)  # [B, H, n_c, C, D]
        if r is not None:
            k_inter.mul_(r.unsqueeze(-1))
        k_bar = torch.baddbmm(k_inter.flatten(0, 2), pm.transpose(-1, -2).flatten(0, 2), qc.flatten(0, 2))
        v_inter = kc @ g  # [B, H, n_c, C, dv]
        if r is not None:
            v_inter.mul_(r.unsqueeze(-1))
        v_bar = torch.baddbmm(v_inter.flatten(0, 2), a.transpose(-1, -2).flatten(0, 2), oc.flatten(0, 2))
        return q_bar, k_bar, v_bar, g_in

    def decay_bar(self, o_bar: torch.Tensor, out: torch.Tensor, k_bar: torch.Tensor) -> torch.Tensor:
        """``[B H n_c, C]``: :math:`\\partial L / \\partial \\Lambda_t = \bar o_t^\top o_t - k_t^\top \bar k_t`
        (after :meth:`backward`, whose ``k_bar`` it takes; ``out`` is the forward pass's output
        of the group's rows, saved rather than recomputed)."""
        oc = o_bar.reshape(self.kc.shape[:-1] + o_bar.shape[-1:])
        # a row nobody reads gives 0, even if it overflowed
        seen = (out.reshape(oc.shape) * oc).masked_fill_(oc == 0, 0.0)
        return seen.sum(-1).flatten(0, 2) - (k_bar * self.kc.flatten(0, 2)).sum(-1)


def _groups(n: int, chunk: int) -> list[tuple[int, int]]:
    span = max(chunk, GROUP // chunk * chunk)
    return [(g0, min(g0 + span, n)) for g0 in range(0, n, span)]


def _m_in(m: torch.Tensor | None, m0: torch.Tensor | None, g0: int) -> torch.Tensor | None:
    return m0 if m is None or g0 == 0 else m[..., g0 - 1 : g0]


def _part(m: torch.Tensor | None, g0: int, g1: int) -> torch.Tensor | None:
    return None if m is None else m[..., g0:g1]


def _rows(x: torch.Tensor, g0: int, g1: int) -> torch.Tensor:
    """Positions ``[g0, g1)`` of ``x [B, H, N, .]``, contiguous: a strided slice would be
    copied again by every batched product of the block (five to eight times per group)."""
    part = x[:, :, g0:g1]
    return part if g1 - g0 == x.shape[2] else part.contiguous()


def _block(q, k, v, s_in, m, m0, ld, g0, g1, chunk, tri) -> _Block:  # type: ignore[no-untyped-def]
    """The :class:`_Block` of positions ``[g0, g1)`` entering with state ``s_in``."""
    return _Block(
        _rows(q, g0, g1),
        _rows(k, g0, g1),
        _rows(v, g0, g1),
        s_in,
        _part(m, g0, g1),
        _m_in(m, m0, g0),
        _part(ld, g0, g1),
        chunk,
        tri,
    )


def _tri(chunk: int, device: torch.device) -> torch.Tensor:
    return torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()


def _core_forward(q, k, v, s0, m, m0, ld, chunk, tape=None):  # type: ignore[no-untyped-def]
    """Output, final state and the state entering each group (inputs padded to ``chunk``);
    ``tape`` (a list): the groups' blocks are appended to it, their gated products kept."""
    b, h, n, _ = q.shape
    tri = _tri(chunk, q.device)
    groups = _groups(n, chunk)
    out = None if len(groups) == 1 else q.new_empty(b, h, n, v.shape[-1])  # every group writes its rows
    s_in, cur = [], s0
    for g0, g1 in groups:  # groups bound the work space; no autograd records this loop
        s_in.append(cur)
        blk = _block(q, k, v, cur, m, m0, ld, g0, g1, chunk, tri)
        rows = blk.forward(keep=tape is not None).view(b, h, g1 - g0, -1)
        if out is None:  # one group: its rows are the output (no copy)
            out = rows
        else:
            out[:, :, g0:g1] = rows
        cur = blk.s_out
        if tape is not None:
            tape.append(blk)
        del blk  # free this group's work space before the next one (unless a tape holds it)
    return out, cur, s_in


def _core_backward(q, k, v, m, m0, ld, s_in, chunk, o_bar, s_bar, out=None, tape=None):  # type: ignore[no-untyped-def]
    """Gradients of ``q, k, v``, of the initial state and of ``ld`` (``None`` without a
    decay, which needs the forward pass's ``out``; inputs padded to ``chunk``). ``tape``:
    the blocks :func:`_core_forward` kept, used instead of being rebuilt."""
    b, h, n, d_feat = q.shape
    tri = _tri(chunk, q.device)
    groups = _groups(n, chunk)
    one = len(groups) == 1  # one group: its gradients are the result (no copy)
    q_bar, k_bar, v_bar = (None, None, None) if one else (torch.empty_like(t) for t in (q, k, v))  # groups tile [0, N)
    big_bar = None if ld is None else torch.empty_like(ld)  # dL/dLambda_t (Lambda = cumsum ld)
    end_term = None
    g_out = torch.zeros_like(s_in[0]) if s_bar is None else s_bar
    for i in range(len(groups) - 1, -1, -1):  # last group first: G runs backwards
        g0, g1 = groups[i]
        blk = tape[i] if tape is not None else _block(q, k, v, s_in[i], m, m0, ld, g0, g1, chunk, tri)
        if big_bar is not None and s_bar is not None and i == len(groups) - 1:
            end_term = (blk.s_out * s_bar).sum((-2, -1))  # <S_final, S_bar>: through Lambda_end
        ob = _rows(o_bar, g0, g1)
        dq, dk, dv_, g_out = blk.backward(ob, g_out)
        if big_bar is not None:
            big_bar[:, :, g0:g1] = blk.decay_bar(ob, _rows(out, g0, g1), dk).view(b, h, g1 - g0)
        dq, dk, dv_ = dq.view(b, h, g1 - g0, d_feat), dk.view(b, h, g1 - g0, d_feat), dv_.view(b, h, g1 - g0, -1)
        if one:
            q_bar, k_bar, v_bar = dq, dk, dv_
        else:
            q_bar[:, :, g0:g1], k_bar[:, :, g0:g1], v_bar[:, :, g0:g1] = dq, dk, dv_  # type: ignore[index]
        del blk, dq, dk, dv_
    ld_bar = None
    if big_bar is not None:  # ld_i reaches every Lambda_t with t >= i: a reversed cumulative sum
        ld_bar = big_bar.flip(-1).cumsum(-1).flip(-1)
        if end_term is not None:
            ld_bar.add_(end_term.unsqueeze(-1))
    return q_bar, k_bar, v_bar, g_out, ld_bar


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Autocast off on ``device`` (a no-op context for a device type autocast does not
    know): the engines compute in their inputs' dtype (the caller's :func:`compute_dtype`,
    float32 for half inputs) whatever the autocast state, in the forward pass and in the
    backward pass's recomputation alike (under autocast the forward's products would be
    bfloat16 and the backward's float32)."""
    try:
        return torch.autocast(device.type, enabled=False)
    except RuntimeError:  # pragma: no cover - a device type autocast does not know
        return contextlib.nullcontext()


class _CausalLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, s0, m, m0, ld, chunk, tape=None):  # type: ignore[no-untyped-def, override]
        with autocast_off(q.device):
            out, cur, s_in = _core_forward(q, k, v, s0, m, m0, ld, chunk, tape)
        # group boundary states only; with a decay also the output (the decay's gradient
        # reads o_t: saving it, O(N dv), spares the backward pass a second forward product)
        ctx.save_for_backward(q, k, v, m, m0, ld, out if ld is not None else None, *s_in)
        ctx.chunk = chunk
        return out, cur

    @staticmethod
    def backward(ctx, o_bar, s_bar):  # type: ignore[no-untyped-def, override]
        q, k, v, m, m0, ld, out, *s_in = ctx.saved_tensors
        # the incoming gradients in the dtype the forward pass computed in (q's): a loss
        # under autocast, or an output cast to bfloat16 on its way out, hands back a
        # gradient of another dtype, which the products below would refuse
        o_bar = o_bar.to(q.dtype)
        s_bar = None if s_bar is None else s_bar.to(q.dtype)
        with autocast_off(q.device):
            q_bar, k_bar, v_bar, s0_bar, ld_bar = _core_backward(q, k, v, m, m0, ld, s_in, ctx.chunk, o_bar, s_bar, out)
        if ld_bar is not None and not ctx.needs_input_grad[6]:
            ld_bar = None
        return q_bar, k_bar, v_bar, s0_bar, None, None, ld_bar, None, None


def _padded(q, k, v, m, ld, chunk):  # type: ignore[no-untyped-def]
    """Inputs padded to a multiple of ``chunk``: zero features after the end contribute
    nothing, ``m`` is continued flat and the log-decay with 0 (no decay)."""
    extra = -q.shape[-2] % chunk
    if extra:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, extra)) for t in (q, k, v))
        if m is not None:
            m = torch.cat([m, m[..., -1:].expand(*m.shape[:-1], extra)], dim=-1)
        if ld is not None:
            ld = torch.nn.functional.pad(ld, (0, extra))
    return q, k, v, m, ld, extra


def _checked_decay(log_decay: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """``log_decay`` ``[B, H, N]`` (finite, ``<= 0``) as ``q``'s dtype, or an :class:`InputError`."""
    if log_decay is None:
        return None
    if not isinstance(log_decay, torch.Tensor):
        raise InputError(f"log_decay: expected a Tensor [B, H, N] or None, got {type(log_decay).__name__}")
    want = tuple(q.shape[:-1])
    if tuple(log_decay.shape) != want:
        raise InputError(f"log_decay: expected shape {want} (B, H, N of q), got {tuple(log_decay.shape)}")
    if not log_decay.is_floating_point():
        raise InputError(f"log_decay: expected a floating-point tensor, got {log_decay.dtype}")
    if not bool((log_decay.detach() <= 0).all()) or not bool(torch.isfinite(log_decay.detach()).all()):
        bad = log_decay.detach()[~((log_decay.detach() <= 0) & torch.isfinite(log_decay.detach()))]
        raise InputError(
            f"log_decay: expected finite values <= 0 (the log of a decay in (0, 1]), got {bad.flatten()[0].item()!r}"
        )
    # a log-decay below the dtype's exponent range is a decay of exactly 0 (e^-800 in float64,
    # e^-120 in float32 are 0): raise it to that floor, which changes no value and no
    # gradient (both carry the factor e^lambda = 0), so that the cumulated exponents stay
    # where the small log-decays beside it are not absorbed (-1e308 + -0.7 == -1e308)
    floor = -800.0 if q.dtype == torch.float64 else -120.0
    return log_decay.to(q.dtype).clamp_min(floor).contiguous()


def _traced(q, k, v, s0, m, m0, ld, chunk):  # type: ignore[no-untyped-def]
    """:func:`causal_linear_attention` for ``torch.compile``: the same factors, no
    data-dependent branch (every chunk gated, no ``nonzero``), differentiated by autograd;
    the states from one ``[n_c, n_c]`` matrix of chunk-to-chunk decays,
    :math:`S_c = \\sum_{c' < c} e^{C_{c-1} - C_{c'}} U_{c'} + e^{C_{c-1}} S_0` with
    :math:`C_c = \\sum_{c'' \\le c} \\log \\delta_{c''}` (no loop at all)."""
    n = q.shape[-2]
    chunk = max(1, min(chunk, n))
    q, k, v, m, ld, extra = _padded(q, k, v, m, ld, chunk)
    b, h, length, _ = q.shape
    nc = length // chunk
    tri = _tri(chunk, q.device)
    qc, kc, vc = (t.unflatten(2, (nc, chunk)) for t in (q, k, v))
    a = qc @ kc.transpose(-1, -2)  # [B, H, nc, C, C]
    if m is None and ld is None:
        a, p, r = a.masked_fill(~tri, 0.0), None, None
        log_delta = q.new_zeros(b, h, nc)
    else:
        if m is None:
            mc = ld.new_zeros(b, h, nc, chunk)
            m_end = m_prev = ld.new_zeros(b, h, nc)
        else:
            mc = m.unflatten(-1, (nc, chunk))
            m_end = mc[..., -1]
            m_prev = torch.cat([m0, m_end[..., :-1]], dim=-1)
        if ld is not None:
            lam = ld.unflatten(-1, (nc, chunk)).cumsum(-1)
            mc, m_end = mc - lam, m_end - lam[..., -1]
        a = a * (mc.unsqueeze(-2) - mc.unsqueeze(-1)).masked_fill(~tri, float("-inf")).exp()
        p = (m_prev.unsqueeze(-1) - mc).exp()
        r = (mc - m_end.unsqueeze(-1)).exp()
        log_delta = m_prev - m_end  # [B, H, nc], <= 0
    u = (kc if r is None else kc * r.unsqueeze(-1)).transpose(-1, -2) @ vc  # [B, H, nc, D, dv]
    cum = log_delta.cumsum(-1)  # C_c
    before = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], dim=-1)  # C_{c-1}
    strict = torch.ones(nc, nc, dtype=torch.bool, device=q.device).tril(-1)
    gamma = (before.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~strict, float("-inf")).exp()  # [.., c, c']
    states = (gamma @ u.flatten(-2)).unflatten(-1, u.shape[-2:]) + before.exp()[..., None, None] * s0.unsqueeze(2)
    inter = qc @ states
    if p is not None:
        inter = inter * p.unsqueeze(-1)
    out = (a @ vc + inter).flatten(2, 3)
    s_final = log_delta[..., -1].exp()[..., None, None] * states[:, :, -1] + u[:, :, -1]
    return (out[..., :n, :] if extra else out), s_final


def causal_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s0: torch.Tensor,
    m: torch.Tensor | None,
    m0: torch.Tensor | None,
    chunk: int,
    log_decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal linear attention of finite, prepared inputs (see the module docstring),
    optionally with a per-position decay.

    .. math::
        S_t = e^{\\lambda_t}\\, e^{m_{t-1} - m_t}\\, S_{t-1} + k_t v_t^\top, \\qquad
        o_t = S_t^\top q_t \\qquad (S_{-1} = s_0,\\ m_{-1} = m_0),

    that is :math:`o_t = \\sum_{j \\le t} e^{\\Lambda_t - \\Lambda_j + m_j - m_t}\\, q_t^\top k_j\\, v_j
    + e^{\\Lambda_t + m_0 - m_t}\\, s_0^\top q_t` with :math:`\\Lambda_t = \\sum_{i \\le t} \\lambda_i`.

    Parameters
    ----------
    q : Tensor ``[B, H, N, D]``
        Query features (already multiplied by any per-query constant).
    k : Tensor ``[B, H, N, D]``
        Key features :math:`e^{l_{k,j} - m_j}` (log space) or plain features; masked
        keys already zero.
    v : Tensor ``[B, H, N, dv]``
        Values (masked ones already zero); the engine appends a column of ones.
    s0 : Tensor ``[B, H, D, dv]``
        State of the earlier positions, stated at ``m0``.
    m : Tensor ``[B, H, N]`` or None
        Non-decreasing stabiliser (detached), ``None`` for plain features.
    m0 : Tensor ``[B, H, 1]`` or None
        Stabiliser of ``s0`` (``<= m``).
    chunk : int
        Positions per chunk; ``N`` is padded up to a multiple.
    log_decay : Tensor ``[B, H, N]`` or None
        :math:`\\lambda_t \\le 0`, finite: the state is multiplied by :math:`e^{\\lambda_t}`
        before position ``t``'s key is added (gated linear attention, RFA-Gate's
        :math:`\\log g_t`); ``None``: no decay. Differentiable. Values below ``-800``
        (float64) or ``-120`` (other dtypes), whose exponential is 0 in the dtype, are
        raised to that floor (same value, same zero gradient; cumulated exponents then
        keep the small decays beside them).

    Returns
    -------
    out : Tensor ``[B, H, N, dv]``
    s_final : Tensor ``[B, H, D, dv]``, stated at ``m[..., -1]``.
    Both are differentiable in ``q``, ``k``, ``v``, ``s0`` and ``log_decay``. Eagerly the
    forward and backward passes compute in ``q``'s dtype with autocast off (the caller
    casts half inputs to :func:`compute_dtype`); gradients of another dtype (a loss under
    autocast) are cast to it.

    Raises
    ------
    InputError
        ``log_decay`` of another shape than ``q``'s ``[B, H, N]``, positive or not finite.
    """
    if torch.compiler.is_compiling():  # one graph: no value checks read back, autograd's backward
        return _traced(q, k, v, s0, m, m0, log_decay, chunk)
    return _causal_linear(q, k, v, s0, m, m0, chunk, log_decay, None)


def _causal_linear(q, k, v, s0, m, m0, chunk, log_decay, tape):  # type: ignore[no-untyped-def]
    """:func:`causal_linear_attention` (eager), its blocks appended to ``tape`` when given."""
    log_decay = _checked_decay(log_decay, q)
    n = q.shape[-2]
    chunk = max(1, min(chunk, n))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # chunks are views (no copy when already)
    q, k, v, m, log_decay, extra = _padded(q, k, v, m, log_decay, chunk)
    out, s_final = _CausalLinear.apply(q, k, v, s0, m, m0, log_decay, chunk, tape)
    return (out[..., :n, :] if extra else out), s_final


def causal_linear_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s0: torch.Tensor,
    m: torch.Tensor | None,
    m0: torch.Tensor | None,
    chunk: int,
    log_decay: torch.Tensor | None = None,
    *,
    tape: list[Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_linear_attention` without autograd (no graph is recorded, even when
    an input requires a gradient): for callers that write their own backward with
    :func:`causal_linear_attention_backward`.

    ``tape`` (an empty list, no ``log_decay``): the forward pass's per-group work (states,
    gate, gated products) is appended to it and kept, for the backward pass to reuse
    instead of recomputing it; it holds about three ``[B, H, N, max(C, D)]`` blocks, so
    it suits a call the caller keeps short (the grouped engine's one-group calls).
    """
    if tape is not None and log_decay is not None:
        raise InputError("tape: the forward tape is kept for calls without log_decay only")
    with torch.no_grad():
        if tape is None or torch.compiler.is_compiling():
            return causal_linear_attention(q, k, v, s0, m, m0, chunk, log_decay)
        return _causal_linear(q, k, v, s0, m, m0, chunk, None, tape)


def causal_linear_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s0: torch.Tensor,
    m: torch.Tensor | None,
    m0: torch.Tensor | None,
    chunk: int,
    o_bar: torch.Tensor,
    s_bar: torch.Tensor | None,
    *,
    tape: list[Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`causal_linear_attention` (without a decay) without autograd:
    the transposed recurrence of the module docstring, the states recomputed.

    For callers that write their own backward around the core (the grouped engine,
    :mod:`kernelattn_core.engine.grouped`, which recomputes the features per group).

    Parameters
    ----------
    q, k, v, s0, m, m0, chunk
        As in :func:`causal_linear_attention` (detached).
    o_bar : Tensor ``[B, H, N, dv]``
        Gradient of the output.
    s_bar : Tensor ``[B, H, D, dv]`` or None
        Gradient of the final state (``None``: zero).
    tape : list, optional
        The tape :func:`causal_linear_attention_forward` filled for these inputs: its
        blocks are used instead of rebuilt (same gradients, bit for bit).

    Returns
    -------
    q_bar, k_bar, v_bar : the gradients of ``q``, ``k``, ``v``
    s0_bar : the gradient of ``s0``
    """
    n = q.shape[-2]
    chunk = max(1, min(chunk, n))
    q, k, v, m, _, extra = _padded(q, k, v, m, None, chunk)
    if extra:
        o_bar = torch.nn.functional.pad(o_bar, (0, 0, 0, extra))
    groups = _groups(q.shape[-2], chunk)
    s_in, cur = [s0], s0
    if tape is not None:
        if len(tape) != len(groups):
            raise InputError(
                f"tape: expected the {len(groups)} blocks of a forward pass on these inputs, got {len(tape)}"
            )
    elif len(groups) > 1:  # the states entering the later groups: forward scans only
        tri = _tri(chunk, q.device)
        for g0, g1 in groups[:-1]:
            cur = _block(q, k, v, cur, m, m0, None, g0, g1, chunk, tri).s_out
            s_in.append(cur)
    q_bar, k_bar, v_bar, s0_bar, _ = _core_backward(
        q, k, v, m, m0, None, s_in, chunk, o_bar.contiguous(), s_bar, tape=tape
    )
    if extra:
        q_bar, k_bar, v_bar = (t[..., :n, :] for t in (q_bar, k_bar, v_bar))
    return q_bar, k_bar, v_bar, s0_bar


# ---------------------------------------------------------------- the causal call around the core
# What every causal feature-map estimator's call runs around the recurrence (the torch
# backend's one-shot form, the grouped engine, decoding steps, sequence parallelism):
# masks, non-finite quarantine and stabilisers in, numerator / denominator and the outgoing
# state out.


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, else the dtype itself."""
    return torch.float32 if dtype in _HALF else dtype


def _exp_floor(dtype: torch.dtype) -> int:
    r""":math:`\lceil \log t \rceil`, :math:`t` the smallest normal number of ``dtype``
    (float32: -87, float64: -708): the lowest argument torch's CPU exp takes on its fast
    path, where :func:`exp_nonpositive` and :func:`exp_kept` raise lower ones."""
    return math.ceil(math.log(torch.finfo(dtype).tiny))


def exp_nonpositive(x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """:math:`e^x` of a stabilised argument :math:`x \\le 0`, times ``keep`` (a mask: 0
    where the term is absent), every argument first clamped to :math:`[\\lceil \\log t
    \\rceil, 0]`, :math:`t` the dtype's smallest normal number (float32: -87, float64: -708).

    Why: on x86 CPUs torch's vectorised ``exp`` leaves its fast path for a vector holding
    an argument below :math:`\\log t` or ``-inf`` (measured 2026-11-26, one thread, 1M
    float32 values: 0.35 ms in range, 4.2 ms all ``-inf``, 17-40 ms below -88), and
    stabilised attention meets such arguments all the time (pairs masked with ``-inf``,
    stabilisers far apart).

    What it changes: a term below :math:`t` (float32: 1.2e-38) becomes :math:`t`, in sums
    whose largest term is :math:`e^0` times a bounded factor, so far below their rounding;
    ``keep`` zeroes absent terms exactly *when they are finite* (``0 * nan`` is ``nan``:
    masks over values that may be NaN stay ``masked_fill``); an argument above 0 (a masked
    pair whose difference is positive) gives 1 before ``keep``, never an overflow. Where a
    term must be exactly 0 below the range (a decay of 0), keep ``-inf`` and ``exp``.
    Gradients flow for arguments in range (clamp passes its bounds), none below.
    """
    out = x.clamp(_exp_floor(x.dtype), 0.0).exp()
    return out if keep is None else out * keep


class _ExpKept(torch.autograd.Function):
    r""":func:`exp_kept`: forward in place, backward :math:`\bar x = \bar y\, y`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        y = x.clamp_(min=_exp_floor(x.dtype)).exp_()
        if keep is not None:
            y = y.masked_fill_(keep == 0, 0.0)
        ctx.mark_dirty(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return grad * y, None


def exp_kept(x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    r""":math:`e^x` of a fresh stabilised argument (usually :math:`\le 0` where kept), exactly 0
    where ``keep`` (bool, or 0/1; broadcast to ``x``) is False or 0 *whatever* ``x`` holds
    there (``-inf``, NaN), computed in place in ``x``; differentiable with exp's
    derivative, :math:`\bar x = \bar y\, e^x`.

    :func:`exp_nonpositive` for arguments under autograd: arguments below the dtype's
    normal range are raised to its edge the same way (torch's CPU exp leaves its fast
    path at ``-inf`` and far below 0), but the clamp's own backward, which costs more
    than that slow path, is left out: exp's derivative is its output, 0 where a term is
    absent and the dtype's smallest normal number where the argument lay below it.
    Outputs and gradients are bit-identical to ``x.masked_fill(~keep, -inf).exp()`` for
    every kept argument from the edge up (above 0, ``inf`` and NaN included: nothing
    non-finite is hidden); measured 2026-11-27 on a causal window's ``[N, N]`` logits
    (float32, most of them masked, one thread): 2.4x faster forward, 2x faster backward.

    ``x`` must be a temporary of the caller's (it is overwritten and marked modified).
    Under ``torch.compile`` the same arithmetic runs out of place through autograd (the
    compiler fuses it; Dynamo does not trace an in-place autograd function).
    """
    if torch.compiler.is_compiling():
        y = x.clamp(min=_exp_floor(x.dtype)).exp()
        return y if keep is None else y.masked_fill(keep == 0, 0.0)
    return _ExpKept.apply(x, keep)


def query_side(phi_q: torch.Tensor, log_space: bool, top: torch.Tensor | None = None) -> torch.Tensor:
    """Query features for the products: ``phi_q`` itself, or for log-space maps
    :math:`e^{l_q - \\max_D l_q}` (a per-query constant that cancels in the ratio; a row
    of ``-inf`` gives zero features). ``top [B, H, N]``: the row maxima, when known."""
    if not log_space:
        return phi_q
    if top is None:
        top = phi_q.detach().amax(-1)  # per-query constant: cancels
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).unsqueeze(-1)  # a row of -inf: features 0
    return (phi_q - top).exp_()


def prefix_stabiliser(top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m_raw, m)`` from the key rows' maxima ``top [B, H, N]`` (``-inf`` for a dropped
    key): ``m_raw`` the prefix maximum (causal; ``-inf`` before the first key), ``m`` the
    same with the positions before the first valid key given the first finite value
    (their rows are exactly zero whatever ``m`` is, and ``m`` stays non-decreasing; 0 when
    no key is valid). Tensor operations only: the eager call and the compile form share it."""
    if top.shape[-1] == 0:  # no key (a decoding step of no new position)
        return top, top
    m_raw = top.cummax(-1).values
    finite = torch.isfinite(m_raw)
    first = torch.where(finite, m_raw, torch.full_like(m_raw, float("inf"))).amin(-1, keepdim=True)
    first = torch.where(torch.isfinite(first), first, torch.zeros_like(first))
    return m_raw, torch.where(finite, m_raw, first)


def _bad_rows(x: torch.Tensor, log_space: bool) -> torch.Tensor:
    """``[B, H, N]``: rows holding NaN or inf (``-inf`` is a valid log-feature: feature 0)."""
    if log_space:
        return (torch.isnan(x) | torch.isposinf(x)).any(-1)
    return ~finite_rows(x)


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
    owner : StateOwner, optional
        The estimator, options, batch, heads and widths that made it (set by ``step``).

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
    #: who made the state (:class:`~kernelattn_core.interfaces.state.StateOwner`), set by
    #: an estimator's ``step``, which refuses a state of another owner; ``None`` for a
    #: state made by the engine's functions directly
    owner: Any = None


@dataclass
class CausalInputs:
    """What the causal core consumes, prepared from one call's features
    (:func:`prepare_causal`), and what the call's end needs.

    Attributes
    ----------
    fq, fk : Tensor ``[B, H, N, D]``
        Query features at their per-row constant, key features at the prefix stabiliser
        (log space) or as given; dropped keys and non-finite query rows are 0.
    v1 : Tensor ``[B, H, N, dv + 1]``
        Values (dropped ones 0) with a column of ones.
    s0 : Tensor ``[B, H, D, dv + 1]``
        The incoming state (zeros without one).
    m, m0 : Tensor ``[B, H, N]``, ``[B, H, 1]`` or None
        The stabiliser and the one ``s0`` is stated at (log space).
    m_out : Tensor ``[B, H, 1]`` or None
        The raw prefix maximum after the last position (``-inf`` while no key was seen),
        for the outgoing state.
    m_raw : Tensor ``[B, H, N]`` or None
        The raw prefix maximum at every position (``-inf`` before the first key), of which
        ``m`` fills the leading ``-inf`` (sequence parallelism restates rows with it).
    poison : Tensor ``[B, H, N]`` of bool or None
        Rows that see a non-finite value (set to NaN at the end).
    carried : Tensor ``[B, H]`` of bool or None
        The outgoing state's ``poisoned`` flag.
    """

    fq: torch.Tensor
    fk: torch.Tensor
    v1: torch.Tensor
    s0: torch.Tensor
    m: torch.Tensor | None
    m0: torch.Tensor | None
    m_out: torch.Tensor | None
    poison: torch.Tensor | None
    carried: torch.Tensor | None
    m_raw: torch.Tensor | None = None


def prepare_causal(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    log_space: bool,
    key_padding_mask: torch.Tensor | None,
    state: CausalState | None,
) -> CausalInputs:
    """The causal core's inputs from features (differentiable in ``phi_q``, ``phi_k``,
    ``v`` and the state): masks applied, non-finite rows quarantined, stabilisers
    continued from ``state`` (see the module docstring)."""
    b, h, n, d_feat = phi_q.shape
    dv = v.shape[-1]
    drop = None if key_padding_mask is None else key_padding_mask[:, None, :]  # [B, 1, N]
    poison = None
    carried = None if state is None else state.poisoned  # [B, H]: consumed by an earlier call
    # one reduction decides whether a non-finite value could leak through 0 * NaN; in log
    # space the row maxima (needed for the stabilisers anyway) hold NaN or +inf exactly
    # for the rows that hold one, so only [B, H, N] is scanned
    vv = v if drop is None else v.masked_fill(drop.unsqueeze(-1), 0.0)
    top_q = top_k = None
    if log_space:
        top_q, top_k = phi_q.detach().amax(-1), phi_k.detach().amax(-1)  # [B, H, N]
        if drop is not None:
            top_k = top_k.masked_fill(drop, float("-inf"))
        tops = torch.cat([top_q, top_k], dim=-1)
        bad = torch.isnan(tops).any() | torch.isposinf(tops).any() | ~torch.isfinite(vv.detach().sum())
    else:
        vk = phi_k if drop is None else phi_k.masked_fill(drop.unsqueeze(-1), 0.0)
        bad = ~torch.isfinite(phi_q.detach().sum() + vk.detach().sum() + vv.detach().sum())
    bad = bool(bad)
    if bad:
        vk = phi_k if drop is None else phi_k.masked_fill(drop.unsqueeze(-1), 0.0)
        bad_k = _bad_rows(vk.detach(), log_space) | _bad_rows(vv.detach(), False)  # [B, H, N]
        bad_q = _bad_rows(phi_q.detach(), log_space)
        drop = bad_k if drop is None else drop | bad_k
        phi_q = phi_q.masked_fill(bad_q.unsqueeze(-1), 0.0)
        poison = bad_k.cummax(-1).values | bad_q  # rows that legitimately see them
        carried = bad_k.any(-1) if carried is None else carried | bad_k.any(-1)
        top_q = top_k = None  # recomputed from the cleaned rows
    if state is not None and state.poisoned is not None:  # an earlier call consumed one
        earlier = state.poisoned[..., None].expand(b, h, n)
        poison = earlier if poison is None else poison | earlier
    if bad:  # the dropped keys grew: mask the values again
        v = v.masked_fill(drop.unsqueeze(-1), 0.0)  # type: ignore[union-attr]
    else:
        v = vv
    fq = query_side(phi_q, log_space, top_q)  # [B, H, N, D]
    m = m0 = m_out = m_raw = None
    if log_space:
        lk = phi_k if drop is None else phi_k.masked_fill(drop.unsqueeze(-1), float("-inf"))
        m_raw = lk.detach().amax(-1) if top_k is None else top_k  # [B, H, N]
        if state is not None and state.m is not None:
            m_raw = torch.maximum(m_raw, state.m)  # the prefix continues from earlier calls
        m_raw, m = prefix_stabiliser(m_raw)
        fk = (lk - m.unsqueeze(-1)).exp_()  # [B, H, N, D], entries <= 1, dropped keys 0
        if n:
            m_out, m0 = m_raw[..., -1:], m[..., :1]
        else:  # no new position (an empty decoding step): the state is carried as it is
            m_out = phi_k.new_full((b, h, 1), float("-inf")) if state is None or state.m is None else state.m
            m0 = phi_k.new_zeros((b, h, 1))  # the state's own stabiliser below, where finite
        if state is not None and state.m is not None:
            m0 = torch.where(torch.isfinite(state.m), state.m, m0)
    else:
        fk = phi_k if drop is None else phi_k.masked_fill(drop.unsqueeze(-1), 0.0)
    v1 = torch.cat([v, v.new_ones(b, h, n, 1)], dim=-1)  # [B, H, N, dv + 1]
    if state is None:
        s0 = fq.new_zeros(b, h, d_feat, dv + 1)
    else:
        s0 = torch.cat([state.kv.to(fq.dtype), state.z.to(fq.dtype).unsqueeze(-1)], dim=-1)
    return CausalInputs(fq, fk, v1, s0, m, m0, m_out, poison, carried, m_raw if log_space else None)


def finish_causal(
    out: torch.Tensor, s_final: torch.Tensor, prep: CausalInputs, state: CausalState | None
) -> tuple[torch.Tensor, torch.Tensor, CausalState]:
    """Numerator, denominator (poisoned rows NaN) and the outgoing state of the core's
    output ``[B, H, N, dv + 1]`` and final state."""
    dv = out.shape[-1] - 1
    num, den = out.split([dv, 1], dim=-1)  # one backward (a cat) instead of two zero-filled slices
    den = den.squeeze(-1)
    if prep.poison is not None:
        num = num.masked_fill(prep.poison.unsqueeze(-1), float("nan"))
        den = den.masked_fill(prep.poison, float("nan"))
    length = (0 if state is None else state.length) + out.shape[2]
    return num, den, CausalState(s_final[..., :dv], s_final[..., dv], prep.m_out, length, prep.carried)
