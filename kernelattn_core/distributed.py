"""Sequence parallelism (context parallelism) of feature-map attention over ``torch.distributed``.

The sequence is split in rank order over the ranks of a process group: rank ``r`` holds
positions :math:`[o_r, o_r + N_r)` of ``q``, ``k``, ``v`` (and of the key padding mask);
a rank may hold none (:math:`N_r = 0`). Feature-map attention only needs, from the other
ranks, the sums their keys contribute:

.. math:: S = \\sum_j \\hat\\phi_k(k_j) [v_j, 1]^\\top \\in \\mathbb{R}^{D \\times (d_v + 1)}

(the last column is the normaliser's sum), so each rank sends :math:`O(D d_v)` numbers,
whatever the sequence length.

**Causal.** Each rank computes its local causal attention with the chosen backend (its
chunks), and the summary :math:`(S_r, m_r)` of its keys, stated at its last prefix
maximum :math:`m_r` (log-space maps). A chain of point-to-point messages passes the
causal state along the ranks: rank ``r`` receives the state of all earlier ranks
:math:`(S_{<r}, m_{<r})`, combines it with its own,

.. math:: m' = \\max(m_{<r}, m_r), \\quad
          S_{\\le r} = S_{<r} e^{m_{<r} - m'} + S_r e^{m_r - m'},

and sends the result to rank ``r + 1``. Query :math:`t` of rank ``r`` then adds the
earlier ranks' contribution, restated at the global prefix maximum
:math:`m_t = \\max(m_{<r}, m^{\\text{loc}}_t)`:

.. math:: (\\mathrm{num}_t, \\mathrm{den}_t) = (\\mathrm{num}, \\mathrm{den})^{\\text{loc}}_t
          e^{m^{\\text{loc}}_t - m_t} + \\hat\\phi_q(q_t)^\\top S_{<r}\\, e^{m_{<r} - m_t} .

This is exactly the single-process recurrence with the rank boundary as one more chunk
boundary. Backward, the gradient of the received state travels the chain the other way
(last rank first), in a custom autograd function with the matching sends and receives;
everything else is ordinary autograd, so gradients reach ``q``, ``k``, ``v`` and learnable
map and normaliser parameters on every rank (a parameter's gradient is the sum of the
ranks' gradients, as data parallelism sums them).

**Non-causal.** Every query sees every key: the summaries are summed over the group
(``all_reduce``, stated at the group's maximum key log-feature) and each rank applies
them to its queries; the gradient of the sum is summed back the same way.

**Non-finite values** are quarantined as on one process
(:mod:`kernelattn_core.engine.torch_backend`): a padded key is set to 0 before the map; a
key or value that is not finite is dropped from every product, local and sent, and a
``poisoned`` flag travels with the state (causal: to every later row of every later rank;
non-causal: to every row of every rank); a non-finite query row is kept out of the
products. The rows that see such a value are NaN, and no gradient on any rank, learned
parameters included, is NaN because of it: outputs and every gradient equal one
process's, finite or not.

**Agreement, errors and time.** Before any collective that depends on shapes, every rank
checks its own inputs and the ranks exchange one small record (``all_gather`` of 2 KiB):
the estimator's class, feature map, normaliser, budget and buffers, ``B``, ``H``, ``d``,
``d_v``, dtype, ``causal``, training and gradient mode. A rank whose inputs are bad, or
ranks that disagree, make **every** rank raise at once: the bad rank its own error, the
others :class:`SequenceParallelError` naming it; a disagreement is an
:class:`~kernelattn_core.errors.InputError` naming each field and each rank's value. A
second exchange after the local computation does the same for an error raised there.
Every collective of a call (the exchanges, the broadcast of the map's buffers, the chain
or the all-reduce, and their backward) waits at most ``timeout`` seconds
(:data:`DEFAULT_TIMEOUT_S` by default); past it the waiting rank raises
:class:`SequenceParallelTimeout`. That covers a rank that never makes the call (it raised
elsewhere), never runs the backward pass, or died. After a timeout the process group may
still hold the unmatched operation: destroy it and make a new one before the next
collective.

Requirements: every rank holds the same feature map configuration (the map's buffers and
the redraw seed are broadcast from the group's first rank on each call, so random
features agree); normalisers whose ``pre`` uses statistics of the sequence see only
their rank's positions; data-adapted maps in training mode (CEXP, ``sync=True``) pool
their statistics over the *default* group (with a subgroup, pass ``sync=False``). The
collectives run on CPU tensors under gloo and on the inputs' device under NCCL; the
timeouts are tested with gloo on 127.0.0.1 (``tests/test_sequence_parallel.py``).
"""

