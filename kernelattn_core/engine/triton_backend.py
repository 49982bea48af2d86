"""The Triton backend of feature-map attention: chunked kernels, forward and backward.

Same mathematics and stabilisers as :mod:`.torch_backend` (see there and
:mod:`.triton_kernels`): causal chunks with the prefix-maximum stabiliser and the gate
:math:`e^{m_j - m_t}`, non-causal with one maximum over all valid keys, both in
:math:`O(N D d_v)` time and :math:`O(D d_v)` on-chip state per program; the returned
numerator and denominator are stated at the same stabilisers as the torch backend's
(so they agree to rounding, not only their ratio).

Three entry points:

* :func:`feature_attention_triton`: the registry signature, materialised features;
* :func:`fused_feature_attention_triton`: features computed on chip from ``x`` and
  ``ω`` for maps with a :class:`~kernelattn_core.interfaces.feature_map.FusedFeatureSpec`
  (the ``[N, D]`` feature tensor never goes to memory, forward or backward);
* :func:`feature_attention_step_triton`: causal attention continuing a
  :class:`~kernelattn_core.engine.CausalState` (decoding), returning the next state.

Inputs of dtype float16 / bfloat16 / float32 are computed with float32 accumulation
(float32 matrix products in IEEE precision; half inputs allow TF32); float64 runs in
float64 (under the interpreter, for gradient checks). Gradients flow to the features
(or to ``x'`` and the row term of a fused map), to ``v`` and to an initial state; the
stabilisers are constants, as in the torch backend.

Importing this module imports Triton: it is loaded lazily by the backend registry.
Set ``TRITON_INTERPRET=1`` before Triton is first imported to run the kernels on the
CPU (tests).
"""

from __future__ import annotations

import os

import torch

from ..errors import InputError
from ..interfaces.feature_map import FusedFeatureSpec
from . import triton_kernels as K
from .torch_backend import CausalState

_HALF = (torch.float16, torch.bfloat16)
_FEAT = {None: 0, "exp": 1, "trig": 2}


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _pow2(n: int, low: int = 16) -> int:
    return max(low, 1 << max(0, (int(n) - 1).bit_length()))


def _acc(dtype: torch.dtype) -> tuple[torch.dtype, object, str]:
    if dtype == torch.float64:
        return torch.float64, K.tl.float64, "ieee"
    return torch.float32, K.tl.float32, "tf32" if dtype in _HALF else "ieee"


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not (t.device.type == "cpu" and interpreting()):
        raise InputError(
            f"backend: 'triton' runs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before triton is "
            f"imported), got a tensor on {t.device}"
        )


