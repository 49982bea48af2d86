"""Sequence parallelism (context parallelism) of feature-map attention over ``torch.distributed``.

The sequence is split in rank order over the ranks of a process group: rank ``r`` holds
positions :math:`[o_r, o_r + N_r)` of ``q``, ``k``, ``v`` (and of the key padding mask).
Feature-map attention only needs, from the other ranks, the sums their keys contribute:

.. math:: S = \\sum_j \\hat\\phi_k(k_j) v_j^\\top \\in \\mathbb{R}^{D \\times d_v}, \\qquad
          z = \\sum_j \\hat\\phi_k(k_j) \\in \\mathbb{R}^D,

so each rank sends :math:`O(D d_v)` numbers, whatever the sequence length.

**Causal.** Each rank computes its local causal attention with the chosen backend (its
chunks), and the summary :math:`(S_r, z_r, m_r)` of its keys, stated at its last prefix
maximum :math:`m_r` (log-space maps). A chain of point-to-point messages passes the
causal state along the ranks: rank ``r`` receives the state of all earlier ranks
:math:`(S_{<r}, z_{<r}, m_{<r})`, combines it with its own,

.. math:: m' = \\max(m_{<r}, m_r), \\quad
          S_{\\le r} = S_{<r} e^{m_{<r} - m'} + S_r e^{m_r - m'},

and sends the result to rank ``r + 1``. Query :math:`t` of rank ``r`` then adds the
earlier ranks' contribution, restated at the global prefix maximum
:math:`m_t = \\max(m_{<r}, m^{\\text{loc}}_t)`:

.. math:: \\mathrm{num}_t = \\mathrm{num}^{\\text{loc}}_t e^{m^{\\text{loc}}_t - m_t}
          + \\hat\\phi_q(q_t)^\\top S_{<r}\\, e^{m_{<r} - m_t}

(and the same for the denominator). This is exactly the single-process recurrence with
the rank boundary as one more chunk boundary. Backward, the gradient of the received
state travels the chain the other way (last rank first), in a custom autograd function
with the matching sends and receives; everything else is ordinary autograd, so
gradients reach ``q``, ``k``, ``v`` and learnable map parameters on every rank.

**Non-causal.** Every query sees every key: the summaries are summed over the group
(``all_reduce``, stated at the group's maximum key log-feature) and each rank applies
them to its queries; the gradient of the sum is summed back the same way.

Requirements: every rank holds the same feature map (the map's buffers are broadcast
from the group's first rank on each call, so random features agree); normalisers whose
``pre`` uses statistics of the sequence, and data-adapted maps in training mode (CEXP),
see only their rank's positions.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..errors import InputError
from ..validation import check_key_padding_mask, check_qkv
from .backends import Problem, attend_features, select_backend
from .torch_backend import query_side


def _safe_factor(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:math:`e^{a - b}` for :math:`a \\le b`, and 0 where ``a`` is :math:`-\\infty` (nothing stated yet)."""
    finite = torch.isfinite(a)
    b = torch.where(torch.isfinite(b), b, torch.zeros_like(b))
    return torch.where(finite, (torch.where(finite, a, b) - b).exp(), torch.zeros_like(a))


