"""Feature-map attention in position groups, features included, with its own backward.

This is how the torch backend runs feature-map attention: the positions are cut into
groups of ``G`` (a multiple of the chunk length), and each group's features are made,
used and dropped before the next group's. No ``[B, H, N, D]`` feature tensor is ever
formed, in the forward pass or in the backward pass:

* **Forward.** Causal: the groups run in order, each continuing the
  :class:`~kernelattn_core.engine.torch_backend.CausalState` of the previous one, the
  code that decoding runs (:func:`~kernelattn_core.engine.torch_backend.prepare_causal`,
  the chunked core, :func:`~kernelattn_core.engine.torch_backend.finish_causal`), so the
  result is the one causal call's, prefix stabiliser and non-finite isolation included.
  Non-causal: one pass over the key groups accumulates
  :math:`S = \\sum_j \\hat\\phi_k(k_j) [v_j, 1]^\\top` at the running maximum :math:`c` of
  the key log-features (restated by :math:`e^{c_{old} - c_{new}} \\le 1` when it grows),
  one pass over the query groups forms :math:`\\hat\\phi_q(q_t)^\\top S`.
* **Backward** (:class:`torch.autograd.Function`). Only the inputs, the
  :math:`O(N / G)` states entering the groups (``[B, H, D, d_v + 1]`` each) and the
  stabilisers are kept. The groups run backwards; each group's features are recomputed
  under a local autograd graph of that group alone, the core's gradients come from the
  transposed recurrence
  (:func:`~kernelattn_core.engine.chunked.causal_linear_attention_backward`), which also
  gives :math:`\\bar S` for the previous group, and the local graph carries them to
  ``q``, ``k``, ``v`` and the map's parameters. Non-causal, with
  :math:`o_t = \\hat\\phi_q(q_t)^\\top S`:

  .. math::
      \\bar S = \\sum_t \\hat\\phi_q(q_t)\\, \\bar o_t^\\top, \\qquad
      \\bar\\phi_q(q_t) = S\\, \\bar o_t, \\qquad
      \\bar\\phi_k(k_j) = \\bar S\\, [v_j, 1], \\qquad
      \\overline{[v_j, 1]} = \\bar S^\\top \\hat\\phi_k(k_j).

Training memory beyond the inputs, outputs and their gradients is one group's work
space plus :math:`O((N / G) D d_v)`; every large temporary has the same size on every
call, so the allocator reuses it (tensors above glibc's 32 MiB mmap threshold are fresh
pages on every call, whose page faults made the one-shot form super-linear in ``N``).
The price is computing the features twice (once forward, once backward), one
``[N, d] x [d, D]`` product and an exponential per side.

The backward pass is not itself differentiable (``once_differentiable``): a second
derivative through feature-map attention raises an error.

Feature maps act token by token (a position's features depend on that position's input
only) and take their trainable tensors from ``parameters()``; both are part of the
:class:`~kernelattn_core.interfaces.FeatureMap` contract.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from .chunked import DEFAULT_CHUNK, causal_linear_attention_backward, causal_linear_attention_forward
from .torch_backend import CausalState, compute_dtype, finish_causal, prepare_causal, query_side

#: bytes of one ``[B, H, G, D]`` feature block; the work space of a group (forward and
#: backward) is about 12 such blocks. Chosen by measurement (causal, B = 1, H = 4,
#: D = 128, N = 4K and 16K, allocator without page faults, medians of interleaved runs):
#: 2 MiB (G = 1024) forward 20.3 ms at 4K, forward + backward 80 / 277 ms at 4K / 16K,
#: peak memory of forward + backward 47 / 97 MiB; 8 MiB (G = 4096) 23.0 ms, 80 / 286 ms,
#: 118 / 187 MiB; 1 MiB is slower (per-group overhead). ``tests/benchmarks`` re-measures.
GROUP_BYTES = 2 * 2**20


def group_length(batch_heads: int, width: int, itemsize: int, chunk: int) -> int:
    """Positions per group: ``[B, H, G, width]`` blocks of at most :data:`GROUP_BYTES`,
    a multiple of ``chunk`` (at least one chunk)."""
    g = GROUP_BYTES // max(1, batch_heads * width * itemsize)
    return max(chunk, g // chunk * chunk)


@dataclass
class _Call:
    """The non-tensor arguments of one grouped call."""

    fm: Any
    log_space: bool
    key_padding_mask: torch.Tensor | None
    chunk: int
    group: int
    dtype: torch.dtype
    scale: float
    normalize: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    #: whether a backward pass may follow (autograd on and an input needs a gradient)
    keep: bool

    def spans(self, n: int) -> list[tuple[int, int]]:
        return [(g0, min(n, g0 + self.group)) for g0 in range(0, n, self.group)]

    def features(self, x: torch.Tensor, query: bool) -> torch.Tensor:
        x = x if self.scale == 1.0 else x * self.scale
        return self.fm.raw_features(x, query=query).to(self.dtype)

    def key_features(self, k: torch.Tensor, g0: int, g1: int) -> torch.Tensor:
        """Features of the keys ``[g0, g1)``, padded keys set to 0 *before* the map: whatever
        a padded key holds (NaN), its gradient is exactly 0, not the map's ``0 * NaN``."""
        mask = self.mask(g0, g1)
        if mask is not None:
            k = k.masked_fill(mask[:, None, :, None], 0.0)
        return self.features(k, False)

    def grads(
        self, out_bar: tuple[torch.Tensor, ...], num: torch.Tensor, den: torch.Tensor, g0: int, g1: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients of ``num`` ``[B, H, G, dv]`` and ``den`` ``[B, H, G]`` on positions
        ``[g0, g1)``: given, or through the normaliser (recomputed on the group's rows under
        a local graph)."""
        if self.normalize is None:
            num_bar, den_bar = (g[:, :, g0:g1] for g in out_bar)
        else:
            nl, dl = num[:, :, g0:g1].detach().requires_grad_(), den[:, :, g0:g1].detach().requires_grad_()
            with torch.enable_grad():
                out = self.normalize(nl, dl)
            num_bar, den_bar = torch.autograd.grad(out, (nl, dl), out_bar[0][:, :, g0:g1])
        return num_bar.to(self.dtype), den_bar.to(self.dtype)

    def mask(self, g0: int, g1: int) -> torch.Tensor | None:
        return None if self.key_padding_mask is None else self.key_padding_mask[:, g0:g1]


class _Sink:
    """Where a forward pass writes each group's rows: the normalised output (with a
    normaliser) or ``num`` and ``den``; ``num`` and ``den`` are kept for the backward
    pass only when one will run."""

    def __init__(self, call: _Call, b: int, h: int, n: int, dv: int, device: torch.device) -> None:
        self.call = call
        keep = call.keep or call.normalize is None
        self.num = torch.empty(b, h, n, dv, dtype=call.dtype, device=device) if keep else None
        self.den = torch.empty(b, h, n, dtype=call.dtype, device=device) if keep else None
        self.out = None if call.normalize is None else torch.empty(b, h, n, dv, dtype=call.dtype, device=device)

    def put(self, g0: int, g1: int, num: torch.Tensor, den: torch.Tensor) -> None:
        if self.num is not None:
            self.num[:, :, g0:g1], self.den[:, :, g0:g1] = num, den  # type: ignore[index]
        if self.out is not None:
            self.out[:, :, g0:g1] = self.call.normalize(num, den)  # type: ignore[misc]

    @property
    def saved(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.num, self.den

    def result(self) -> tuple[torch.Tensor, ...]:
        return (self.num, self.den) if self.out is None else (self.out,)  # type: ignore[return-value]


def _leaf(x: torch.Tensor, g0: int, g1: int, grad: bool) -> torch.Tensor:
    """Positions ``[g0, g1)`` of ``x``, detached, a leaf of the local graph when ``grad``."""
    return x[:, :, g0:g1].detach().requires_grad_(grad)


def _local_grads(
    outputs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...], inputs: list[torch.Tensor]
) -> list[torch.Tensor | None]:
    """Gradients of the local graph ``outputs`` (weighted by ``grads``) for ``inputs``;
    ``None`` for an input no output depends on."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
    wanted = [x for x in inputs if x.requires_grad]
    got: list[torch.Tensor | None] = [None] * len(wanted)
    if pairs and wanted:
        got = list(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
    it = iter(got)
    return [next(it) if x.requires_grad else None for x in inputs]


def _add(total: torch.Tensor | None, part: torch.Tensor | None) -> torch.Tensor | None:
    if part is None:
        return total
    return part if total is None else total.add_(part)


class _GroupedCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, q, k, v, *params):  # type: ignore[no-untyped-def, override]
        b, h, n, _ = q.shape
        sink = _Sink(call, b, h, n, v.shape[-1], q.device)
        states: list[CausalState | None] = []
        state = None
        for g0, g1 in call.spans(n):
            states.append(state)
            prep = prepare_causal(
                call.features(q[:, :, g0:g1], True),
                call.key_features(k[:, :, g0:g1], g0, g1),
                v[:, :, g0:g1].to(call.dtype),
                call.log_space,
                call.mask(g0, g1),
                state,
            )
            out, s_final = causal_linear_attention_forward(
                prep.fq, prep.fk, prep.v1, prep.s0, prep.m, prep.m0, call.chunk
            )
            num, den, state = finish_causal(out, s_final, prep, state)
            sink.put(g0, g1, num, den)
            del prep, out, num, den
        ctx.call, ctx.states = call, states
        ctx.save_for_backward(q, k, v, *sink.saved, *params)
        return sink.result()

    @staticmethod
    @once_differentiable
    def backward(ctx, *out_bar):  # type: ignore[no-untyped-def, override]
        call: _Call = ctx.call
        q, k, v, num, den, *params = ctx.saved_tensors
        need = ctx.needs_input_grad[1:4]
        n = q.shape[2]
        grads: list[torch.Tensor | None] = [None] * (3 + len(params))
        inputs_bar = [torch.empty_like(t) if w else None for t, w in zip((q, k, v), need)]  # groups tile [0, N)
        s_bar = None  # gradient of the state leaving the current group
        for i, (g0, g1) in reversed(list(enumerate(call.spans(n)))):
            state = ctx.states[i]
            leaves = [_leaf(t, g0, g1, w) for t, w in zip((q, k, v), need)]
            with torch.enable_grad():
                prep = prepare_causal(
                    call.features(leaves[0], True),
                    call.key_features(leaves[1], g0, g1),
                    leaves[2].to(call.dtype),
                    call.log_space,
                    call.mask(g0, g1),
                    state,
                )
            num_bar, den_bar = call.grads(out_bar, num, den, g0, g1)
            ob = torch.cat([num_bar, den_bar.unsqueeze(-1)], dim=-1)  # [B, H, G, dv + 1]
            if prep.poison is not None:  # NaN rows: masked_fill's gradient there is 0
                ob = ob.masked_fill(prep.poison.unsqueeze(-1), 0.0)
            fq_bar, fk_bar, v1_bar, s_bar = causal_linear_attention_backward(
                prep.fq.detach(),
                prep.fk.detach(),
                prep.v1.detach(),
                prep.s0.detach(),
                prep.m,
                prep.m0,
                call.chunk,
                ob,
                s_bar,
            )
            local = _local_grads((prep.fq, prep.fk, prep.v1), (fq_bar, fk_bar, v1_bar), [*leaves, *params])
            for j, part in enumerate(local[:3]):
                if part is not None:
                    inputs_bar[j][:, :, g0:g1] = part  # type: ignore[index]
            for j, part in enumerate(local[3:]):
                grads[3 + j] = _add(grads[3 + j], part)
            del prep, local
        grads[:3] = inputs_bar
        return None, *grads