def _block_v(dv: int, d: int, block_v: int | None) -> int:
    """Columns of ``v`` per program: given, or as many as keep the ``[D, BV]`` float32
    state within 8192 elements (32 KiB of registers: ``BV = 64`` for ``D = 128``)."""
    if block_v is None:
        block_v = max(16, 8192 // _pow2(d))
    return _pow2(min(block_v, dv))


class _FeatureAttention(torch.autograd.Function):
    """``(num, den, s1, z1, m1)`` from query/key features (or ``x'`` and row terms) and ``v``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        cfg: dict,
        qa: torch.Tensor,
        qb: torch.Tensor | None,
        ka: torch.Tensor,
        kb: torch.Tensor | None,
        v: torch.Tensor,
        omega: torch.Tensor | None,
        phase: torch.Tensor | None,
        mask: torch.Tensor | None,
        s0: torch.Tensor | None,
        z0: torch.Tensor | None,
        m0: torch.Tensor | None,
    ):
        b, h, n, _ = qa.shape
        m, dv = v.shape[2], v.shape[3]
        d = cfg["D"]
        e = qa.shape[-1] if cfg["feat"] else d
        acc, tl_acc, prec = _acc(cfg["dtype"])
        dev = qa.device
        num = torch.empty(b, h, n, dv, device=dev, dtype=acc)
        den = torch.empty(b, h, n, device=dev, dtype=acc)
        bv = _block_v(dv, d, cfg["block_v"])
        grid = (b * h, triton_cdiv(dv, bv))
        meta = {
            "FEAT": cfg["feat"],
            "LOG": cfg["log"],
            "HAS_MASK": mask is not None,
            "ACC": tl_acc,
            "PREC": prec,
            "BT": cfg["bt"],
            "BD": _pow2(d),
            "BE": _pow2(e),
            "BV": bv,
            "num_warps": 8 if _pow2(d) * bv >= 8192 else 4,  # a [D, BV] float32 state of 32 KiB: 64 registers
        }
        fq, xq, rq = (None, qa, qb) if cfg["feat"] else (qa, None, None)
        fk, xk, rk = (None, ka, kb) if cfg["feat"] else (ka, None, None)
        if cfg["causal"]:
            has_state = s0 is not None
            mout = torch.empty(b, h, n, device=dev, dtype=acc)
            s1 = torch.empty(b, h, d, dv, device=dev, dtype=acc)
            z1 = torch.empty(b, h, d, device=dev, dtype=acc)
            m1 = torch.empty(b, h, device=dev, dtype=acc)
            K.causal_fwd_kernel[grid](
                fq,
                xq,
                rq,
                fk,
                xk,
                rk,
                omega,
                phase,
                v,
                mask,
                num,
                den,
                mout,
                s0,
                z0,
                m0,
                s1,
                z1,
                m1,
                h,
                n,
                d,
                e,
                dv,
                HAS_STATE=has_state,
                **meta,
            )
        else:
            mout = s1 = z1 = m1 = None
            K.noncausal_fwd_kernel[grid](
                fq, xq, rq, fk, xk, rk, omega, phase, v, mask, num, den, h, n, m, d, e, dv, **meta
            )
        ctx.cfg, ctx.meta, ctx.grid = cfg, meta, grid
        ctx.save_for_backward(qa, qb, ka, kb, v, omega, phase, mask, s0, z0, m0, mout, m1)
        if not cfg["causal"]:
            return num, den
        ctx.mark_non_differentiable(m1)
        return num, den, s1, z1, m1

    @staticmethod
    def backward(ctx, dnum, dden, ds1=None, dz1=None, dm1=None):  # type: ignore[override]
        qa, qb, ka, kb, v, omega, phase, mask, s0, z0, m0, mout, m1 = ctx.saved_tensors
        cfg, meta, grid = ctx.cfg, ctx.meta, ctx.grid
        b, h, n, _ = qa.shape
        m, dv = v.shape[2], v.shape[3]
        d = cfg["D"]
        e = qa.shape[-1] if cfg["feat"] else d
        acc = _acc(cfg["dtype"])[0]
        dev = qa.device
        nv = grid[1]
        dnum = torch.zeros(b, h, n, dv, device=dev, dtype=acc) if dnum is None else dnum.to(acc).contiguous()
        dden = torch.zeros(b, h, n, device=dev, dtype=acc) if dden is None else dden.to(acc).contiguous()

        def partial(rows: int, width: int | None) -> torch.Tensor:
            shape = (nv, b, h, rows) + (() if width is None else (width,))
            return torch.zeros(shape, device=dev, dtype=acc)

        if cfg["feat"]:
            dfq = dfk = None
            dxq, drq, dxk, drk = partial(n, e), partial(n, None), partial(m, e), partial(m, None)
        else:
            dfq, dfk = partial(n, d), partial(m, d)
            dxq = drq = dxk = drk = None
        dvv = torch.zeros(b, h, m, dv, device=dev, dtype=acc)
        fq, xq, rq = (None, qa, qb) if cfg["feat"] else (qa, None, None)
        fk, xk, rk = (None, ka, kb) if cfg["feat"] else (ka, None, None)
        ds0 = dz0 = None
        if cfg["causal"]:
            has_state = s0 is not None
            has_dstate = ds1 is not None or dz1 is not None
            if has_dstate:
                ds1 = torch.zeros(b, h, d, dv, device=dev, dtype=acc) if ds1 is None else ds1.to(acc).contiguous()
                dz1 = torch.zeros(b, h, d, device=dev, dtype=acc) if dz1 is None else dz1.to(acc).contiguous()
            if has_state:
                ds0 = torch.zeros(b, h, d, dv, device=dev, dtype=acc)
                dz0 = torch.zeros(b, h, d, device=dev, dtype=acc)
            K.causal_bwd_kernel[grid](
                fq,
                xq,
                rq,
                fk,
                xk,
                rk,
                omega,
                phase,
                v,
                mask,
                mout,
                dnum,
                dden,
                s0,
                z0,
                m0,
                ds1,
                dz1,
                m1,
                dfq,
                dxq,
                drq,
                dfk,
                dxk,
                drk,
                dvv,
                ds0,
                dz0,
                h,
                n,
                d,
                e,
                dv,
                HAS_STATE=has_state,
                HAS_DSTATE=has_dstate,
                **meta,
            )
        else:
            K.noncausal_bwd_kernel[grid](
                fq,
                xq,
                rq,
                fk,
                xk,
                rk,
                omega,
                phase,
                v,
                mask,
                dnum,
                dden,
                dfq,
                dxq,
                drq,
                dfk,
                dxk,
                drk,
                dvv,
                h,
                n,
                m,
                d,
                e,
                dv,
                **meta,
            )
        if cfg["feat"]:
            gqa, gqb, gka, gkb = dxq.sum(0), drq.sum(0), dxk.sum(0), drk.sum(0)
        else:
            gqa, gqb, gka, gkb = dfq.sum(0), None, dfk.sum(0), None
        return None, gqa, gqb, gka, gkb, dvv, None, None, None, ds0, dz0, None


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _mask_arg(key_padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if key_padding_mask is None else key_padding_mask.to(torch.int8).contiguous()


def _chunk(chunk_size: int | None, n: int) -> int:
    """Positions per chunk: ``chunk_size`` (``None``: the torch backend's measured
    default) rounded up to a power of two in [16, 128] (and no longer than the sequence
    needs). The result does not depend on it beyond rounding."""
    if chunk_size is None:
        from .chunked import DEFAULT_CHUNK

        chunk_size = DEFAULT_CHUNK
    return min(_pow2(min(chunk_size, 128)), _pow2(n))


def _run(
    cfg: dict,
    qa: torch.Tensor,
    qb: torch.Tensor | None,
    ka: torch.Tensor,
    kb: torch.Tensor | None,
    v: torch.Tensor,
    omega: torch.Tensor | None,
    phase: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    state: CausalState | None = None,
) -> tuple[torch.Tensor, ...]:
    _check_device(v)
    acc = _acc(cfg["dtype"])[0]
    if v.device.type == "cuda" and _pow2(cfg["D"]) >= 128:
        # compiled for sm_90, the fused causal backward at D = d = 128 needs 225 KiB of shared
        # memory with chunks of 32 (the H100 has 227 KiB) and more with 64
        cfg = {**cfg, "bt": min(cfg["bt"], 32)}

    def c(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(acc).contiguous()

    s0 = z0 = m0 = None
    if state is not None:
        b, h = v.shape[:2]
        s0, z0 = c(state.kv), c(state.z)
        if state.m is None:
            m0 = torch.zeros(b, h, device=v.device, dtype=acc)
        else:
            m0 = state.m.reshape(b, h).to(acc)
            m0 = torch.where(torch.isfinite(m0), m0, torch.full_like(m0, K.FLOOR_VALUE)).contiguous()
    # v keeps its dtype in memory (loaded and widened on chip); features are float32 already
    return _FeatureAttention.apply(
        cfg, c(qa), c(qb), c(ka), c(kb), v.contiguous(), c(omega), c(phase), _mask_arg(key_padding_mask), s0, z0, m0
    )


def _config(
    dtype: torch.dtype,
    d: int,
    n: int,
    *,
    log_space: bool,
    causal: bool,
    feat: str | None,
    chunk_size: int | None,
    block_v,
) -> dict:
    if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise InputError(f"v: expected float16, bfloat16, float32 or float64, got {dtype}")
    return {
        "dtype": dtype,
        "D": d,
        "log": bool(log_space),
        "causal": bool(causal),
        "feat": _FEAT[feat],
        "bt": _chunk(chunk_size, n),
        "block_v": block_v,
    }


def feature_attention_triton(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_space: bool,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    chunk_size: int | None = None,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator ``[B, H, N, dv]`` and denominator ``[B, H, N]`` from materialised features.

    Parameters
    ----------
    phi_q : Tensor ``[B, H, N, D]``
        Query features, or log-features when ``log_space``.
    phi_k : Tensor ``[B, H, M, D]``
    v : Tensor ``[B, H, M, dv]``
    key_padding_mask : Tensor ``[B, M]`` of bool, optional
        ``True`` marks a padded key (its features and value never reach an output).
    chunk_size : int
        Positions per chunk (rounded to a power of two in [16, 128]).
    block_v : int, optional
        Columns of ``v`` per program (by default as many as keep the on-chip state
        within 32 KiB); the query and key gradients of the blocks are summed.

    Returns
    -------
    num, den : in float32 (float64 for float64 inputs); the caller casts back.
    """
    cfg = _config(
        _input_dtype(phi_q, v),
        phi_q.shape[-1],
        phi_q.shape[2],
        log_space=log_space,
        causal=causal,
        feat=None,
        chunk_size=chunk_size,
        block_v=block_v,
    )
    if _too_wide(v, phi_q.shape[-1]):
        return _torch_fallback(
            phi_q,
            phi_k,
            v,
            log_space=log_space,
            causal=causal,
            key_padding_mask=key_padding_mask,
            chunk_size=chunk_size,
        )
    out = _run(cfg, phi_q, None, phi_k, None, v, None, None, key_padding_mask)
    return out[0], out[1]


def _input_dtype(x: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The precision class of a call: float64 if any input is, half if ``v`` is, else float32."""
    if torch.float64 in (x.dtype, v.dtype):
        return torch.float64
    return v.dtype if v.dtype in _HALF else torch.float32


def fused_inputs(spec: FusedFeatureSpec, x: torch.Tensor, *, query: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x', row)``: what the fused kernel reads instead of the features of ``x [..., d]``."""
    xt = spec.transform(x, query)  # [..., d']
    return xt, spec.row(xt, query)  # [..., d'], [...]


def fused_feature_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: FusedFeatureSpec,
    *,
    log_space: bool,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    chunk_size: int | None = None,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Feature-map attention with the features computed on chip.

    Parameters
    ----------
    q : Tensor ``[B, H, N, d]``, k : Tensor ``[B, H, M, d]``
        Inputs of the map (scaled and pre-transformed), float32 or float64.
    v : Tensor ``[B, H, M, dv]``
    spec : FusedFeatureSpec
        From ``feature_map.fused_spec()``; ``"exp"`` needs ``log_space``.

    Returns
    -------
    num ``[B, H, N, dv]``, den ``[B, H, N]``: equal (to rounding) to
    :func:`feature_attention_triton` on ``raw_features`` of ``q`` and ``k``.
    """
    if spec.family not in ("exp", "trig"):
        raise InputError(f"spec.family: expected 'exp' or 'trig', got {spec.family!r}")
    if (spec.family == "exp") != bool(log_space):
        raise InputError(f"spec.family: {spec.family!r} does not match log_space={log_space}")
    xq, rq = fused_inputs(spec, q, query=True)
    xk, rk = fused_inputs(spec, k, query=False)
    omega = spec.omega.detach()
    d = omega.shape[0]
    if omega.shape[-1] != xq.shape[-1]:
        raise InputError(f"spec.omega: expected [D, {xq.shape[-1]}], got shape {tuple(omega.shape)}")
    phase = None
    if spec.family == "trig":
        phase = torch.zeros(d, dtype=omega.dtype, device=omega.device) if spec.phase is None else spec.phase.detach()
    cfg = _config(
        _input_dtype(q, v),
        d,
        q.shape[2],
        log_space=log_space,
        causal=causal,
        feat=spec.family,
        chunk_size=chunk_size,
        block_v=block_v,
    )
    if _too_wide(v, d):
        return _torch_fallback(
            _spec_features(spec, xq, rq, omega, phase),
            _spec_features(spec, xk, rk, omega, phase),
            v,
            log_space=log_space,
            causal=causal,
            key_padding_mask=key_padding_mask,
            chunk_size=chunk_size,
        )
    out = _run(cfg, xq, rq, xk, rk, v, omega, phase, key_padding_mask)
    return out[0], out[1]


def _too_wide(v: torch.Tensor, d: int) -> bool:
    """More than 128 features on CUDA: the compiled kernels would exceed the shared memory
    of an H100 (see docs/backends.rst); the torch computation runs instead."""
    return v.device.type == "cuda" and _pow2(d) > 128


def _spec_features(
    spec: FusedFeatureSpec, xt: torch.Tensor, row: torch.Tensor, omega: torch.Tensor, phase: torch.Tensor | None
) -> torch.Tensor:
    u = xt @ omega.to(xt.dtype).mT  # [..., D]
    if spec.family == "exp":
        return u + row.unsqueeze(-1)
    return row.unsqueeze(-1) * torch.cos(u + phase.to(xt.dtype))


def _torch_fallback(phi_q, phi_k, v, **kw):  # type: ignore[no-untyped-def]
    from .torch_backend import feature_attention_torch

    return feature_attention_torch(phi_q, phi_k, v, **kw)


def feature_attention_step_triton(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_space: bool,
    key_padding_mask: torch.Tensor | None,
    state: CausalState | None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, CausalState]:
    """Causal attention of new positions given the state of the earlier ones (decoding).

    Same contract as :func:`~kernelattn_core.engine.torch_backend.feature_attention_step`:
    feeding a sequence in pieces gives the numerator and denominator of one causal
    call over the whole sequence (stated at the same stabilisers), and the returned
    :class:`CausalState` continues it. Gradients flow to the features, ``v`` and the
    incoming state's ``kv`` and ``z``.
    """
    cfg = _config(
        _input_dtype(phi_q, v),
        phi_q.shape[-1],
        phi_q.shape[2],
        log_space=log_space,
        causal=True,
        feat=None,
        chunk_size=chunk_size,
        block_v=None,
    )
    num, den, s1, z1, m1 = _run(cfg, phi_q, None, phi_k, None, v, None, None, key_padding_mask, state)
    length = (0 if state is None else state.length) + phi_q.shape[2]
    m = m1.unsqueeze(-1) if log_space else None  # [B, H, 1]
    return num, den, CausalState(s1, z1, m, length)