def _global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class _CausalChain(torch.autograd.Function):
    """``(S_loc, z_loc, m_loc) -> (S_in, z_in, m_in)``: the state of all earlier ranks.

    Forward receives from the previous rank and sends the combined state to the next;
    backward receives the gradient of the combined state from the next rank and sends
    the gradient of the received state to the previous one.
    """

    @staticmethod
    def forward(ctx, s_loc, z_loc, m_loc, group):  # type: ignore[override]
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        s_in, z_in = torch.zeros_like(s_loc), torch.zeros_like(z_loc)
        m_in = torch.full_like(m_loc, -math.inf)
        if rank > 0:
            src = _global_rank(group, rank - 1)
            for t in (s_in, z_in, m_in):
                dist.recv(t, src=src, group=group)
        m_out = torch.maximum(m_in, m_loc)
        a, b = _safe_factor(m_in, m_out), _safe_factor(m_loc, m_out)  # [B, H, 1]
        if rank < world - 1:
            s_out = s_in * a.unsqueeze(-1) + s_loc * b.unsqueeze(-1)
            z_out = z_in * a + z_loc * b
            dst = _global_rank(group, rank + 1)
            for t in (s_out, z_out, m_out):
                dist.send(t.contiguous(), dst=dst, group=group)
        ctx.group, ctx.rank, ctx.world, ctx.shapes = group, rank, world, (s_loc.shape, z_loc.shape)
        ctx.save_for_backward(a, b)
        ctx.mark_non_differentiable(m_in)
        return s_in, z_in, m_in

    @staticmethod
    def backward(ctx, g_s_in, g_z_in, _g_m):  # type: ignore[override]
        (a, b) = ctx.saved_tensors
        group, rank, world = ctx.group, ctx.rank, ctx.world
        s_shape, z_shape = ctx.shapes
        g_s_in = b.new_zeros(s_shape) if g_s_in is None else g_s_in
        g_z_in = b.new_zeros(z_shape) if g_z_in is None else g_z_in
        g_s_out, g_z_out = b.new_zeros(s_shape), b.new_zeros(z_shape)
        if rank < world - 1:
            src = _global_rank(group, rank + 1)
            for t in (g_s_out, g_z_out):
                dist.recv(t, src=src, group=group)
        if rank > 0:
            dst = _global_rank(group, rank - 1)
            dist.send((g_s_in + g_s_out * a.unsqueeze(-1)).contiguous(), dst=dst, group=group)
            dist.send((g_z_in + g_z_out * a).contiguous(), dst=dst, group=group)
        return g_s_out * b.unsqueeze(-1), g_z_out * b, None, None


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the gradient of a sum is summed back."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        out = x.clone().contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        g = g.clone().contiguous()
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        return g, None