class _GroupedNonCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, q, k, v, *params):  # type: ignore[no-untyped-def, override]
        b, h, n, _ = q.shape
        dv = v.shape[-1]
        width = call.fm.feature_dim
        s = torch.zeros(b, h, width, dv, dtype=call.dtype, device=q.device)  # sum of phi_k v^T
        z = torch.zeros(b, h, width, 1, dtype=call.dtype, device=q.device)  # sum of phi_k
        c_run = torch.full((b, h, 1, 1), float("-inf"), dtype=call.dtype, device=q.device)
        for g0, g1 in call.spans(k.shape[2]):
            fk, vg, c_new = _key_group(call, k[:, :, g0:g1], v[:, :, g0:g1], g0, g1, c_run)
            if call.log_space:  # the sums so far, restated at the new maximum (factor <= 1)
                restate = torch.where(torch.isfinite(c_run), (c_run - _safe(c_new)).exp(), torch.zeros_like(c_run))
                s.mul_(restate)
                z.mul_(restate)
                c_run = c_new
            s.add_(fk.transpose(-1, -2) @ vg)
            z.add_(fk.sum(-2).unsqueeze(-1))
        sink = _Sink(call, b, h, n, dv, q.device)
        for g0, g1 in call.spans(n):
            fq = query_side(call.features(q[:, :, g0:g1], True), call.log_space)  # [B, H, G, D]
            sink.put(g0, g1, fq @ s, (fq @ z).squeeze(-1))
        ctx.call, ctx.c = call, _safe(c_run)
        ctx.save_for_backward(q, k, v, s, z, *sink.saved, *params)
        return sink.result()

    @staticmethod
    @once_differentiable
    def backward(ctx, *out_bar):  # type: ignore[no-untyped-def, override]
        call: _Call = ctx.call
        q, k, v, s, z, num, den, *params = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[1:4]
        grads: list[torch.Tensor | None] = [None] * (3 + len(params))
        q_bar = torch.empty_like(q) if need_q else None  # groups tile [0, N)
        k_bar = torch.empty_like(k) if need_k else None
        v_bar = torch.empty_like(v) if need_v else None
        s_bar, z_bar = torch.zeros_like(s), torch.zeros_like(z)
        for g0, g1 in call.spans(q.shape[2]):  # queries: S-bar, z-bar and the queries' gradients
            leaf = _leaf(q, g0, g1, need_q)
            with torch.enable_grad():
                fq = query_side(call.features(leaf, True), call.log_space)
            num_bar, den_bar = call.grads(out_bar, num, den, g0, g1)
            den_bar = den_bar.unsqueeze(-1)  # [B, H, G, 1]
            fq_t = fq.detach().transpose(-1, -2)
            s_bar.add_(fq_t @ num_bar)
            z_bar.add_(fq_t @ den_bar)
            fq_bar = torch.baddbmm(
                (den_bar * z.transpose(-1, -2)).flatten(0, 1), num_bar.flatten(0, 1), s.transpose(-1, -2).flatten(0, 1)
            ).view_as(fq)  # num-bar S^T + den-bar z^T
            local = _local_grads((fq,), (fq_bar,), [leaf, *params])
            if local[0] is not None:
                q_bar[:, :, g0:g1] = local[0]  # type: ignore[index]
            for j, part in enumerate(local[1:]):
                grads[3 + j] = _add(grads[3 + j], part)
        for g0, g1 in call.spans(k.shape[2]):  # keys and values
            kl, vl = _leaf(k, g0, g1, need_k), _leaf(v, g0, g1, need_v)
            with torch.enable_grad():
                fk, vg, _ = _key_group(call, kl, vl, g0, g1, ctx.c)
            fk_bar = torch.baddbmm(
                z_bar.transpose(-1, -2).flatten(0, 1), vg.detach().flatten(0, 1), s_bar.transpose(-1, -2).flatten(0, 1)
            ).view_as(fk)  # v S-bar^T + z-bar^T (every row)
            local = _local_grads((fk, vg), (fk_bar, fk.detach() @ s_bar), [kl, vl, *params])
            if local[0] is not None:
                k_bar[:, :, g0:g1] = local[0]  # type: ignore[index]
            if local[1] is not None:
                v_bar[:, :, g0:g1] = local[1]  # type: ignore[index]
            for j, part in enumerate(local[2:]):
                grads[3 + j] = _add(grads[3 + j], part)
        grads[:3] = [q_bar, k_bar, v_bar]
        return None, *grads


