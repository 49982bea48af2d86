"""The Triton backend of feature-map attention: chunk-parallel kernels, forward and backward.

Same mathematics and stabilisers as :mod:`.torch_backend` (see there and
:mod:`.triton_kernels`): the returned numerator and denominator are stated at the same
stabilisers as the torch backend's, so they agree to rounding, not only their ratio, and
a value at a padded or future position (NaN included) reaches no output and no gradient
of a row that does not see it (non-finite rows are quarantined inside chunks as the
torch backend does, and the rows that see them are NaN).

Three entry points:

* :func:`feature_attention_triton`: the registry signature, materialised features;
* :func:`fused_feature_attention_triton`: features computed on chip from ``x`` and
  ``ω`` for maps with a :class:`~kernelattn_core.interfaces.feature_map.FusedFeatureSpec`
  (the ``[N, D]`` feature tensor never goes to memory, forward or backward);
* :func:`feature_attention_step_triton`: causal attention continuing a
  :class:`~kernelattn_core.engine.CausalState` (decoding), returning the next state
  (its ``poisoned`` flag set once a non-finite key or value was consumed).

A call runs: ``prep`` on the query rows and on the key rows (row maxima of the
log-features, non-finite rows), a few ``[B, H, N]`` torch operations (prefix maximum,
which rows are dropped or NaN), the state pass and the output kernel; the backward
recomputes the states and runs the reverse state pass and the gradient kernels.

Precision: float32 inputs are computed in IEEE float32; half inputs in float32
accumulation with half (bfloat16) or half / TF32 (float16) matrix operands
(:mod:`.triton_kernels`); float64 only under the interpreter (gradient checks). The
launch parameters come from :mod:`.triton_config`, one table keyed by the
architecture, ``d``, ``D`` and the dtype, which ``tests/test_triton_compile.py`` compiles
for ``sm_80`` and ``sm_90``. A kernel that cannot be launched (out of resources, a
compile error) raises :class:`~kernelattn_core.engine.backends.BackendLaunchError`
naming the shape; under ``backend="auto"`` the engine then runs the torch backend with a
warning (in the backward pass too). Second derivatives (``create_graph=True``):
non-causal calls recompute the torch computation under autograd (correct, the torch
backend's memory), causal calls are refused with the torch backend's
:class:`~kernelattn_core.errors.InputError`.

Importing this module imports Triton: it is loaded lazily by the backend registry.
Set ``TRITON_INTERPRET=1`` before Triton is first imported to run the kernels on the
CPU (tests); ``KERNELATTN_TRITON_TF32=0`` then computes TF32 operands exactly instead of
rounding them as the GPU does.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..errors import InputError
from ..interfaces.feature_map import FusedFeatureSpec
from . import triton_config as C
from . import triton_kernels as K
from .chunked import CausalState
from .launch import BackendLaunchError, BackendWarning, fallback_allowed

tl = K.triton.language

_HALF = (torch.float16, torch.bfloat16)
_FEAT = {"exp": 2, "trig": 3}
#: row offsets are int32 inside the kernels: rows * width must stay below this
_MAX_OFFSET = 2**31
#: CUDA's limit on a launch grid's y and z axes (the x axis allows 2^31 - 1)
_MAX_GRID_YZ = 65535
#: fused multiply-add in the compiled kernels (named at launch: Triton 3.9 warns when it is left implicit)
FP_FUSION = True

#: the torch backend's refusal of causal second derivatives (engine/grouped.py), word for word
CREATE_GRAPH_MESSAGE = (
    "create_graph: second derivatives of causal feature-map attention are not supported "
    "(the causal engine's backward is its own first-order recurrence); got create_graph=True. "
    "Non-causal calls support them."
)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _emulation() -> int:
    """``EMU`` of the kernels: 0 on the GPU (and when recording launches for the compile
    test); under the interpreter 2 (bfloat16 and TF32 operands rounded as the GPU does) or
    1 (``KERNELATTN_TRITON_TF32=0``: TF32 exact)."""
    if not interpreting() or _RECORD.get() is not None:
        return 0
    return 1 if os.environ.get("KERNELATTN_TRITON_TF32", "1") == "0" else 2


# ----------------------------------------------------------------------------- precision
@dataclass(frozen=True)
class Mode:
    """The precision of a call: accumulation, storage and ``tl.dot`` operands.

    Attributes
    ----------
    name : str
        ``"float64"``, ``"float32"``, ``"bfloat16"`` or ``"float16"``: the table's dtype.
    acc, state, v : torch.dtype
        Accumulation (and every input but ``v``); the stored chunk states; the values as
        the kernels read them.
    constexprs : dict
        ``ACC``, ``OPX``/``PX`` (the fused map's ``x' ω^T``), ``OPF``/``PF`` (bounded
        operands), ``OPS``/``PS`` (state sums and gradients): Triton dtypes and precisions.
    """

    name: str
    acc: torch.dtype
    state: torch.dtype
    v: torch.dtype
    constexprs: dict = field(hash=False, compare=True)


def mode_of(dtype: torch.dtype, log_space: bool) -> Mode:
    """The :class:`Mode` of inputs whose values have ``dtype``.

    Half inputs, log-space maps: the in-chunk products (features :math:`\\le 1`, gated
    products :math:`\\le D`, values) take half operands; the fused map's angle
    :math:`x'\\omega^\\top`, the state sums and every gradient product take TF32. Plain
    maps compute in IEEE float32 whatever the input dtype (the float32 mode, values widened
    on the host): their features are unbounded
    and signed, and the trigonometric ones cancel (a kernel value is a small difference
    of :math:`O(1)` features). Chosen by measurement in the interpreter with the GPU's
    rounding (``d = 16``, ``D = 32``, ``N = 100``, bfloat16 inputs, relative RMS against
    float64; torch's float32 computation on the same inputs: 0.15 %): prf with half
    operands everywhere 0.9 % off in the output and up to 2.8 % in the gradients, with
    this choice 0.35 % and 1 %; rff with half operands 21 % and 70 %, all-TF32 1.5 % and
    5.6 %, trig-softmax-features all-TF32 6 % and 23 %, so IEEE.
    """
    f32 = (tl.float32, "ieee")
    if dtype == torch.float64:
        f64 = (tl.float64, "ieee")
        return Mode("float64", torch.float64, torch.float64, torch.float64, _cx(tl.float64, f64, f64, f64))
    if dtype == torch.float32 or (dtype in _HALF and not log_space):
        return Mode("float32", torch.float32, torch.float32, torch.float32, _cx(tl.float32, f32, f32, f32))
    tf32 = (tl.float32, "tf32")
    if dtype in _HALF:
        half = (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16, "ieee")
        name = str(dtype).removeprefix("torch.")
        return Mode(name, torch.float32, torch.float32, dtype, _cx(tl.float32, tf32, half, tf32))
    raise InputError(f"v: expected float16, bfloat16, float32 or float64, got {dtype}")


def _cx(acc, opx, opf, ops) -> dict:  # type: ignore[no-untyped-def]
    return {"ACC": acc, "OPX": opx[0], "PX": opx[1], "OPF": opf[0], "PF": opf[1], "OPS": ops[0], "PS": ops[1]}


def input_dtype(x: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The precision class of a call: float64 if any input is, half if ``v`` is, else float32."""
    if torch.float64 in (x.dtype, v.dtype):
        return torch.float64
    return v.dtype if v.dtype in _HALF else torch.float32


# ------------------------------------------------------------------- launches and tests
@dataclass
class Launch:
    """One kernel launch as the backend issues it (recorded by :func:`record_launches`)."""

    name: str
    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict
    launch: C.KernelLaunch
    key: tuple


_RECORD: contextvars.ContextVar[tuple[int, list[Launch]] | None] = contextvars.ContextVar("record", default=None)
_TILES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("tiles", default=None)


@contextlib.contextmanager
def record_launches(arch: int) -> Iterator[list[Launch]]:
    """Run the backend's host code for CPU tensors as if on an ``sm_<arch>`` GPU, recording
    every kernel launch instead of running it (the compile test compiles what it records;
    outputs are left unwritten)."""
    token = _RECORD.set((arch, []))
    try:
        yield _RECORD.get()[1]  # type: ignore[index]
    finally:
        _RECORD.reset(token)


@contextlib.contextmanager
def tiles(**sizes: int) -> Iterator[None]:
    """Interpreter only: override the table's tiles (``bt``, ``bk``, ``bv``, ``be``), so small
    test shapes cross chunk and tile boundaries."""
    if not interpreting():
        raise InputError("tiles: the table's tiles are the proven ones on a GPU; overrides need TRITON_INTERPRET=1")
    token = _TILES.set(sizes)
    try:
        yield
    finally:
        _TILES.reset(token)


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, BackendWarning, stacklevel=4)