def sequence_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    estimator: torch.nn.Module,
    *,
    causal: bool = True,
    key_padding_mask: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Feature-map attention of a sequence split over the ranks of ``group``.

    Every rank calls this with its own shard; the shards, concatenated in rank order,
    form the sequence. The result on each rank equals the rows of its shard in
    ``estimator(q_all, k_all, v_all, causal=causal)`` on one process (to rounding),
    and so do the gradients.

    Parameters
    ----------
    q, k, v : Tensor ``[B, H, N_r, d]``, ``[B, H, M_r, d]``, ``[B, H, M_r, dv]``
        This rank's positions (``N_r == M_r`` when causal; shards may differ in length).
    estimator : FeatureMapAttention
        The same configuration on every rank (its map's buffers are broadcast from the
        group's first rank).
    causal : bool
    key_padding_mask : Tensor ``[B, M_r]`` of bool, optional
        This rank's part of the padding mask (``True`` = padded).
    group : ProcessGroup, optional
        The default group when ``None``.
    backend : str
        The backend of the local chunks (``"auto"``, ``"torch"``, ``"triton"``).

    Returns
    -------
    Tensor ``[B, H, N_r, dv]``: this rank's rows of the output, in the dtype of ``v``.
    """
    from ..builtins.estimators import FeatureMapAttention

    if not isinstance(estimator, FeatureMapAttention):
        raise InputError(f"estimator: expected a FeatureMapAttention, got {type(estimator).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise InputError("group: torch.distributed is not initialised (call dist.init_process_group first)")
    check_qkv(q, k, v)
    mask = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
    if causal and q.shape[2] != k.shape[2]:
        raise InputError(f"causal: expected as many local queries as keys, got N = {q.shape[2]}, M = {k.shape[2]}")
    s = estimator.scale if estimator.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q, k = estimator.normalizer.pre(q * math.sqrt(s), k * math.sqrt(s), key_padding_mask=mask)
    fm = estimator.feature_map
    if not fm.built:
        estimator.redraw_policy.initial(fm, q.shape[-1])
    estimator.redraw_policy.before_forward(fm, estimator.training)
    src = _global_rank(group, 0)
    with torch.no_grad():
        for buf in fm.buffers():
            dist.broadcast(buf, src=src, group=group)  # one set of random features
    fm.prepare(q, k, key_padding_mask=mask, causal=causal)
    log = fm.log_space
    phi_k = fm.raw_features(k, query=False)  # [B, H, M_r, D]
    dtype = phi_k.dtype
    vv = v.to(dtype)
    if mask is not None:
        vv = vv.masked_fill(mask[:, None, :, None], 0.0)
    pad = None if mask is None else mask[:, None, :, None]  # [B, 1, M_r, 1]
    if log:
        lk = phi_k if pad is None else phi_k.masked_fill(pad, -math.inf)
    else:
        lk = phi_k if pad is None else phi_k.masked_fill(pad, 0.0)
    if not causal:
        return _non_causal(estimator, fm, q, lk, vv, log, group).to(v.dtype)
    problem = Problem(q.device, q.dtype, log, True, torch.is_grad_enabled())
    chosen = select_backend(problem, None if backend == "auto" else backend)
    estimator.last_backend = chosen.name
    num, den = attend_features(
        chosen, fm, q, k, v, causal=True, key_padding_mask=mask, chunk_size=estimator.chunk_size
    )  # local chunks: [B, H, N_r, dv], [B, H, N_r]
    fq = query_side(fm.raw_features(q, query=True), log)  # [B, H, N_r, D]
    if log:
        m_loc = lk.detach().amax(-1).cummax(-1).values  # [B, H, N_r] local prefix maximum
        m_last = m_loc[..., -1:]  # [B, H, 1]
        fk = (lk - torch.where(torch.isfinite(m_last), m_last, torch.zeros_like(m_last)).unsqueeze(-1)).exp()
    else:
        m_loc = torch.zeros(lk.shape[:3], dtype=dtype, device=lk.device)
        m_last = m_loc[..., -1:]
        fk = lk
    s_loc = fk.transpose(-1, -2) @ vv  # [B, H, D, dv]
    z_loc = fk.sum(-2)  # [B, H, D]
    s_in, z_in, m_in = _CausalChain.apply(s_loc, z_loc, m_last.contiguous(), group)
    m_t = torch.maximum(m_in, m_loc)  # [B, H, N_r] global prefix maximum
    own = _safe_factor(m_loc, m_t)  # the backend's outputs are stated at m_loc
    past = _safe_factor(m_in.expand_as(m_t), m_t)
    num = num.to(dtype) * own.unsqueeze(-1) + (fq @ s_in) * past.unsqueeze(-1)
    den = den.to(dtype) * own + (fq @ z_in.unsqueeze(-1)).squeeze(-1) * past
    out = estimator.normalizer.post(estimator.normalizer.normalize(num, den))
    return out.to(v.dtype)


def _non_causal(estimator, fm, q, lk, vv, log, group):  # type: ignore[no-untyped-def]
    """All keys of all ranks for every query: the summaries summed over the group."""
    fq = query_side(fm.raw_features(q, query=True), log)  # [B, H, N_r, D]
    if log:
        c = lk.detach().amax(dim=(-2, -1), keepdim=True)  # [B, H, 1, 1]
        dist.all_reduce(c, op=dist.ReduceOp.MAX, group=group)
        c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))  # every key padded
        fk = (lk - c).exp()
    else:
        fk = lk
    s_all = _AllReduceSum.apply(fk.transpose(-1, -2) @ vv, group)  # [B, H, D, dv]
    z_all = _AllReduceSum.apply(fk.sum(-2), group)  # [B, H, D]
    num, den = fq @ s_all, (fq @ z_all.unsqueeze(-1)).squeeze(-1)
    estimator.last_backend = "torch"
    return estimator.normalizer.post(estimator.normalizer.normalize(num, den))