def _safe(c: torch.Tensor) -> torch.Tensor:
    """``c`` where finite, else 0 (every key padded: the features are 0 whatever ``c``)."""
    return torch.where(torch.isfinite(c), c, torch.zeros_like(c))


def _key_group(
    call: _Call, k: torch.Tensor, v: torch.Tensor, g0: int, g1: int, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key features ``[B, H, G, D]`` and values of one key group, padded keys and values 0
    whatever they hold, and the stabiliser they are stated at.

    In log space the features are :math:`e^{l_k - c'}` with :math:`c' = \\max(c, \\max l_k)`
    (``c`` ``[B, H, 1, 1]``: the running maximum in the forward pass, the final one in
    the backward pass, where :math:`c' = c`); ``c'`` is returned.
    """
    lk = call.key_features(k, g0, g1)
    v = v.to(call.dtype)
    mask = call.mask(g0, g1)
    if mask is not None:  # removed before any product, whatever they hold
        pad = mask[:, None, :, None]
        v = v.masked_fill(pad, 0.0)
        lk = lk.masked_fill(pad, float("-inf") if call.log_space else 0.0)
    if not call.log_space:
        return lk, v, c
    c = torch.maximum(c, lk.detach().amax(dim=(-2, -1), keepdim=True))
    return (lk - _safe(c)).exp(), v, c


def grouped_feature_attention(
    feature_map: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    chunk_size: int | None = None,
    group: int | None = None,
    scale: float = 1.0,
    normalize: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Numerator ``[B, H, N, dv]`` and denominator ``[B, H, N]`` of feature-map attention,
    computed in position groups with the features made per group (module docstring); or,
    with ``normalize``, the normalised output ``(out,)``.

    Equal to :func:`~kernelattn_core.engine.torch_backend.feature_attention_torch` on the
    features of ``scale * q`` and ``scale * k`` (then ``normalize``), on outputs and
    gradients, with or without autograd.

    Parameters
    ----------
    feature_map : FeatureMap
        Built and prepared; its ``raw_features`` are called per group, and gradients
        reach its trainable ``parameters()``.
    q, k : Tensor ``[B, H, N, d]``, ``[B, H, M, d]``
        Scaled queries and keys.
    v : Tensor ``[B, H, M, dv]``
    causal : bool
    key_padding_mask : Tensor ``[B, M]`` of bool, optional
        ``True`` marks a padded key.
    chunk_size : int, optional
        Positions per chunk of the causal core (default
        :data:`~kernelattn_core.engine.chunked.DEFAULT_CHUNK`).
    group : int, optional
        Positions per group (default: :func:`group_length`); causal groups are rounded up
        to a multiple of the chunk length.
    scale : float
        Factor applied to ``q`` and ``k`` group by group before the features (the
        estimator's :math:`\\sqrt{s}`: no scaled copy of the whole inputs is made).
    normalize : callable, optional
        ``(num, den) -> out``, row by row (:meth:`~kernelattn_core.interfaces.Normalizer.normalize`);
        applied per group, its backward too, so neither ``num``'s gradient nor the
        normaliser's temporaries are ever whole-sequence tensors.

    Returns
    -------
    ``(num, den)``, or ``(out,)`` with ``normalize``.
    """
    fm = feature_map
    fm.raw_features(q[:, :, :0], query=True)  # builds an unbuilt map, checks d (naming q)
    chunk = chunk_size or DEFAULT_CHUNK
    dtype = compute_dtype(q.dtype)
    b, h = q.shape[:2]
    g = group or group_length(b * h, fm.feature_dim, torch.finfo(dtype).bits // 8, chunk)
    if causal:
        g = -(-g // chunk) * chunk  # groups hold whole chunks
    params = [p for p in fm.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *params))
    call = _Call(fm, fm.log_space, key_padding_mask, chunk, g, dtype, float(scale), normalize, keep)
    fn = _GroupedCausal if causal else _GroupedNonCausal
    out = fn.apply(call, q, k, v, *params)
    return out if isinstance(out, tuple) else (out,)
