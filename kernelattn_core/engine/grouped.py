"""Feature-map attention in position groups, features included, with its own backward.

This is how the torch backend runs feature-map attention: the positions are cut into
groups of ``G`` (a multiple of the chunk length), and each group's features are made,
used and dropped before the next group's. No ``[B, H, N, D]`` feature tensor is ever
formed, in the forward pass or in the backward pass:

* **Forward.** Causal: the groups run in order, each continuing the
  :class:`~kernelattn_core.engine.chunked.CausalState` of the previous one, the
  code that decoding runs (:func:`~kernelattn_core.engine.chunked.prepare_causal`,
  the chunked core, :func:`~kernelattn_core.engine.chunked.finish_causal`), so the
  result is the one causal call's, prefix stabiliser and non-finite isolation included.
  Non-causal: one pass over the key groups accumulates
  :math:`S = \\sum_j \\hat\\phi_k(k_j) v_j^\\top` and :math:`z = \\sum_j \\hat\\phi_k(k_j)` at
  the running maximum :math:`c` of the key log-features (restated by
  :math:`e^{c_{old} - c_{new}} \\le 1` when it grows), one pass over the query groups
  forms :math:`\\mathrm{num}_t = \\hat\\phi_q(q_t)^\\top S` and
  :math:`\\mathrm{den}_t = \\hat\\phi_q(q_t)^\\top z`.
* **Backward** (:class:`torch.autograd.Function`). Only the inputs, ``num`` and ``den``,
  the :math:`O(N / G)` states entering the groups (``[B, H, D, d_v + 1]`` each) are
  kept. The groups run backwards; each group's features are recomputed under a local
  autograd graph of that group alone, the core's gradients come from the transposed
  recurrence (:func:`~kernelattn_core.engine.chunked.causal_linear_attention_backward`),
  which also gives :math:`\\bar S` for the previous group, and the local graph carries
  them to ``q``, ``k``, ``v`` and the map's parameters. Non-causal:

  .. math::
      \\bar S = \\sum_t \\hat\\phi_q(q_t)\\, \\overline{\\mathrm{num}}_t^\\top, \\quad
      \\bar z = \\sum_t \\hat\\phi_q(q_t)\\, \\overline{\\mathrm{den}}_t, \\quad
      \\bar\\phi_q(q_t) = S\\, \\overline{\\mathrm{num}}_t + z\\, \\overline{\\mathrm{den}}_t, \\quad
      \\bar\\phi_k(k_j) = \\bar S\\, v_j + \\bar z, \\quad
      \\bar v_j = \\bar S^\\top \\hat\\phi_k(k_j).

  With a normaliser, its forward and backward run on each group's rows too (a local
  graph over ``num`` and ``den`` of the group), and the estimator's :math:`\\sqrt{s}`
  is applied to each group's ``q`` and ``k`` on the way in.

Training memory beyond the inputs, outputs and their gradients is one group's work
space plus :math:`O((N / G) D d_v)`; every large temporary has the same size on every
call, so the allocator reuses it (tensors above glibc's 32 MiB mmap threshold are fresh
pages on every call, whose page faults made the one-shot form super-linear in ``N``).
The price is computing the features twice (once forward, once backward), one
``[N, d] x [d, D]`` product and an exponential per side. Except for a training call of
**one group** (a short sequence, ``N <= G``, or any training call of at most
:data:`SHORT_TRAINING` positions; non-causal: one key group and one query group): its
forward pass builds the group's local graphs and holds them for the backward pass, and a
causal one keeps the core's per-chunk work too (states, gate, gated products:
the ``tape`` of :func:`~kernelattn_core.engine.chunked.causal_linear_attention_forward`),
so the backward pass recomputes nothing (the memory held is that one group's work space,
the bound the grouping keeps anyway). Measured 2026-11-26 (``prf``, 64 features, H 2, d 32,
one thread): one causal call's forward + backward at B 32, N 128 40.7 -> 33.9 ms; the
task benchmarks' training step 106 -> 98 ms (induction, causal) and 57.5 -> 51.0 ms
(ListOps, non-causal); the core's tape, later: induction step with ``prf`` 0.95x, MQAR
with ``rfa`` 0.96x, ``hedgehog`` (plain features, no gate) 0.99x.

Second derivatives (``create_graph=True``, for gradient penalties) are supported for
non-causal calls by a different route: that backward pass recomputes the one-shot path
whole under autograd and differentiates it with a graph, so it has the one-shot path's
memory (:func:`_differentiable_backward`). Causal calls refuse them with an
:class:`~kernelattn_core.errors.InputError` (the chunked core's backward is its own
first-order recurrence).

Feature maps act token by token (a position's features depend on that position's input
only) and take their trainable tensors from ``parameters()``; both are part of the
:class:`~kernelattn_core.interfaces.FeatureMap` contract. Padded keys are set to 0 before
the map, so a padded position's own gradient is exactly 0 whatever it holds; a non-finite
input row never reaches the map either (:meth:`~kernelattn_core.interfaces.FeatureMap.raw_features`
gives it a NaN row with zero gradient). Non-finite keys and query rows are quarantined in
both forms: the causal one by :func:`~kernelattn_core.engine.chunked.prepare_causal`,
the non-causal one by :func:`~kernelattn_core.engine.torch_backend.quarantine_keys` (a
head holding such a key has every row NaN) and a check of each group's denominators (a
non-finite query row); in the backward pass a row whose output is not finite sends no
gradient back (its normaliser sees ``num = 0``, ``den = 1`` there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InputError
from ..redraw import saved_tensor_hooks_active
from ..validation import check_head_dim, finite_rows
from .chunked import (
    CausalInputs,
    CausalState,
    autocast_off,
    causal_linear_attention_backward,
    causal_linear_attention_forward,
    compute_dtype,
    default_chunk,
    finish_causal,
    prepare_causal,
    query_side,
)
from .torch_backend import feature_attention_torch, non_finite_query_rows, quarantine_keys

#: bytes of one ``[B, H, G, D]`` feature block; the work space of a group (forward and
#: backward) is about 12 such blocks. Chosen by measurement (causal, B = 1, H = 4,
#: D = 128, N = 4K and 16K, allocator without page faults, medians of interleaved runs):
#: 2 MiB (G = 1024) forward 20.3 ms at 4K, forward + backward 80 / 277 ms at 4K / 16K,
#: peak memory of forward + backward 47 / 97 MiB; 8 MiB (G = 4096) 23.0 ms, 80 / 286 ms,
#: 118 / 187 MiB; 1 MiB is slower (per-group overhead). ``tests/benchmarks`` re-measures.
GROUP_BYTES = 2 * 2**20

#: a training call whose queries and keys both fit in this many positions is one group,
#: whatever :data:`GROUP_BYTES` gives (0: the byte bound alone). The byte bound was chosen
#: for long sequences; for batched short ones with wide maps it cut a sequence into groups
#: of one chunk (B 32, 2 heads, D 256: G = 32 at N = 128), each paying its own preparation
#: and the backward pass's recompute, where one group holds its graph (work space about 12
#: ``[B, H, N, D]`` blocks: 100 MB there). Measured 2026-11-27 (the MQAR task step, 2
#: threads, interleaved): ``hedgehog:init=prf`` with 256 features 118-128 -> 84-87 ms, ``prf``
#: with 256 features 94-97 -> 70-72 ms; at 64 features (already one group) unchanged.
SHORT_TRAINING = 128


def group_length(batch_heads: int, width: int, itemsize: int, chunk: int) -> int:
    """Positions per group: ``[B, H, G, width]`` blocks of at most :data:`GROUP_BYTES`,
    a multiple of ``chunk`` (at least one chunk)."""
    g = GROUP_BYTES // max(1, batch_heads * width * itemsize)
    return max(chunk, g // chunk * chunk)


@dataclass
class _Call:
    """The non-tensor arguments of one grouped call, and what its backward pass reuses."""

    fm: Any
    log_space: bool
    #: a copy taken at the forward pass (a mask changed afterwards cannot move the gradients)
    key_padding_mask: torch.Tensor | None
    chunk: int
    group: int
    dtype: torch.dtype
    scale: float
    normalizer: Any | None
    #: whether a backward pass may follow (autograd on and an input needs a gradient)
    keep: bool
    #: how many of the trailing inputs are the map's parameters (the rest: the normaliser's)
    n_map: int
    #: the map's buffers as the forward pass saw them (the backward recomputes the features
    #: with these, even if a redraw or a running statistic changed them since)
    buffers: dict[str, torch.Tensor]

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

    def mask(self, g0: int, g1: int) -> torch.Tensor | None:
        return None if self.key_padding_mask is None else self.key_padding_mask[:, g0:g1]

    def prepare(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g0: int, g1: int, state: CausalState | None
    ) -> CausalInputs:
        """The causal core's inputs for the positions ``[g0, g1)`` (``q``, ``k``, ``v`` are
        that group's rows), continuing ``state``: the forward pass and its replay alike."""
        return prepare_causal(
            self.features(q, True),
            self.key_features(k, g0, g1),
            v.to(self.dtype),
            self.log_space,
            self.mask(g0, g1),
            state,
        )

    def core_args(self, prep: CausalInputs) -> tuple[Any, ...]:
        """The chunked core's inputs from :meth:`prepare`'s (detached: the core's backward
        is written by hand, the local graph carries its gradients on)."""
        return prep.fq.detach(), prep.fk.detach(), prep.v1.detach(), prep.s0.detach(), prep.m, prep.m0, self.chunk

    def local_graph(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g0: int,
        g1: int,
        state: CausalState | None,
        need: tuple[bool, ...],
    ) -> tuple[list[torch.Tensor], CausalInputs]:
        """The leaves (positions ``[g0, g1)`` of ``q``, ``k``, ``v``, detached; a gradient
        where ``need`` says) and :meth:`prepare` on them under a local autograd graph, as the
        forward pass saw it: built by the forward pass of a one-group call, by the backward
        pass otherwise."""
        leaves = [_leaf(t, g0, g1, w) for t, w in zip((q, k, v), need)]
        with torch.enable_grad(), self.replay(q.device):
            return leaves, self.prepare(*leaves, g0, g1, state)

    def num_den_bars(
        self,
        out_bar: tuple[torch.Tensor, ...],
        num: torch.Tensor,
        den: torch.Tensor,
        g0: int,
        g1: int,
        norm_params: list[torch.Tensor],
        bad: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
        """Gradients of ``num`` ``[B, H, G, dv]`` and ``den`` ``[B, H, G]`` on positions
        ``[g0, g1)`` (given, or through the normaliser recomputed on the group's rows under a
        local graph), and the group's part of the normaliser parameters' gradients.

        The rows ``bad [B, H, G]`` (non-finite outputs) get zero gradients and enter the
        normaliser as ``num = 0``, ``den = 1``, so its parameters' gradients stay finite."""
        if self.normalizer is None:
            num_bar, den_bar = (g[:, :, g0:g1] for g in out_bar)
            if bad is not None:
                num_bar, den_bar = num_bar.masked_fill(bad.unsqueeze(-1), 0.0), den_bar.masked_fill(bad, 0.0)
            return num_bar.to(self.dtype), den_bar.to(self.dtype), []
        nl, dl, ob = num[:, :, g0:g1].detach(), den[:, :, g0:g1].detach(), out_bar[0][:, :, g0:g1]
        if bad is not None:
            nl, dl, ob = (
                nl.masked_fill(bad.unsqueeze(-1), 0.0),
                dl.masked_fill(bad, 1.0),
                ob.masked_fill(bad[..., None], 0),
            )
        nl, dl = nl.requires_grad_(), dl.requires_grad_()
        with torch.enable_grad():
            out = self.normalizer.normalize(nl, dl)
        num_bar, den_bar, *parts = _local_grads((out,), (ob,), [nl, dl, *norm_params])
        return num_bar.to(self.dtype), den_bar.to(self.dtype), parts  # type: ignore[union-attr]

    @contextlib.contextmanager
    def replay(self, device: torch.device) -> Iterator[None]:
        """Recompute as the forward pass did: the saved buffers in the map, autocast off."""
        with _buffers_swapped(self.fm, self.buffers), autocast_off(device):
            yield


@contextlib.contextmanager
def _buffers_swapped(module: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> Iterator[None]:
    """``module``'s buffers replaced by ``buffers`` (dotted names) for the duration."""
    saved = []
    try:
        for name, value in buffers.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            saved.append((owner, leaf, owner._buffers[leaf]))
            owner._buffers[leaf] = value
        yield
    finally:
        for owner, leaf, value in reversed(saved):
            owner._buffers[leaf] = value


class _Rows:
    """Where the forward pass writes each group's rows.

    * ``out``: the normalised rows, when the call has a normaliser (the result);
    * ``num`` and ``den``: the result without a normaliser; with one, kept only when a
      backward pass may follow (the normaliser's backward is recomputed from them).
    """

    def __init__(self, call: _Call, b: int, h: int, n: int, dv: int, device: torch.device) -> None:
        self.normalizer = call.normalizer
        new = {"dtype": call.dtype, "device": device}
        keep_num_den = call.keep or call.normalizer is None
        self.num = torch.empty(b, h, n, dv, **new) if keep_num_den else None
        self.den = torch.empty(b, h, n, **new) if keep_num_den else None
        self.out = None if call.normalizer is None else torch.empty(b, h, n, dv, **new)

    def put(self, g0: int, g1: int, num: torch.Tensor, den: torch.Tensor) -> None:
        if self.num is not None:
            self.num[:, :, g0:g1], self.den[:, :, g0:g1] = num, den  # type: ignore[index]
        if self.out is not None:
            self.out[:, :, g0:g1] = self.normalizer.normalize(num, den)

    @property
    def saved(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``num`` and ``den`` for the backward pass (``None`` when none will run)."""
        return self.num, self.den

    def result(self) -> tuple[torch.Tensor, ...]:
        return (self.num, self.den) if self.out is None else (self.out,)  # type: ignore[return-value]


def _leaf(x: torch.Tensor, g0: int, g1: int, grad: bool) -> torch.Tensor:
    """Positions ``[g0, g1)`` of ``x``, detached, a leaf of the local graph when ``grad``."""
    return x[:, :, g0:g1].detach().requires_grad_(grad)


def _local_grads(
    outputs: tuple[torch.Tensor, ...],
    grads: tuple[torch.Tensor, ...],
    inputs: list[torch.Tensor],
    retain: bool = False,
) -> list[torch.Tensor | None]:
    """Gradients of the local graph ``outputs`` (weighted by ``grads``) for ``inputs``;
    ``None`` for an input no output depends on. ``retain`` keeps the graph (one held from
    the forward pass, which a second backward pass needs again)."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
    wanted = [x for x in inputs if x.requires_grad]
    got: list[torch.Tensor | None] = [None] * len(wanted)
    if pairs and wanted:
        got = list(
            torch.autograd.grad(
                [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True, retain_graph=retain
            )
        )
    it = iter(got)
    return [next(it) if x.requires_grad else None for x in inputs]


class _Bars:
    """The gradients a backward pass returns: ``q``, ``k``, ``v`` written group by group
    (zeros where an input does not reach the output), parameters summed over groups."""

    def __init__(self, ctx: Any, inputs: tuple[torch.Tensor, ...], n_params: int) -> None:
        need = ctx.needs_input_grad[1:4]
        self.inputs = [torch.empty_like(t) if w else None for t, w in zip(inputs, need)]
        self.params: list[torch.Tensor | None] = [None] * n_params

    def put(self, j: int, g0: int, g1: int, part: torch.Tensor | None) -> None:
        target = self.inputs[j]
        if target is None:
            return
        if part is None:  # this input does not reach the output here
            target[:, :, g0:g1] = 0.0
        else:
            target[:, :, g0:g1] = part

    def add(self, first: int, parts: list[torch.Tensor | None]) -> None:
        for j, part in enumerate(parts, start=first):
            if part is not None:
                self.params[j] = part if self.params[j] is None else self.params[j].add_(part)  # type: ignore[union-attr]

    def result(self) -> tuple[torch.Tensor | None, ...]:
        return (None, *self.inputs, *self.params)  # None: the call's arguments


class _GroupedCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, q, k, v, *params):  # type: ignore[no-untyped-def, override]
        b, h, n, _ = q.shape
        rows = _Rows(call, b, h, n, v.shape[-1], q.device)
        states: list[CausalState | None] = []
        state = None
        spans = call.spans(n)
        # one group (a short sequence): its features' local graph is built now and held for
        # the backward pass, which then does not recompute them (the memory is one group's,
        # the bound the grouping keeps anyway); several groups: recomputed group by group.
        # Not held under saved-tensor hooks (a non-reentrant checkpoint's, save_on_cpu):
        # its tensors would be packed by them, and the backward's autograd.grad over it
        # unpacked them one by one, each unpack re-running the checkpointed forward (4 runs
        # per checkpointed step instead of 2), and what the checkpoint frees would be kept
        hold = call.keep and len(spans) == 1 and not saved_tensor_hooks_active()
        ctx.held = ctx.tape = None
        for g0, g1 in spans:
            states.append(state)
            if hold:
                leaves, prep = call.local_graph(q, k, v, g0, g1, state, ctx.needs_input_grad[1:4])
                ctx.held, ctx.tape = (leaves, prep), []  # the core's work is held too (the tape)
            else:
                prep = call.prepare(q[:, :, g0:g1], k[:, :, g0:g1], v[:, :, g0:g1], g0, g1, state)
            out, s_final = causal_linear_attention_forward(*call.core_args(prep), tape=ctx.tape)
            num, den, state = finish_causal(out, s_final, prep, state)
            rows.put(g0, g1, num, den)
            del prep, out, num, den
        ctx.call, ctx.states = call, states
        ctx.save_for_backward(q, k, v, *rows.saved, *params)
        return rows.result()

    @staticmethod
    def backward(ctx, *out_bar):  # type: ignore[no-untyped-def, override]
        if torch.is_grad_enabled():
            raise InputError(
                "create_graph: second derivatives of causal feature-map attention are not supported "
                "(the causal engine's backward is its own first-order recurrence); got create_graph=True. "
                "Non-causal calls support them."
            )
        call: _Call = ctx.call
        q, k, v, num, den, *params = ctx.saved_tensors
        map_params, norm_params = params[: call.n_map], params[call.n_map :]
        bars = _Bars(ctx, (q, k, v), len(params))
        s_bar = None  # gradient of the state leaving the current group
        for i, (g0, g1) in reversed(list(enumerate(call.spans(q.shape[2])))):
            if ctx.held is not None:  # the one group's graph, built by the forward pass
                leaves, prep = ctx.held
            else:
                leaves, prep = call.local_graph(q, k, v, g0, g1, ctx.states[i], ctx.needs_input_grad[1:4])
            bad = _bad_output_rows(num, den, g0, g1)  # NaN rows (poisoned) send no gradient back
            num_bar, den_bar, norm_parts = call.num_den_bars(out_bar, num, den, g0, g1, norm_params, bad)
            bars.add(call.n_map, norm_parts)
            o_bar = torch.cat([num_bar, den_bar.unsqueeze(-1)], dim=-1)  # [B, H, G, dv + 1]
            if prep.poison is not None:  # NaN rows: masked_fill's gradient there is 0
                o_bar = o_bar.masked_fill(prep.poison.unsqueeze(-1), 0.0)
            fq_bar, fk_bar, v1_bar, s_bar = causal_linear_attention_backward(
                *call.core_args(prep), o_bar, s_bar, tape=ctx.tape
            )
            local = _local_grads(
                (prep.fq, prep.fk, prep.v1), (fq_bar, fk_bar, v1_bar), [*leaves, *map_params], ctx.held is not None
            )
            for j in range(3):
                bars.put(j, g0, g1, local[j])
            bars.add(0, local[3:])
            del prep, local
        return bars.result()


class _GroupedNonCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, q, k, v, *params):  # type: ignore[no-untyped-def, override]
        b, h, n, _ = q.shape
        dv = v.shape[-1]
        width = call.fm.feature_dim
        s = torch.zeros(b, h, width, dv, dtype=call.dtype, device=q.device)  # sum of phi_k v^T
        z = torch.zeros(b, h, width, 1, dtype=call.dtype, device=q.device)  # sum of phi_k
        c_run = torch.full((b, h, 1, 1), float("-inf"), dtype=call.dtype, device=q.device)
        poisoned = None  # [B, H]: a head held a non-finite key (every query sees it)
        # one key group and one query group (a short sequence): the features' local graphs
        # are built now and held for the backward pass, which then recomputes nothing
        hold = call.keep and len(call.spans(k.shape[2])) == 1 and len(call.spans(n)) == 1
        hold = hold and not saved_tensor_hooks_active()
        ctx.held = None
        if hold:
            need = ctx.needs_input_grad[1:4]
            ql, kl, vl = (_leaf(t, 0, t.shape[2], w) for t, w in zip((q, k, v), need))
            with torch.enable_grad(), call.replay(q.device):
                fq = query_side(call.features(ql, True), call.log_space)
                fk, vg, c_new, bad = _key_group(call, kl, vl, 0, k.shape[2], c_run, grow=True)
            ctx.held = (ql, fq, kl, vl, fk, vg)
        for g0, g1 in call.spans(k.shape[2]):
            if not hold:
                fk, vg, c_new, bad = _key_group(call, k[:, :, g0:g1], v[:, :, g0:g1], g0, g1, c_run, grow=True)
            fk, vg = fk.detach(), vg.detach()
            if bad is not None:
                poisoned = bad if poisoned is None else poisoned | bad
            if call.log_space:  # the sums so far, restated at the new maximum (factor <= 1)
                restate = torch.where(torch.isfinite(c_run), (c_run - _safe(c_new)).exp(), torch.zeros_like(c_run))
                s.mul_(restate)
                z.mul_(restate)
                c_run = c_new
            s.add_(fk.transpose(-1, -2) @ vg)
            z.add_(fk.sum(-2).unsqueeze(-1))
        rows = _Rows(call, b, h, n, dv, q.device)
        for g0, g1 in call.spans(n):
            if not hold:
                fq = query_side(call.features(q[:, :, g0:g1], True), call.log_space)  # [B, H, G, D]
            fq = fq.detach()
            num, den = fq @ s, (fq @ z).squeeze(-1)
            bad = non_finite_query_rows(den, poisoned)  # a non-finite query row, or a poisoned head
            if bad is not None:  # NaN, as the rows that see a non-finite value are
                num, den = num.masked_fill(bad.unsqueeze(-1), float("nan")), den.masked_fill(bad, float("nan"))
            rows.put(g0, g1, num, den)
        ctx.call, ctx.c = call, _safe(c_run)
        ctx.save_for_backward(q, k, v, s, z, *rows.saved, *params)
        return rows.result()

    @staticmethod
    def backward(ctx, *out_bar):  # type: ignore[no-untyped-def, override]
        if torch.is_grad_enabled():  # create_graph=True: a backward that is itself differentiable
            return _differentiable_backward(ctx, out_bar)
        call: _Call = ctx.call
        q, k, v, s, z, num, den, *params = ctx.saved_tensors
        map_params, norm_params = params[: call.n_map], params[call.n_map :]
        need_q, need_k, need_v = ctx.needs_input_grad[1:4]
        bars = _Bars(ctx, (q, k, v), len(params))
        s_bar, z_bar = torch.zeros_like(s), torch.zeros_like(z)
        held = ctx.held is not None  # the one group's graphs, built by the forward pass
        for g0, g1 in call.spans(q.shape[2]):  # queries: S-bar, z-bar and the queries' gradients
            with torch.enable_grad(), call.replay(q.device):
                if held:
                    leaf, fq = ctx.held[0], ctx.held[1]
                else:
                    leaf = _leaf(q, g0, g1, need_q)
                    fq = query_side(call.features(leaf, True), call.log_space)
                bad = _bad_output_rows(num, den, g0, g1)  # NaN rows: quarantined as in the forward pass
                if bad is not None:
                    fq = fq.masked_fill(bad.unsqueeze(-1), 0.0)
            num_bar, den_bar, norm_parts = call.num_den_bars(out_bar, num, den, g0, g1, norm_params, bad)
            bars.add(call.n_map, norm_parts)
            den_bar = den_bar.unsqueeze(-1)  # [B, H, G, 1]
            fq_t = fq.detach().transpose(-1, -2)
            s_bar.add_(fq_t @ num_bar)
            z_bar.add_(fq_t @ den_bar)
            fq_bar = torch.baddbmm(
                (den_bar * z.transpose(-1, -2)).flatten(0, 1), num_bar.flatten(0, 1), s.transpose(-1, -2).flatten(0, 1)
            ).view_as(fq)  # num-bar S^T + den-bar z^T
            local = _local_grads((fq,), (fq_bar,), [leaf, *map_params], held)
            bars.put(0, g0, g1, local[0])
            bars.add(0, local[1:])
        for g0, g1 in call.spans(k.shape[2]):  # keys and values
            if held:
                kl, vl, fk, vg = ctx.held[2:]
            else:
                kl, vl = _leaf(k, g0, g1, need_k), _leaf(v, g0, g1, need_v)
                with torch.enable_grad(), call.replay(q.device):
                    fk, vg, _, _ = _key_group(call, kl, vl, g0, g1, ctx.c, grow=False)
            fk_bar = torch.baddbmm(
                z_bar.transpose(-1, -2).flatten(0, 1), vg.detach().flatten(0, 1), s_bar.transpose(-1, -2).flatten(0, 1)
            ).view_as(fk)  # v S-bar^T + z-bar^T (every row)
            local = _local_grads((fk, vg), (fk_bar, fk.detach() @ s_bar), [kl, vl, *map_params], held)
            bars.put(1, g0, g1, local[0])
            bars.put(2, g0, g1, local[1])
            bars.add(0, local[2:])
        return bars.result()


def _differentiable_backward(ctx: Any, out_bar: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    """The non-causal backward pass under ``create_graph=True``: the one-shot path
    (:func:`~kernelattn_core.engine.torch_backend.feature_attention_torch` on the whole
    sequence's features, then the normaliser) recomputed under autograd from the saved
    inputs, with the forward pass's buffers and mask, and differentiated with a graph, so
    that second derivatives reach ``q``, ``k``, ``v`` and the parameters. Equal to the
    grouped backward; its memory is the one-shot path's (``[B, H, N, D]`` features)."""
    call: _Call = ctx.call
    q, k, v, _s, _z, _num, _den, *params = ctx.saved_tensors
    with call.replay(q.device):
        num, den = feature_attention_torch(
            call.features(q, True),
            call.key_features(k, 0, k.shape[2]),
            v.to(call.dtype),
            log_space=call.log_space,
            causal=False,
            key_padding_mask=call.key_padding_mask,
        )
        outs = (num, den) if call.normalizer is None else (call.normalizer.normalize(num, den),)
    inputs = [q, k, v, *params]
    wanted = [t for t, w in zip(inputs, ctx.needs_input_grad[1:]) if w]
    got = iter(torch.autograd.grad(outs, wanted, out_bar, create_graph=True, allow_unused=True))
    bars = []
    for j, (t, w) in enumerate(zip(inputs, ctx.needs_input_grad[1:])):
        g = next(got) if w else None
        bars.append(torch.zeros_like(t) if w and g is None and j < 3 else g)
    return (None, *bars)


def _safe(c: torch.Tensor) -> torch.Tensor:
    """``c`` where finite, else 0 (every key padded: the features are 0 whatever ``c``)."""
    return torch.where(torch.isfinite(c), c, torch.zeros_like(c))


def _key_group(
    call: _Call, k: torch.Tensor, v: torch.Tensor, g0: int, g1: int, c: torch.Tensor, *, grow: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Key features ``[B, H, G, D]`` and values of one key group, padded keys and values 0
    whatever they hold, and the stabiliser ``c`` ``[B, H, 1, 1]`` they are stated at; keys
    whose features or values are not finite are removed too
    (:func:`~kernelattn_core.engine.torch_backend.quarantine_keys`), and the ``[B, H]`` flag
    of the heads that held one is returned (``None`` when none did).

    In log space the features are :math:`e^{l_k - c}`. With ``grow`` (the forward pass),
    ``c`` is the running maximum and first grows to :math:`\\max(c, \\max l_k)`; without
    (the backward pass) it is the final maximum, used as it is.
    """
    lk = call.key_features(k, g0, g1)
    v = v.to(call.dtype)
    mask = call.mask(g0, g1)
    if mask is not None:  # removed before any product, whatever they hold
        pad = mask[:, None, :, None]
        v = v.masked_fill(pad, 0.0)
        lk = lk.masked_fill(pad, float("-inf") if call.log_space else 0.0)
    lk, v, top, bad = quarantine_keys(lk, v, call.log_space)
    if not call.log_space:
        return lk, v, c, bad
    if grow:
        c = torch.maximum(c, top.amax(-1)[..., None, None])  # type: ignore[union-attr]
    return (lk - _safe(c)).exp(), v, c, bad


def _bad_output_rows(num: torch.Tensor, den: torch.Tensor, g0: int, g1: int) -> torch.Tensor | None:
    """``[B, H, G]`` rows ``[g0, g1)`` whose forward output is not finite (quarantined rows
    set to NaN, or a product that overflowed), or ``None``: they send no gradient back
    (their gradient would be :math:`0 \\cdot \\mathrm{NaN}`). One reduction decides."""
    d = den[:, :, g0:g1]
    n = num[:, :, g0:g1]
    if bool(torch.isfinite(d.sum() + n.sum())):
        return None
    bad = ~(torch.isfinite(d) & finite_rows(n))
    return bad if bool(bad.any()) else None


def _probe(fm: Any, q: torch.Tensor) -> None:
    """The map's features of no position of ``q``: builds an unbuilt map and runs its
    checks of ``q``'s shape without computing anything. A refusal that names the empty
    slice (``x``, shape ``[B, H, 0, d]``) is re-raised naming the caller's ``q`` and its
    shape (a map built for another ``num_heads``)."""
    empty = q[:, :, :0]
    try:
        fm.raw_features(empty, query=True)
    except InputError as err:
        msg, shown = str(err), str(tuple(empty.shape))
        if shown not in msg:
            raise
        msg = msg.replace(shown, str(tuple(q.shape)))
        if msg.startswith("x: "):
            msg = "q: " + msg[3:]
        raise type(err)(msg) from None


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
    normalizer: Any | None = None,
) -> tuple[torch.Tensor, ...]:
    """Numerator ``[B, H, N, dv]`` and denominator ``[B, H, N]`` of feature-map attention,
    computed in position groups with the features made per group (module docstring); or,
    with a ``normalizer``, the normalised output ``(out,)``.

    Equal to :func:`~kernelattn_core.engine.torch_backend.feature_attention_torch` on the
    features of ``scale * q`` and ``scale * k`` (then ``normalizer.normalize``), on
    outputs and gradients, with or without autograd. Computed in
    :func:`~kernelattn_core.engine.chunked.compute_dtype` (float32 for half
    inputs) with autocast off.

    Parameters
    ----------
    feature_map : FeatureMap
        Built and prepared; its ``raw_features`` are called per group, and gradients
        reach its trainable ``parameters()``.
    q, k : Tensor ``[B, H, N, d]``, ``[B, H, M, d]``
        Queries and keys (scaled by ``scale`` on the way in).
    v : Tensor ``[B, H, M, dv]``
    causal : bool
    key_padding_mask : Tensor ``[B, M]`` of bool, optional
        ``True`` marks a padded key.
    chunk_size : int, optional
        Positions per chunk of the causal core (default
        :func:`~kernelattn_core.engine.chunked.default_chunk`).
    group : int, optional
        Positions per group (default: :func:`group_length`, or the whole call for a
        training call of at most :data:`SHORT_TRAINING` positions); causal groups are
        rounded up to a multiple of the chunk length.
    scale : float
        Factor applied to ``q`` and ``k`` group by group before the features (the
        estimator's :math:`\\sqrt{s}`: no scaled copy of the whole inputs is made).
    normalizer : Normalizer, optional
        Its :meth:`~kernelattn_core.interfaces.Normalizer.normalize` (row by row) is
        applied per group, its backward too, so neither ``num``'s gradient nor the
        normaliser's temporaries are ever whole-sequence tensors; gradients reach its
        trainable ``parameters()``.

    Returns
    -------
    ``(num, den)``, or ``(out,)`` with a ``normalizer``.
    """
    fm = feature_map
    if fm.built:  # named with q's own shape, not the empty slice's below
        check_head_dim("q", q, fm.head_dim)
    _probe(fm, q)  # builds an unbuilt map, checks d (naming q)
    chunk = chunk_size or default_chunk(v.shape[-1])
    dtype = compute_dtype(q.dtype)
    b, h = q.shape[:2]
    grad = torch.is_grad_enabled()
    map_params = [p for p in fm.parameters() if p.requires_grad] if grad else []
    norm_params = [p for p in normalizer.parameters() if p.requires_grad] if grad and normalizer is not None else []
    keep = grad and any(t.requires_grad for t in (q, k, v, *map_params, *norm_params))
    g = group or group_length(b * h, fm.feature_dim, torch.finfo(dtype).bits // 8, chunk)
    longest = max(q.shape[2], k.shape[2])
    if group is None and keep and longest <= SHORT_TRAINING:
        g = max(g, longest)  # a short training call: one group (SHORT_TRAINING)
    if causal:
        g = -(-g // chunk) * chunk  # groups hold whole chunks
    mask = key_padding_mask.clone() if keep and key_padding_mask is not None else key_padding_mask
    # every buffer as this forward pass sees it, for the backward-time recompute: floating
    # ones copied (redraws and statistics change them in place), the others (rmfa's integer
    # degrees) by reference -- a redraw assigns new ones, and the map's caches keyed on the
    # buffer object (rmfa's weights, a weights override) stay valid
    buffers = {name: (t.clone() if t.is_floating_point() else t) for name, t in fm.named_buffers()} if keep else {}
    call = _Call(fm, fm.log_space, mask, chunk, g, dtype, float(scale), normalizer, keep, len(map_params), buffers)
    fn = _GroupedCausal if causal else _GroupedNonCausal
    with autocast_off(q.device):
        out = fn.apply(call, q, k, v, *map_params, *norm_params)
    return out if isinstance(out, tuple) else (out,)