def _failure_types() -> tuple[type[BaseException], ...]:
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    found: list[type[BaseException]] = [CompilationError, OutOfResources]
    with contextlib.suppress(ImportError):
        from triton.runtime.errors import PTXASError

        found.append(PTXASError)
    return tuple(found)


def _resource_error(exc: RuntimeError) -> bool:
    """A driver error that the launch asked for more than the device has (registers,
    threads): ``CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`` as Triton reports it."""
    text = str(exc).lower()
    return "too many resources" in text or "out of resources" in text


def _quiet_numpy() -> contextlib.AbstractContextManager:
    """Under the interpreter, NumPy's warnings about NaN and infinity arithmetic are off:
    non-finite rows are computed and then dropped, as on the GPU, which does not warn."""
    if not interpreting():
        return contextlib.nullcontext()
    import numpy

    return numpy.errstate(all="ignore")


def _launch(call: _Call, name: str, grid: tuple[int, ...], args: tuple, **constexprs: Any) -> None:
    kernel = K.KERNELS["bwd_dqk" if name in ("bwd_dq", "bwd_dk") else name]
    launch = call.cfg.launch(name)
    meta = {**call.mode.constexprs, "EMU": call.emu, "BT": call.cfg.bt, "BK": launch.bk, "BE": launch.be}
    meta["BV"] = launch.bv
    for key in list(meta):
        if key not in kernel.arg_names:
            del meta[key]
    meta.update(constexprs)
    rec = _RECORD.get()
    if rec is not None:
        rec[1].append(Launch(name, kernel, grid, args, meta, launch, call.key))
        return
    try:
        with _quiet_numpy():
            kernel[grid](
                *args, **meta, num_warps=launch.num_warps, num_stages=launch.num_stages, enable_fp_fusion=FP_FUSION
            )
    except (*_failure_types(), RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and not _resource_error(exc):
            raise
        raise BackendLaunchError(
            f"backend 'triton': kernel {name} could not be launched for {call.shape} "
            f"(table entry {call.key}: BT={call.cfg.bt}, {launch.describe()}): {type(exc).__name__}: {exc}"
        ) from exc


# ------------------------------------------------------------------------------- a call
@dataclass
class _Call:
    """The non-tensor part of one call, kept for its backward pass."""

    feat: int
    log: bool
    causal: bool
    mode: Mode
    cfg: C.LaunchConfig
    key: tuple
    emu: int
    shape: str
    d: int
    e: int
    omega: torch.Tensor | None
    phase: torch.Tensor | None
    pad: torch.Tensor | None
    m_state: torch.Tensor | None
    poisoned: torch.Tensor | None
    fallback: bool
    family: str | None = None
    dv: int = 0
    #: row strides of the features, of ``x'`` and of the values: multiples of 16
    ld: int = 0
    le: int = 0
    lv: int = 0

    def strides(self, dv: int) -> tuple[int, int, int, int, int, int]:
        """``(D, d', d_v, LD, LE, LV)`` as the kernels take them."""
        return (self.d, self.e, dv, self.ld, self.le, self.lv)


def _check_device(t: torch.Tensor) -> None:
    if _RECORD.get() is not None:
        return
    if t.device.type != "cuda" and not (t.device.type == "cpu" and interpreting()):
        raise InputError(
            f"backend: 'triton' runs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before triton is "
            f"imported), got a tensor on {t.device}"
        )


def _arch(t: torch.Tensor) -> int:
    rec = _RECORD.get()
    if rec is not None:
        return rec[0]
    if t.device.type != "cuda":
        return 90  # the interpreter runs the sm_90 entries (unless the tiles are overridden)
    arch = C.arch_of(torch.cuda.get_device_capability(t.device))
    if arch is None:  # the registry does not offer the backend there (engine/backends.py)
        raise InputError(f"backend: 'triton' needs compute capability 8.0 or later, got {t.device}")
    return arch


def _make_call(
    *,
    feat: int,
    log_space: bool,
    causal: bool,
    dtype: torch.dtype,
    v: torch.Tensor,
    n: int,
    d: int,
    e: int,
    omega: torch.Tensor | None,
    phase: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    state: CausalState | None,
    family: str | None = None,
) -> _Call:
    _check_device(v)
    mode = mode_of(dtype, log_space)
    b, h, m, dv = v.shape
    shape = f"B={b}, H={h}, N={n}, M={m}, D={d}, d'={e}, d_v={dv}, {str(dtype).removeprefix('torch.')}"
    if mode.name == "float64":
        key: tuple = ("interpreter", "float64")
        cfg = C.lookup(90, dv, d, "float32")
    else:
        head = max(e, dv) if feat >= 2 else dv  # the widest row a program reads besides the features
        key = C.table_key(_arch(v), head, d, mode.name)  # plain maps: the float32 entry (mode_of)
        cfg = C.TABLE[key]
    override = _TILES.get()
    if override:
        tile = {k: override[k] for k in ("bk", "bv", "be") if k in override}
        kernels = {name: replace(launch, **tile) for name, launch in cfg.kernels.items()}
        cfg = C.LaunchConfig(bt=override.get("bt", cfg.bt), kernels=kernels)
        key = ("override", *key)
    m_state = poisoned = None
    if state is not None:
        m_state = None if state.m is None else state.m.reshape(b, h)
        poisoned = state.poisoned
    pad = None if key_padding_mask is None else key_padding_mask.to(torch.bool)
    return _Call(
        feat=feat,
        log=bool(log_space),
        causal=bool(causal),
        mode=mode,
        cfg=cfg,
        key=key,
        emu=_emulation(),
        shape=shape,
        d=d,
        e=e,
        omega=omega,
        phase=phase,
        pad=pad,
        m_state=m_state,
        poisoned=poisoned,
        fallback=fallback_allowed(),
        family=family,
    )


def _outside(call: _Call, n: int, v: torch.Tensor) -> str | None:
    """Why a shape cannot run in the kernels (``None``: it can): int32 offsets, and CUDA's
    limit of 65535 programs on a launch grid's second and third axes, which carry the
    ``B * H`` heads and the chunks of ``bt`` rows."""
    b, h, m, dv = v.shape
    if max(n, m) * _pad16(max(call.d, call.e, dv)) >= _MAX_OFFSET:
        return f"{call.shape}: a head's rows times their width reach 2^31 (the kernels' offsets are int32)"
    if b * h > _MAX_GRID_YZ:
        return f"{call.shape}: B * H = {b * h} heads exceed a launch grid axis ({_MAX_GRID_YZ} programs)"
    if _cdiv(max(n, m), call.cfg.bt) > _MAX_GRID_YZ:
        return (
            f"{call.shape}: {_cdiv(max(n, m), call.cfg.bt)} chunks of {call.cfg.bt} rows exceed a launch grid "
            f"axis ({_MAX_GRID_YZ} programs)"
        )
    return None


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (the kernels are compiled for aligned pointers)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad16(n: int) -> int:
    return _cdiv(n, 16) * 16


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` with its last dimension padded with zeros to ``width`` (differentiable)."""
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


@dataclass
class _Rows:
    """Per-row data of a call (``[B, H, rows]``) and the chunk stabilisers."""

    mq: torch.Tensor
    mk: torch.Tensor
    mc: torch.Tensor
    qp: torch.Tensor
    kd: torch.Tensor
    m0: torch.Tensor
    m_out: torch.Tensor | None
    carried: torch.Tensor | None


def _dummy(call: _Call, dev: torch.device) -> torch.Tensor:
    return torch.zeros(4, device=dev, dtype=call.mode.acc)


def _feature_args(call: _Call, a: torch.Tensor, b: torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    """``(F, X, ROW)`` of one side: features, or ``x'`` and the row term (fused)."""
    return (a, dummy, dummy) if call.feat <= 1 else (dummy, a, b)


def _map_args(call: _Call, dummy: torch.Tensor) -> tuple:
    return (
        dummy if call.omega is None else call.omega,
        dummy if call.phase is None else call.phase,
    )


def _rows(call: _Call, qa, qb, ka, kb, v) -> _Rows:  # type: ignore[no-untyped-def]
    """``prep`` on both sides, then the stabilisers and the dropped and NaN rows."""
    b, h, n = qa.shape[:3]
    m, dv = v.shape[2], call.dv
    dev, acc = qa.device, call.mode.acc
    dummy = _dummy(call, dev)
    w, ph = _map_args(call, dummy)
    cfg = call.cfg
    out = []
    for rows, a, bb, with_v in ((n, qa, qb, False), (m, ka, kb, True)):
        mx = torch.empty(b, h, rows, device=dev, dtype=acc)
        bad = torch.empty(b, h, rows, device=dev, dtype=torch.int8)
        args = (*_feature_args(call, a, bb, dummy), w, ph, v, mx, bad, rows, *call.strides(dv))  # v read with has_v
        _launch(call, "prep", (_cdiv(rows, cfg.bt), b * h), (*args, int(with_v)), FEAT=call.feat)
        out.append((mx, bad.bool()))
    (mxq, qbad), (mxk, kbad) = out
    if call.pad is not None:
        kbad = kbad & ~call.pad[:, None, :]
        kd = kbad | call.pad[:, None, :]
    else:
        kd = kbad
    carried = None
    if call.causal:
        poison = kbad.to(torch.uint8).cummax(-1).values.bool() | qbad  # the rows that see a non-finite key or value
        carried = kbad.any(-1)  # [B, H]: the outgoing state's flag
        if call.poisoned is not None:
            poison = poison | call.poisoned[..., None]
            carried = carried | call.poisoned
    else:
        poison = kbad.any(-1, keepdim=True) | qbad
    floor = K.FLOOR_VALUE
    m_out = None
    nc = _cdiv(n, cfg.bt)
    if call.log:
        mq = torch.where(torch.isfinite(mxq) & ~qbad, mxq, torch.zeros_like(mxq))
        rk = mxk.masked_fill(kd, float("-inf"))
        if call.causal:
            m0 = torch.full((b, h), floor, device=dev, dtype=acc)
            if call.m_state is not None:
                ms = call.m_state.to(acc)
                rk = torch.maximum(rk, ms[..., None])
                m0 = torch.where(torch.isfinite(ms), ms, m0)
            m_raw = rk.cummax(-1).values  # the prefix maximum: causal; -inf before the first key
            m_out = m_raw[..., -1:]
            mk = m_raw.clamp_min(floor)
            mc = torch.cat([m0[..., None], mk[..., cfg.bt - 1 :: cfg.bt]], dim=-1)[..., :nc]
        else:
            top = rk.amax(-1, keepdim=True)  # one maximum over every valid key
            top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
            mk = top.expand(b, h, m)
            m0 = top[..., 0]
            mc = m0[..., None]
    else:
        mq = torch.zeros(b, h, n, device=dev, dtype=acc)
        mk = torch.zeros(b, h, m, device=dev, dtype=acc)
        m0 = torch.zeros(b, h, device=dev, dtype=acc)
        mc = torch.zeros(b, h, nc, device=dev, dtype=acc)
    return _Rows(
        mq=_aligned(mq),
        mk=_aligned(mk),
        mc=_aligned(mc),
        qp=_aligned(poison.to(torch.int8)),
        kd=_aligned(kd.to(torch.int8)),
        m0=_aligned(m0),
        m_out=m_out,
        carried=carried,
    )


def _states(call: _Call, ka, kb, v, rows: _Rows, s0, z0):  # type: ignore[no-untyped-def]
    """The state pass: ``(H, HZ, S1, Z1)`` (``H``, ``HZ``: the states entering each chunk,
    causal; the non-causal sum is ``S1``, ``Z1``)."""
    b, h, m = v.shape[:3]
    dv, lv = call.dv, call.lv
    d, cfg, dev, acc = call.d, call.cfg, v.device, call.mode.acc
    dummy = _dummy(call, dev)
    w, ph = _map_args(call, dummy)
    nc = _cdiv(m, cfg.bt)
    s1 = torch.empty(b, h, d, lv, device=dev, dtype=acc)
    z1 = torch.empty(b, h, d, device=dev, dtype=acc)
    if call.causal:
        hs = torch.empty(b, h, nc, d, lv, device=dev, dtype=call.mode.state)
        hz = torch.empty(b, h, nc, d, device=dev, dtype=acc)
    else:
        hs, hz = dummy.to(call.mode.state), dummy
    args = (*_feature_args(call, ka, kb, dummy), w, ph, v, rows.kd, rows.mk, s0, z0, rows.m0, hs, hz, s1, z1)
    t = cfg.launch("state_fwd")
    grid = (_cdiv(d, t.bk), _cdiv(dv, t.bv), b * h)
    _launch(call, "state_fwd", grid, (*args, m, *call.strides(dv), nc, int(call.causal)), FEAT=call.feat)
    return hs, hz, s1, z1


def _forward(call: _Call, qa, qb, ka, kb, v, s0, z0):  # type: ignore[no-untyped-def]
    b, h, n = qa.shape[:3]
    dv = call.dv
    cfg, dev, acc = call.cfg, qa.device, call.mode.acc
    rows = _rows(call, qa, qb, ka, kb, v)
    hs, hz, s1, z1 = _states(call, ka, kb, v, rows, s0, z0)
    dummy = _dummy(call, dev)
    w, ph = _map_args(call, dummy)
    num = torch.empty(b, h, n, call.lv, device=dev, dtype=acc)
    den = torch.empty(b, h, n, device=dev, dtype=acc)
    nc = _cdiv(n, cfg.bt)
    hcur, hzcur, nch = (hs, hz, nc) if call.causal else (s1.to(call.mode.state), z1, 1)
    args = (
        *_feature_args(call, qa, qb, dummy),
        *_feature_args(call, ka, kb, dummy),
        w,
        ph,
        v,
        rows.qp,
        rows.kd,
        rows.mq,
        rows.mk,
        rows.mc,
        hcur,
        hzcur,
        num,
        den,
    )
    grid = (_cdiv(dv, cfg.launch("out_fwd").bv), nc, b * h)
    _launch(call, "out_fwd", grid, (*args, n, *call.strides(dv), nc, nch, int(call.causal)), FEAT=call.feat)
    return num, den, s1, z1, rows


def _backward(call: _Call, saved, dnum, dden, ds1, dz1, needs):  # type: ignore[no-untyped-def]
    qa, qb, ka, kb, v, s0, z0, mq, mk, mc, qp, kd, m0, s1, z1 = saved
    b, h, n = qa.shape[:3]
    m, dv, lv = v.shape[2], call.dv, call.lv
    d, e, cfg, dev, acc = call.d, call.e, call.cfg, qa.device, call.mode.acc
    rows = _Rows(mq, mk, mc, qp, kd, m0, None, None)
    dummy = _dummy(call, dev)
    w, ph = _map_args(call, dummy)
    nq, nk = _cdiv(n, cfg.bt), _cdiv(m, cfg.bt)
    dnum = torch.zeros(b, h, n, lv, device=dev, dtype=acc) if dnum is None else _aligned(dnum.to(acc))
    dden = torch.zeros(b, h, n, device=dev, dtype=acc) if dden is None else _aligned(dden.to(acc))
    ds1 = torch.zeros(b, h, d, lv, device=dev, dtype=acc) if ds1 is None else _aligned(ds1.to(acc))
    dz1 = torch.zeros(b, h, d, device=dev, dtype=acc) if dz1 is None else _aligned(dz1.to(acc))
    if call.causal:
        hs, hz, _, _ = _states(call, ka, kb, v, rows, s0, z0)  # recomputed, not stored
        dh = torch.empty(b, h, nq, d, lv, device=dev, dtype=call.mode.state)
        dhz = torch.empty(b, h, nq, d, device=dev, dtype=acc)
        nch = nq
    else:
        hs, hz, nch = s1.to(call.mode.state), z1, 1
        dh, dhz = dummy.to(call.mode.state), dummy
    ds0 = torch.empty(b, h, d, lv, device=dev, dtype=acc)
    dz0 = torch.empty(b, h, d, device=dev, dtype=acc)
    fq, fk = _feature_args(call, qa, qb, dummy), _feature_args(call, ka, kb, dummy)
    args = (*fq, w, ph, qp, mq, mk, mc, dnum, dden, ds1, dz1, dh, dhz, ds0, dz0)
    t = cfg.launch("state_bwd")
    grid = (_cdiv(d, t.bk), _cdiv(dv, t.bv), b * h)
    _launch(call, "state_bwd", grid, (*args, n, *call.strides(dv), nq, int(call.causal)), FEAT=call.feat)
    dsl, dszl = (dh, dhz) if call.causal else (ds0.to(call.mode.state), dz0)  # the gradients leaving the chunks
    dvv = None
    if needs["v"]:
        dvv = torch.empty(b, h, m, lv, device=dev, dtype=acc)
        args = (*fq, *fk, w, ph, qp, kd, mq, mk, dsl, dnum, dvv)
        grid = (_cdiv(dv, cfg.launch("bwd_dv").bv), nk, b * h)
        _launch(call, "bwd_dv", grid, (*args, m, *call.strides(dv), nch, int(call.causal)), FEAT=call.feat)
    grads = []
    for side, name, rows_n, nchunks, (hh, hhz) in (
        (0, "bwd_dq", n, nq, (hs, hz)),
        (1, "bwd_dk", m, nk, (dsl, dszl)),
    ):
        if not needs["qk"[side]]:
            grads.append((None, None))
            continue
        if call.feat <= 1:
            df = torch.empty(b, h, rows_n, call.ld, device=dev, dtype=acc)
            dx = drow = dummy
            n_e = 1
        else:
            df = dummy
            dx = torch.empty(b, h, rows_n, call.le, device=dev, dtype=acc)
            drow = torch.empty(b, h, rows_n, device=dev, dtype=acc)
            n_e = _cdiv(e, cfg.launch(name).be)
        args = (*fq, *fk, w, ph, v, qp, kd, mq, mk, mc, hh, hhz, dnum, dden, df, dx, drow)
        grid = (n_e, nchunks, b * h)
        ints = (rows_n, *call.strides(dv), nq, nch, int(call.causal))
        _launch(call, name, grid, (*args, *ints), SIDE=side, FEAT=call.feat)
        grads.append((df, None) if call.feat <= 1 else (dx, drow))
    (gqa, gqb), (gka, gkb) = grads
    has_state = needs["state"]
    return gqa, gqb, gka, gkb, dvv, (ds0 if has_state else None), (dz0 if has_state else None)


# --------------------------------------------------------------------- torch reference
def spec_features(
    family: str, xt: torch.Tensor, row: torch.Tensor, omega: torch.Tensor, phase: torch.Tensor | None
) -> torch.Tensor:
    """The features (log-features for ``"exp"``) a fused spec describes, in torch."""
    u = xt @ omega.to(xt.dtype).mT  # [..., D]
    if family == "exp":
        return u + row.unsqueeze(-1)
    return row.unsqueeze(-1) * torch.cos(u + (0.0 if phase is None else phase.to(xt.dtype)))


def _reference(call: _Call, qa, qb, ka, kb, v, s0, z0):  # type: ignore[no-untyped-def]
    """The torch backend's computation of the same call (same stabilisers), differentiable."""
    from .torch_backend import feature_attention_step, feature_attention_torch

    v, s0 = v[..., : call.dv], s0[..., : call.dv]  # the padding of the row strides cut off
    if call.feat <= 1:
        phi_q, phi_k = qa[..., : call.d], ka[..., : call.d]
    else:
        omega = call.omega[..., : call.e]  # type: ignore[index]
        phi_q = spec_features(call.family, qa[..., : call.e], qb, omega, call.phase)  # type: ignore[arg-type]
        phi_k = spec_features(call.family, ka[..., : call.e], kb, omega, call.phase)  # type: ignore[arg-type]
    if not call.causal:
        num, den = feature_attention_torch(phi_q, phi_k, v, log_space=call.log, causal=False, key_padding_mask=call.pad)
        return num, den, None, None
    b, h = v.shape[:2]
    m = None if call.m_state is None else call.m_state.reshape(b, h, 1)
    state = CausalState(s0, z0, m if call.log else None, 0, call.poisoned)
    num, den, out = feature_attention_step(phi_q, phi_k, v, log_space=call.log, key_padding_mask=call.pad, state=state)
    return num, den, out.kv, out.z


class _FeatureAttention(torch.autograd.Function):
    """``(num, den, s1, z1, m_out, carried)`` from query/key features (or ``x'`` and row
    terms), ``v`` and an initial state."""

    @staticmethod
    def forward(ctx, call: _Call, qa, qb, ka, kb, v, s0, z0):  # type: ignore[no-untyped-def, override]
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (no zero tensors)
        num, den, s1, z1, rows = _forward(call, qa, qb, ka, kb, v, s0, z0)
        ctx.call = call
        ctx.save_for_backward(qa, qb, ka, kb, v, s0, z0, rows.mq, rows.mk, rows.mc, rows.qp, rows.kd, rows.m0, s1, z1)
        m_out = rows.m_out if rows.m_out is not None else num.new_zeros(0)
        carried = rows.carried if rows.carried is not None else torch.zeros(0, dtype=torch.bool, device=num.device)
        ctx.mark_non_differentiable(m_out, carried)
        return num, den, s1, z1, m_out, carried

    @staticmethod
    def backward(ctx, dnum, dden, ds1, dz1, _dm, _dc):  # type: ignore[no-untyped-def, override]
        call: _Call = ctx.call
        saved = ctx.saved_tensors
        inputs = saved[:7]
        if torch.is_grad_enabled():  # create_graph=True
            if call.causal:
                raise InputError(CREATE_GRAPH_MESSAGE)
            return (None, *_reference_grads(call, inputs, (dnum, dden, ds1, dz1), ctx.needs_input_grad[1:], True))
        needs = {
            "q": ctx.needs_input_grad[1] or ctx.needs_input_grad[2],
            "k": ctx.needs_input_grad[3] or ctx.needs_input_grad[4],
            "v": ctx.needs_input_grad[5],
            "state": ctx.needs_input_grad[6] or ctx.needs_input_grad[7],
        }
        try:
            grads = _backward(call, saved, dnum, dden, ds1, dz1, needs)
        except BackendLaunchError as exc:
            if not call.fallback:
                raise
            _warn_once(f"bwd:{exc}", f"{exc}; the gradients come from the torch backend instead")
            return (None, *_reference_grads(call, inputs, (dnum, dden, ds1, dz1), ctx.needs_input_grad[1:], False))
        gqa, gqb, gka, gkb, dvv, ds0, dz0 = grads
        return None, gqa, gqb, gka, gkb, dvv, ds0, dz0


def _reference_grads(call: _Call, inputs, bars, needs, create_graph: bool):  # type: ignore[no-untyped-def]
    """Gradients of the saved inputs through :func:`_reference` (create_graph: differentiable)."""
    dnum, dden, ds1, dz1 = bars  # the Function's outputs carry the padded value columns
    bars = (None if dnum is None else dnum[..., : call.dv], dden, None if ds1 is None else ds1[..., : call.dv], dz1)
    with torch.enable_grad():
        leaves = [
            None if t is None else (t if (create_graph and t.requires_grad) else t.detach().requires_grad_(w))
            for t, w in zip(inputs, needs)
        ]
        outs = _reference(call, *leaves)
        pairs = [(o, g) for o, g in zip(outs, bars) if o is not None and g is not None]
        wanted = [t for t, w in zip(leaves, needs) if t is not None and w]
        got = iter(
            torch.autograd.grad(
                [o for o, _ in pairs], wanted, [g for _, g in pairs], create_graph=create_graph, allow_unused=True
            )
        )
    res = []
    for t, w in zip(leaves, needs):
        if t is None or not w:
            res.append(None)
        else:
            g = next(got)
            res.append(torch.zeros_like(t) if g is None else g)
    return res


def _run(call: _Call, qa, qb, ka, kb, v, state: CausalState | None):  # type: ignore[no-untyped-def]
    """Prepare the tensors (dtype, row strides padded to multiples of 16, contiguous,
    aligned), apply the Function and cut the padding off its outputs."""
    acc = call.mode.acc
    b, h, _, dv = v.shape
    call.dv = dv
    call.ld, call.le, call.lv = _pad16(call.d), _pad16(call.e), _pad16(dv)
    width = call.le if call.feat >= 2 else call.ld  # the row stride of qa / ka

    def c(t: torch.Tensor | None, w: int | None = None) -> torch.Tensor | None:
        if t is None:
            return None
        t = t.to(acc)
        return _aligned(t if w is None else _pad_last(t, w))

    if state is None:
        s0 = torch.zeros(b, h, call.d, call.lv, device=v.device, dtype=acc)
        z0 = torch.zeros(b, h, call.d, device=v.device, dtype=acc)
    else:
        s0, z0 = c(state.kv, call.lv), c(state.z)
    call.omega, call.phase = c(call.omega, call.le), c(call.phase)
    # half values of log-space maps stay half in memory (widened on chip); everything else is `acc`
    vv = _aligned(_pad_last(v.to(call.mode.v), call.lv))
    out = _FeatureAttention.apply(call, c(qa, width), c(qb), c(ka, width), c(kb), vv, s0, z0)
    num, den, s1, z1, m_out, carried = out
    if call.lv != dv:
        num, s1 = num[..., :dv], s1[..., :dv]
    return num, den, s1, z1, m_out, carried


# ------------------------------------------------------------------------ entry points
def _check_shapes(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, causal: bool, what: str) -> None:
    if phi_q.dim() != 4 or phi_k.dim() != 4 or v.dim() != 4:
        raise InputError(
            f"{what}: expected 4-d [B, H, N, D] tensors, got shapes {tuple(phi_q.shape)}, {tuple(phi_k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if phi_k.shape[:3] != v.shape[:3] or phi_q.shape[:2] != v.shape[:2]:
        raise InputError(
            f"v: expected [B, H, M, d_v] matching the keys {tuple(phi_k.shape)}, got shape {tuple(v.shape)}"
        )
    if causal and phi_q.shape[2] != phi_k.shape[2]:
        raise InputError(f"causal: needs as many queries as keys, got N={phi_q.shape[2]} and M={phi_k.shape[2]}")


def _torch_instead(reason: str) -> None:
    _warn_once(reason, f"backend 'triton': {reason}; running the torch backend for this shape")


def feature_attention_triton(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_space: bool,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    chunk_size: int | None = None,
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
    chunk_size : int, optional
        Not used: the chunk length and the tiles come from :mod:`.triton_config`
        (:func:`tiles` overrides them under the interpreter).

    Returns
    -------
    num, den : in float32 (float64 for float64 inputs); the caller casts back.
    """
    _check_shapes(phi_q, phi_k, v, causal, "phi_q, phi_k, v")
    call = _make_call(
        feat=1 if log_space else 0,
        log_space=log_space,
        causal=causal,
        dtype=input_dtype(phi_q, v),
        v=v,
        n=phi_q.shape[2],
        d=phi_q.shape[-1],
        e=phi_q.shape[-1],
        omega=None,
        phase=None,
        key_padding_mask=key_padding_mask,
        state=None,
    )
    reason = _outside(call, phi_q.shape[2], v)
    if reason is not None:
        _torch_instead(reason)
        from .torch_backend import feature_attention_torch

        return feature_attention_torch(
            phi_q, phi_k, v, log_space=log_space, causal=causal, key_padding_mask=key_padding_mask
        )
    out = _run(call, phi_q, None, phi_k, None, v, None)
    return out[0], out[1]


def fused_inputs(spec: FusedFeatureSpec, x: torch.Tensor, *, query: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x', row)``: what the fused kernel reads instead of the features of ``x [..., d]``.

    A non-finite row of ``x`` enters the transform as 0 and leaves as NaN (as
    :meth:`~kernelattn_core.interfaces.FeatureMap._isolated` does for materialised maps):
    the kernel drops the key or poisons the query's row as before, and the row's own
    gradient is exactly 0 instead of :math:`0 \\cdot \\infty`."""
    from .naive import non_finite_rows

    bad = non_finite_rows(x)
    if bad is None:
        xt = spec.transform(x, query)  # [..., d']
        return xt, spec.row(xt, query)  # [..., d'], [...]
    xt = spec.transform(x.masked_fill(bad.unsqueeze(-1), 0.0), query)
    row = spec.row(xt, query)
    return xt.masked_fill(bad.unsqueeze(-1), float("nan")), row.masked_fill(bad, float("nan"))


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Feature-map attention with the features computed on chip.

    Parameters
    ----------
    q : Tensor ``[B, H, N, d]``, k : Tensor ``[B, H, M, d]``
        Inputs of the map (scaled and pre-transformed), float32 or float64. Padded keys
        are set to 0 before the map, so whatever they hold (NaN) their gradient is 0.
    v : Tensor ``[B, H, M, dv]``
    spec : FusedFeatureSpec
        From ``feature_map.fused_spec()``; ``"exp"`` needs ``log_space``.

    Returns
    -------
    num ``[B, H, N, dv]``, den ``[B, H, N]``: equal (to rounding) to
    :func:`feature_attention_triton` on ``raw_features`` of ``q`` and ``k``.
    """
    if spec.family not in _FEAT:
        raise InputError(f"spec.family: expected 'exp' or 'trig', got {spec.family!r}")
    if (spec.family == "exp") != bool(log_space):
        raise InputError(f"spec.family: {spec.family!r} does not match log_space={log_space}")
    _check_shapes(q, k, v, causal, "q, k, v")
    if key_padding_mask is not None:
        k = k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    xq, rq = fused_inputs(spec, q, query=True)
    xk, rk = fused_inputs(spec, k, query=False)
    omega = spec.omega.detach()
    d = omega.shape[0]
    if omega.shape[-1] != xq.shape[-1]:
        raise InputError(f"spec.omega: expected [D, {xq.shape[-1]}], got shape {tuple(omega.shape)}")
    phase = None
    if spec.family == "trig":
        phase = torch.zeros(d, dtype=omega.dtype, device=omega.device) if spec.phase is None else spec.phase.detach()
    call = _make_call(
        feat=_FEAT[spec.family],
        log_space=log_space,
        causal=causal,
        dtype=input_dtype(q, v),
        v=v,
        n=q.shape[2],
        d=d,
        e=xq.shape[-1],
        omega=omega,
        phase=phase,
        key_padding_mask=key_padding_mask,
        state=None,
        family=spec.family,
    )
    reason = _outside(call, q.shape[2], v)
    if reason is not None:
        _torch_instead(reason)
        from .torch_backend import feature_attention_torch

        return feature_attention_torch(
            spec_features(spec.family, xq, rq, omega, phase),
            spec_features(spec.family, xk, rk, omega, phase),
            v,
            log_space=log_space,
            causal=causal,
            key_padding_mask=key_padding_mask,
        )
    out = _run(call, xq, rq, xk, rk, v, None)
    return out[0], out[1]


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
    :class:`CausalState` continues it; its ``poisoned`` flag ``[B, H]`` is set once a
    non-finite key or value was consumed (every later row is NaN). Gradients flow to the
    features, ``v`` and the incoming state's ``kv`` and ``z``.
    """
    _check_shapes(phi_q, phi_k, v, True, "phi_q, phi_k, v")
    d = phi_q.shape[-1]
    if state is not None:
        b, h, _, dv = v.shape
        if tuple(state.kv.shape) != (b, h, d, dv) or tuple(state.z.shape) != (b, h, d):
            raise InputError(
                f"state: expected kv [{b}, {h}, {d}, {dv}] and z [{b}, {h}, {d}] for these inputs, got "
                f"{tuple(state.kv.shape)} and {tuple(state.z.shape)}"
            )
        if (state.m is None) == bool(log_space):
            raise InputError(f"state: its m does not match log_space={log_space} (a state of another feature map)")
    call = _make_call(
        feat=1 if log_space else 0,
        log_space=log_space,
        causal=True,
        dtype=input_dtype(phi_q, v),
        v=v,
        n=phi_q.shape[2],
        d=d,
        e=d,
        omega=None,
        phase=None,
        key_padding_mask=key_padding_mask,
        state=state,
    )
    reason = _outside(call, phi_q.shape[2], v)
    if reason is not None:
        _torch_instead(reason)
        from .torch_backend import feature_attention_step

        return feature_attention_step(
            phi_q, phi_k, v, log_space=log_space, key_padding_mask=key_padding_mask, state=state
        )
    num, den, s1, z1, m_out, carried = _run(call, phi_q, None, phi_k, None, v, state)
    length = (0 if state is None else state.length) + phi_q.shape[2]
    return num, den, CausalState(s1, z1, m_out if log_space else None, length, carried)


__all__ = [
    "CREATE_GRAPH_MESSAGE",
    "Launch",
    "Mode",
    "feature_attention_step_triton",
    "feature_attention_triton",
    "fused_feature_attention_triton",
    "fused_inputs",
    "input_dtype",
    "interpreting",
    "mode_of",
    "record_launches",
    "spec_features",
    "tiles",
]