from __future__ import annotations

import json
import math
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .builtins.estimators import FeatureMapAttention
from .engine.backends import Problem, attend_features, select_backend
from .engine.chunked import prepare_causal, query_side
from .engine.torch_backend import non_finite_query_rows, quarantine_keys
from .errors import InputError, KernelAttnError
from .validation import check_key_padding_mask, check_qkv

#: seconds every collective of :func:`sequence_parallel_attention` waits at most by default
DEFAULT_TIMEOUT_S = 300.0

#: bytes of one rank's record in the agreement exchange
_RECORD_BYTES = 2048


class SequenceParallelError(KernelAttnError, RuntimeError):
    """Another rank of a sequence-parallel call failed (the message names it and its error),
    or a collective of the call failed."""


class SequenceParallelTimeout(SequenceParallelError, TimeoutError):
    """A collective of a sequence-parallel call waited more than its ``timeout``: another
    rank did not make the call, did not run its backward pass, or died."""


# ---------------------------------------------------------------------------- communication
class _Comm:
    """The group, this rank's place in it, the device collectives run on, and the deadline
    of every wait (``timeout`` seconds from its start)."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: float, device: torch.device) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = timeout
        nccl = dist.get_backend(group) == "nccl"
        self.device = device if nccl else torch.device("cpu")

    def global_rank(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def wait(self, work: Any, what: str) -> None:
        """Wait for ``work`` at most ``timeout`` seconds; name the operation otherwise."""
        start = time.monotonic()
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            waited = time.monotonic() - start
            text = str(exc)
            if "timed out" in text.lower() or "timeout" in text.lower() or waited >= 0.95 * self.timeout:
                raise SequenceParallelTimeout(
                    f"sequence_parallel_attention: rank {self.rank} waited {waited:.1f} s (timeout={self.timeout:g}) "
                    f"for {what}: another rank did not make the same call (it raised elsewhere, skipped the call "
                    "or its backward pass, or died). The process group may hold the unmatched operation: "
                    "re-create it before the next collective"
                ) from exc
            raise SequenceParallelError(
                f"sequence_parallel_attention: rank {self.rank}: {what} failed: {text.splitlines()[0][:300]}"
            ) from exc

    def to_dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(self.device).contiguous()

    def all_gather_records(self, record: dict[str, Any], what: str) -> list[dict[str, Any]]:
        raw = json.dumps(record, default=str).encode()
        if len(raw) > _RECORD_BYTES:  # only an error message can be this long: shorten it
            record = {**record, "error": str(record.get("error"))[:300]}
            raw = json.dumps(record, default=str).encode()[:_RECORD_BYTES]
        buf = torch.zeros(_RECORD_BYTES, dtype=torch.uint8)
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        buf = buf.to(self.device)
        out = [torch.empty_like(buf) for _ in range(self.world)]
        self.wait(dist.all_gather(out, buf, group=self.group, async_op=True), what)
        records = []
        for t in out:
            data = bytes(t.cpu().tolist()).rstrip(b"\0")
            try:
                records.append(json.loads(data.decode()))
            except ValueError:  # a truncated record
                records.append({"error": "a record that could not be read (truncated)"})
        return records

    def all_reduce(self, t: torch.Tensor, op: Any, what: str) -> torch.Tensor:
        out = self.to_dev(t).clone()
        self.wait(dist.all_reduce(out, op=op, group=self.group, async_op=True), what)
        return out.to(t.device)

    def send(self, t: torch.Tensor, dst: int, what: str) -> None:
        self.wait(dist.isend(self.to_dev(t), dst=self.global_rank(dst), group=self.group), what)

    def recv(self, like: torch.Tensor, src: int, what: str) -> torch.Tensor:
        buf = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        self.wait(dist.irecv(buf, src=self.global_rank(src), group=self.group), what)
        return buf.to(like.device)


def _check_records(comm: _Comm, records: list[dict[str, Any]], own_error: BaseException | None, stage: str) -> None:
    """Raise on every rank if a rank failed (its own error on it, a
    :class:`SequenceParallelError` naming it on the others) or the ranks disagree (an
    :class:`~kernelattn_core.errors.InputError` naming the fields and every rank's value)."""
    failed = [(r, rec["error"]) for r, rec in enumerate(records) if rec.get("error")]
    if own_error is not None:
        raise own_error
    if failed:
        listed = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        raise SequenceParallelError(f"sequence_parallel_attention: {stage} failed on another rank ({listed})")
    fields = [f for f in records[0] if f != "error" and not f.startswith("_")]
    differ = [f for f in fields if any(rec.get(f) != records[0].get(f) for rec in records)]
    if differ:
        parts = [f"{f}: " + ", ".join(f"rank {r} {rec.get(f)!r}" for r, rec in enumerate(records)) for f in differ]
        raise InputError(
            "sequence_parallel_attention: the ranks disagree on " + "; ".join(parts) + " (every rank must call it with "
            "the same estimator configuration, head and value widths, batch and heads, dtype and flags)"
        )


def _record(estimator: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: object) -> dict[str, Any]:
    """What every rank must agree on (local lengths ``N_r``, ``M_r`` may differ)."""
    fm = estimator.feature_map
    return {
        "estimator": type(estimator).__qualname__,
        "feature_map": fm.name,
        "normalizer": getattr(estimator.normalizer, "name", type(estimator.normalizer).__qualname__),
        "num_features": fm.num_features,
        "scale": estimator.scale,
        "causal": causal,
        "batch_and_heads": list(q.shape[:2]),
        "head_dim": q.shape[-1],
        "value_dim": v.shape[-1],
        "dtype": str(q.dtype),
        "training": estimator.training,
        # a backward pass will follow: every rank must run the chain's (or the sum's) backward
        "needs_grad": _needs_grad(estimator, q, k, v),
        # what follows from the above (last, so that a message names the cause first)
        "buffers": sorted((n, list(b.shape), str(b.dtype)) for n, b in fm.named_buffers()),
        "parameters": sorted((n, list(p.shape)) for n, p in estimator.named_parameters()),
    }


def _needs_grad(estimator: Any, *inputs: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(
        t.requires_grad for t in (*inputs, *estimator.parameters(), *estimator.normalizer.parameters())
    )


# ---------------------------------------------------------------------------- autograd pieces
def _safe_factor(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:math:`e^{a - b}` for :math:`a \\le b`, and 0 where ``a`` is :math:`-\\infty` (nothing stated yet)."""
    finite = torch.isfinite(a)
    b = torch.where(torch.isfinite(b), b, torch.zeros_like(b))
    return torch.where(finite, (torch.where(finite, a, b) - b).exp(), torch.zeros_like(a))


class _CausalChain(torch.autograd.Function):
    """``(S_loc, m_loc, poisoned_loc) -> (S_in, m_in, poisoned_in)``: the state of all
    earlier ranks (``S [B, H, D, dv + 1]``, ``m [B, H, 1]``, ``poisoned [B, H]``).

    Forward receives one packed message from the previous rank and sends the combined
    state to the next; backward receives the gradient of the combined state from the
    next rank and sends the gradient of the received state to the previous one. The
    poisoned flag (a non-finite key consumed) is or-ed along the chain.
    """

    @staticmethod
    def forward(ctx, s_loc, m_loc, p_loc, comm):  # type: ignore[no-untyped-def, override]
        rank, world = comm.rank, comm.world
        b, h = s_loc.shape[:2]
        s_in, m_in = torch.zeros_like(s_loc), torch.full_like(m_loc, -math.inf)
        p_in = torch.zeros_like(p_loc)
        sizes = [s_loc.numel(), m_loc.numel(), p_loc.numel(), 1]  # the last: never an empty message
        like = s_loc.new_zeros(sum(sizes))
        if rank > 0:
            msg = comm.recv(like, rank - 1, f"the causal state from rank {rank - 1}")
            s_raw, m_raw, p_raw, _ = msg.split(sizes)
            s_in, m_in, p_in = s_raw.view_as(s_loc), m_raw.view_as(m_loc), p_raw.view(b, h) > 0
        m_out = torch.maximum(m_in, m_loc)
        a, c = _safe_factor(m_in, m_out), _safe_factor(m_loc, m_out)  # [B, H, 1]
        if rank < world - 1:
            s_out = s_in * a.unsqueeze(-1) + s_loc * c.unsqueeze(-1)
            packed = torch.cat([s_out.flatten(), m_out.flatten(), (p_in | p_loc).to(s_out.dtype).flatten(), like[:1]])
            comm.send(packed, rank + 1, f"sending the causal state to rank {rank + 1}")
        ctx.comm, ctx.shape = comm, s_loc.shape
        ctx.save_for_backward(a, c)
        ctx.mark_non_differentiable(m_in, p_in)
        return s_in, m_in, p_in

    @staticmethod
    def backward(ctx, g_s_in, _g_m, _g_p):  # type: ignore[no-untyped-def, override]
        (a, c) = ctx.saved_tensors
        comm, shape = ctx.comm, ctx.shape
        g_s_in = a.new_zeros(shape) if g_s_in is None else g_s_in
        g_s_out = a.new_zeros(shape)
        if comm.rank < comm.world - 1:
            got = comm.recv(g_s_out.flatten(), comm.rank + 1, f"the state's gradient from rank {comm.rank + 1}")
            g_s_out = got.view(shape)
        if comm.rank > 0:
            g_prev = g_s_in + g_s_out * a.unsqueeze(-1)
            comm.send(g_prev.flatten(), comm.rank - 1, f"sending the state's gradient to rank {comm.rank - 1}")
        return g_s_out * c.unsqueeze(-1), None, None, None


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the gradient of a sum is summed back."""

    @staticmethod
    def forward(ctx, x, comm):  # type: ignore[no-untyped-def, override]
        ctx.comm = comm
        return comm.all_reduce(x, dist.ReduceOp.SUM, "the sum of the key summaries")

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        return ctx.comm.all_reduce(g, dist.ReduceOp.SUM, "the sum of the summaries' gradients"), None


# ---------------------------------------------------------------------------- the call
def _check_timeout(timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout <= 0:
        raise InputError(f"timeout: expected a positive finite number of seconds, got {timeout!r}")
    return float(timeout)


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
    timeout: float = DEFAULT_TIMEOUT_S,
) -> torch.Tensor:
    """Feature-map attention of a sequence split over the ranks of ``group``.

    Every rank calls this with its own shard; the shards, concatenated in rank order,
    form the sequence. The result on each rank equals the rows of its shard in
    ``estimator(q_all, k_all, v_all, causal=causal)`` on one process (to rounding),
    and so do the gradients, non-finite values included (module docstring).

    Parameters
    ----------
    q, k, v : Tensor ``[B, H, N_r, d]``, ``[B, H, M_r, d]``, ``[B, H, M_r, dv]``
        This rank's positions (``N_r == M_r`` when causal; shards may differ in length,
        and be empty).
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
    timeout : float
        Seconds every collective of the call (forward and backward) waits at most
        (:data:`DEFAULT_TIMEOUT_S`, 300); past it :class:`SequenceParallelTimeout` is
        raised on the waiting rank.

    Returns
    -------
    Tensor ``[B, H, N_r, dv]``: this rank's rows of the output, in the dtype of ``v``.

    Raises
    ------
    InputError
        On every rank, when this rank's inputs are bad (on it; the others raise
        :class:`SequenceParallelError` naming it) or when the ranks disagree (naming the
        field and every rank's value).
    SequenceParallelError, SequenceParallelTimeout
        See the module docstring.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise InputError("group: torch.distributed is not initialised (call dist.init_process_group first)")
    try:
        wait_s = _check_timeout(timeout)
        own_error: BaseException | None = None
    except InputError as exc:  # the exchange still runs (with the default), then every rank raises
        wait_s, own_error = DEFAULT_TIMEOUT_S, exc
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    comm = _Comm(group, wait_s, device)
    record: dict[str, Any] = {"error": None}
    mask = None
    if own_error is None:
        try:  # this rank's own checks; the ranks then compare what they got
            if not isinstance(estimator, FeatureMapAttention):
                raise InputError(f"estimator: expected a FeatureMapAttention, got {type(estimator).__name__}")
            check_qkv(q, k, v)
            mask = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
            if not isinstance(causal, bool):
                raise InputError(f"causal: expected a bool, got {causal!r}")
            if causal and q.shape[2] != k.shape[2]:
                raise InputError(
                    f"causal: expected as many local queries as keys, got N = {q.shape[2]}, M = {k.shape[2]}"
                )
            if backend != "auto":
                select_backend(Problem(q.device, q.dtype, estimator.feature_map.log_space, causal, False), backend)
            _build(estimator, q.shape[-1])
            record.update(_record(estimator, q, k, v, causal))
        except Exception as exc:  # reported to every rank before any shape-dependent collective
            own_error = exc
    if own_error is not None:
        record["error"] = f"{type(own_error).__name__}: {own_error}"
    _check_records(comm, comm.all_gather_records(record, "the agreement exchange"), own_error, "the input check")
    _broadcast_state(comm, estimator)
    own_error = None
    try:
        local = _local(estimator, q, k, v, mask, causal, backend, bool(record["needs_grad"]))
    except Exception as exc:
        own_error, local = exc, None
    status = {"error": None if own_error is None else f"{type(own_error).__name__}: {own_error}"}
    _check_records(comm, comm.all_gather_records(status, "the status exchange"), own_error, "the local computation")
    assert local is not None
    out = _causal_rows(comm, local) if causal else _non_causal_rows(comm, local)
    out = estimator._post(estimator.normalizer.normalize(*out)).to(v.dtype)
    if out.numel() == 0:  # an empty shard: joined to the graph (zero gradients), as an empty call is
        out = out + (q.flatten()[:0].sum() + k.flatten()[:0].sum() + v.flatten()[:0].sum()).to(out.dtype)
    return out


def _build(estimator: Any, head_dim: int) -> None:
    """Build the map (draw 0) and advance the redraw schedule, without the redraw policy's
    own seed agreement (an unbounded collective): the group's first rank's buffers and
    seed are broadcast right after the agreement exchange instead."""
    policy, fm = estimator.redraw_policy, estimator.feature_map
    policy._seed_settled = True  # the seed is broadcast below, under the call's timeout
    if not fm.built:
        policy.initial(fm, head_dim)
    policy.before_forward(fm, estimator.training)


def _broadcast_state(comm: _Comm, estimator: Any) -> None:
    """The map's buffers and the redraw seed of the group's first rank, on every rank
    (one random draw for the whole group)."""
    tensors = [*estimator.feature_map.buffers(), estimator.redraw_policy.seed]
    with torch.no_grad():
        for t in tensors:
            if t.numel() == 0:
                continue
            buf = comm.to_dev(t).clone()
            comm.wait(dist.broadcast(buf, src=comm.global_rank(0), group=comm.group, async_op=True), "a map buffer")
            t.copy_(buf.to(t.device))


class _Local:
    """One rank's part: features, the local attention and the key summary."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def _local(
    estimator: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    backend: str,
    needs_grad: bool,
) -> _Local:
    """Everything that needs no other rank: scaled and pre-transformed inputs, the local
    causal attention (causal) and the key summary, quarantined like one process. With
    ``needs_grad`` (agreed by every rank) the summary is part of the autograd graph even
    when nothing local needs its gradient, so that this rank's backward pass passes the
    other ranks' gradients on."""
    fm = estimator.feature_map
    root = estimator._input_root(q.shape[-1])
    q, k = estimator._pre(q * root, k * root, mask, causal)
    fm.prepare(q, k, key_padding_mask=mask, causal=causal)
    log = fm.log_space
    b, h, n, _ = q.shape
    m_keys, dv = k.shape[2], v.shape[-1]
    dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    width = fm.feature_dim
    kk = k if mask is None else k.masked_fill(mask[:, None, :, None], 0.0)  # padded keys never reach the map
    vv = v.to(dtype)

    def features(x: torch.Tensor, query: bool) -> torch.Tensor:  # [B, H, L, D]; an empty shard calls no map
        if x.shape[2] == 0:
            return x.new_zeros(*x.shape[:3], width, dtype=dtype)
        return fm.raw_features(x, query=query).to(dtype)

    if not causal:
        lk = features(kk, False)  # [B, H, M_r, D]
        if mask is not None:
            pad = mask[:, None, :, None]
            vv = vv.masked_fill(pad, 0.0)
            lk = lk.masked_fill(pad, -math.inf if log else 0.0)
        lk, vv, top, poisoned = quarantine_keys(lk, vv, log)
        top_bh = top.amax(-1) if (log and m_keys) else lk.new_full((b, h), -math.inf)  # type: ignore[union-attr]
        fq = query_side(features(q, True), log)  # [B, H, N_r, D]
        if needs_grad and not lk.requires_grad:
            lk = lk.detach().requires_grad_()
        return _Local(lk=lk, v=vv, top=top_bh, poisoned=poisoned, fq=fq, log=log, b=b, h=h, dv=dv)
    if n == 0:  # an empty shard: nothing local, the state passes through
        return _Local(
            num=vv.new_zeros(b, h, 0, dv),
            den=vv.new_zeros(b, h, 0),
            fq=vv.new_zeros(b, h, 0, width),
            s_loc=vv.new_zeros(b, h, width, dv + 1).requires_grad_(needs_grad),
            m_loc=vv.new_full((b, h, 1), -math.inf),
            m_rows=vv.new_full((b, h, 0), -math.inf),
            p_loc=torch.zeros(b, h, dtype=torch.bool, device=q.device),
            poison=None,
            log=log,
            dv=dv,
        )
    problem = Problem(q.device, q.dtype, log, True, torch.is_grad_enabled())
    chosen = select_backend(problem, None if backend == "auto" else backend)
    estimator.last_backend = chosen.name
    num, den = attend_features(
        chosen, fm, q, kk, v, causal=True, key_padding_mask=mask, chunk_size=estimator.chunk_size
    )  # local chunks: [B, H, N_r, dv], [B, H, N_r]
    prep = prepare_causal(features(q, True), features(kk, False), vv, log, mask, None)
    if log:  # the local keys restated at the shard's last prefix maximum
        m_end = prep.m_out  # [B, H, 1]; -inf without a key (then every fk is 0)
        safe_end = torch.where(torch.isfinite(m_end), m_end, torch.zeros_like(m_end))
        fk = prep.fk * (prep.m - safe_end).exp().unsqueeze(-1)  # type: ignore[operator]
        m_rows = prep.m_raw  # [B, H, N_r]
    else:
        m_end, fk = vv.new_zeros(b, h, 1), prep.fk
        m_rows = vv.new_zeros(b, h, n)
    s_loc = fk.transpose(-1, -2) @ prep.v1  # [B, H, D, dv + 1]
    if needs_grad and not s_loc.requires_grad:
        s_loc = s_loc.detach().requires_grad_()
    p_loc = prep.carried if prep.carried is not None else torch.zeros(b, h, dtype=torch.bool, device=q.device)
    return _Local(
        num=num.to(dtype),
        den=den.to(dtype),
        fq=prep.fq,
        s_loc=s_loc,
        m_loc=m_end.contiguous(),
        m_rows=m_rows,
        p_loc=p_loc,
        poison=prep.poison,
        log=log,
        dv=dv,
    )


def _causal_rows(comm: _Comm, loc: _Local) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's numerator and denominator: its local rows plus the earlier ranks'
    state, restated at the global prefix maximum; rows that see a non-finite value NaN."""
    s_in, m_in, p_in = _CausalChain.apply(loc.s_loc, loc.m_loc, loc.p_loc, comm)
    m_t = torch.maximum(m_in, loc.m_rows)  # [B, H, N_r]: the global prefix maximum
    own = _safe_factor(loc.m_rows, m_t)  # the backend's rows are stated at the local one
    past = _safe_factor(m_in.expand_as(m_t), m_t)
    before = loc.fq @ s_in  # [B, H, N_r, dv + 1]
    num = loc.num * own.unsqueeze(-1) + before[..., : loc.dv] * past.unsqueeze(-1)
    den = loc.den * own + before[..., loc.dv] * past
    poison = p_in.unsqueeze(-1).expand_as(den) if loc.poison is None else loc.poison | p_in.unsqueeze(-1)
    if bool(poison.any()):  # NaN, with no gradient through them (masked_fill)
        num = num.masked_fill(poison.unsqueeze(-1), math.nan)
        den = den.masked_fill(poison, math.nan)
    return num, den


def _non_causal_rows(comm: _Comm, loc: _Local) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query against the keys of every rank: the summaries summed over the group
    at the group's key maximum; a non-finite key anywhere poisons its head everywhere."""
    b, h = loc.b, loc.h
    flags = torch.zeros(b, h, dtype=loc.top.dtype, device=loc.top.device)
    if loc.poisoned is not None:
        flags = flags.masked_fill(loc.poisoned, 1.0)
    both = comm.all_reduce(torch.stack([loc.top, flags]), dist.ReduceOp.MAX, "the key maximum and poison flags")
    c, poisoned = both[0], both[1] > 0  # [B, H]
    if loc.log:
        c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))[..., None, None]  # every key padded: features 0
        fk = (loc.lk - c).exp()
    else:
        fk = loc.lk
    s_loc = torch.cat([fk.transpose(-1, -2) @ loc.v, fk.sum(-2).unsqueeze(-1)], dim=-1)  # [B, H, D, dv + 1]
    s_all = _AllReduceSum.apply(s_loc, comm)
    out = loc.fq @ s_all  # [B, H, N_r, dv + 1]
    bad = non_finite_query_rows(out[..., -1], poisoned if bool(poisoned.any()) else None)
    if bad is not None:  # quarantined: kept out of the product and its gradients, NaN afterwards
        out = (loc.fq.masked_fill(bad.unsqueeze(-1), 0.0) @ s_all).masked_fill(bad.unsqueeze(-1), math.nan)
    return out[..., : loc.dv], out[..., loc.dv]


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "SequenceParallelError",
    "SequenceParallelTimeout",
    "sequence_parallel_attention",
]
