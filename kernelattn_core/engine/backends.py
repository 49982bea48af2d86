"""Backends of feature-map attention, described by data and chosen at run time.

A backend is a :class:`Backend` record: a name, a priority, an availability check
that imports nothing heavy, a predicate saying which problems it supports, and a
loader that imports the implementation only when it is first used. The engine picks
the available, supporting backend of highest priority (or the one asked for by
name) and reports which one ran through ``estimator.last_backend``.

The core registers two: ``torch`` (everywhere) and ``triton`` (CUDA tensors when
Triton imports; CPU tensors too under ``TRITON_INTERPRET=1``, but only when asked for by
name). A backend may also offer a *fused* entry (``load_fused``) that computes the
features on chip from the map's inputs and frequencies
(:meth:`~kernelattn_core.interfaces.FeatureMap.fused_spec`); :func:`attend_features`
uses it when the map has a spec and falls back to materialised features otherwise.
A backend may offer a decoding step (``load_step``); :func:`attend_step` uses it.

A backend whose kernels cannot be launched for a call raises
:class:`BackendLaunchError`; when the backend was chosen automatically
(``fallback`` given to :func:`attend_normalized` / :func:`attend_step`) the torch
backend runs the call instead, with a :class:`BackendWarning`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import InputError
from ..validation import check_head_dim
from .chunked import autocast_off
from .launch import _FALLBACK, BackendLaunchError, BackendWarning, fallback_allowed  # noqa: F401 - re-exported


@dataclass(frozen=True)
class Problem:
    """What a backend is asked to compute (used by ``supports``)."""

    device: torch.device
    dtype: torch.dtype
    log_space: bool
    causal: bool
    requires_grad: bool


class FeatureAttentionFn(Protocol):
    def __call__(
        self,
        phi_q: torch.Tensor,
        phi_k: torch.Tensor,
        v: torch.Tensor,
        *,
        log_space: bool,
        causal: bool,
        key_padding_mask: torch.Tensor | None,
        chunk_size: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class Backend:
    """A feature-attention backend.

    Attributes
    ----------
    name : str
    priority : int
        Higher wins among available backends that support the problem.
    is_available : callable
        ``() -> bool``; must not import the implementation.
    supports : callable
        ``(Problem) -> bool``.
    load : callable
        ``() -> FeatureAttentionFn``; imports the implementation lazily.
    load_fused : callable, optional
        ``() -> fn(q, k, v, spec, *, log_space, causal, key_padding_mask, chunk_size)``:
        the fused entry, features computed on chip from a
        :class:`~kernelattn_core.interfaces.feature_map.FusedFeatureSpec`.
    auto : callable, optional
        ``(Problem) -> bool``: whether automatic selection may pick the backend for a
        problem it supports (default: whenever it supports it).
    requirement : str
        What the backend needs, for error messages.
    load_step : callable, optional
        ``() -> fn(phi_q, phi_k, v, *, log_space, key_padding_mask, state, chunk_size)``
        returning ``(num, den, state)``: the decoding step (the contract of
        :func:`~kernelattn_core.engine.torch_backend.feature_attention_step`); torch's
        when ``None``.
    load_grouped : callable, optional
        ``() -> fn(feature_map, normalizer, q, k, v, *, causal, key_padding_mask,
        chunk_size, scale)``: the backend's own entry from the map and the inputs (it
        computes the features itself, group by group); returns ``(num, den)`` when
        ``normalizer`` is ``None``, else ``(out,)``. When set, the engine calls it instead
        of materialising features for ``load`` (the torch backend's grouped pass,
        :mod:`kernelattn_core.engine.grouped`).
    """

    name: str
    priority: int
    is_available: Callable[[], bool]
    supports: Callable[[Problem], bool]
    load: Callable[[], FeatureAttentionFn]
    load_fused: Callable[[], Callable[..., tuple[torch.Tensor, torch.Tensor]]] | None = None
    auto: Callable[[Problem], bool] | None = None
    requirement: str = ""
    load_step: Callable[[], Callable[..., tuple[torch.Tensor, torch.Tensor, Any]]] | None = None
    load_grouped: Callable[[], Callable[..., tuple[torch.Tensor, ...]]] | None = None


def _load_torch() -> FeatureAttentionFn:
    from .torch_backend import feature_attention_torch

    return feature_attention_torch


def _torch_grouped(
    feature_map: Any,
    normalizer: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    chunk_size: int | None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, ...]:
    """The torch backend's entry: features and attention per group of positions with its
    own backward (:mod:`~kernelattn_core.engine.grouped`); under ``torch.compile`` the
    normalised call runs :mod:`~kernelattn_core.engine.traced` (one graph, the quarantine
    as tensor operations, autograd's backward)."""
    if normalizer is not None and torch.compiler.is_compiling():
        from .traced import traced_feature_attention

        out = traced_feature_attention(
            feature_map, normalizer, q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale
        )
        return (out,)
    from .grouped import grouped_feature_attention

    if normalizer is None:
        return grouped_feature_attention(
            feature_map, q, k, v, causal=causal, key_padding_mask=key_padding_mask, chunk_size=chunk_size
        )
    return grouped_feature_attention(
        feature_map,
        q,
        k,
        v,
        causal=causal,
        key_padding_mask=key_padding_mask,
        chunk_size=chunk_size,
        scale=scale,
        normalizer=normalizer,
    )


def _load_torch_grouped() -> Callable[..., tuple[torch.Tensor, ...]]:
    return _torch_grouped


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add a backend (a plugin's fast path). Names are unique."""
    if backend.name in _BACKENDS:
        raise InputError(f"backend.name: {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend


def backends() -> list[Backend]:
    """All registered backends, highest priority first."""
    return sorted(_BACKENDS.values(), key=lambda b: -b.priority)


#: the backend that :func:`kernelattn_core.kernel_attention` forces for one call:
#: ``(estimator, name)`` while the call runs, else ``None``. A context variable, so the
#: estimator is never mutated during a call and concurrent calls (threads, asyncio tasks)
#: do not see each other's choice.
_CALL_BACKEND: ContextVar[tuple[object, str] | None] = ContextVar("kernelattn_call_backend", default=None)
#: how many forced calls are running, in any thread: while 0, :func:`preferred_backend` reads
#: no context variable (a plain global that torch.compile traces; ``ContextVar.get`` breaks
#: the graph)
_FORCED_CALLS = 0
_FORCED_LOCK = threading.Lock()


@contextmanager
def backend_for_call(estimator: object, name: str) -> Iterator[None]:
    """Force the backend ``name`` on ``estimator``'s feature attention while the block runs
    (``kernel_attention(..., backend=name)``); other estimators called inside keep theirs."""
    global _FORCED_CALLS
    token = _CALL_BACKEND.set((estimator, name))
    with _FORCED_LOCK:
        _FORCED_CALLS += 1
    try:
        yield
    finally:
        with _FORCED_LOCK:
            _FORCED_CALLS -= 1
        _CALL_BACKEND.reset(token)


def preferred_backend(estimator: object, own: str | None) -> str | None:
    """The backend name ``estimator`` runs this call on: the one forced for the call by
    :func:`backend_for_call`, else ``own`` (its ``backend`` option; ``None``: automatic)."""
    if not _FORCED_CALLS:
        return own
    forced = _CALL_BACKEND.get()
    return forced[1] if forced is not None and forced[0] is estimator else own


def select_backend(problem: Problem, prefer: str | None = None) -> Backend:
    """The backend to run ``problem``: ``prefer`` if given (an error if it cannot),
    else the available supporting backend of highest priority."""
    if prefer is None and torch.compiler.is_compiling():
        # under torch.compile the torch backend runs its traced form (engine.traced): no
        # availability probing (imports) and no custom autograd function in the graph
        return _BACKENDS["torch"]
    if prefer is not None:
        if not isinstance(prefer, str) or prefer not in _BACKENDS:  # a list or dict: not hashable
            raise InputError(f"backend: expected one of {sorted(_BACKENDS)}, got {prefer!r}")
        chosen = _BACKENDS[prefer]
        needs = f" (it needs {chosen.requirement})" if chosen.requirement else ""
        if not chosen.is_available():
            raise InputError(f"backend: {prefer!r} is not available on this machine{needs}")
        if not chosen.supports(problem):
            raise InputError(
                f"backend: {prefer!r} cannot run this call{needs}; got {problem.dtype} tensors on {problem.device}"
            )
        return chosen
    for candidate in backends():
        auto = candidate.auto or candidate.supports
        if candidate.is_available() and candidate.supports(problem) and auto(problem):
            return candidate
    raise InputError(f"backend: no backend supports {problem}")  # pragma: no cover - torch supports all


def attend_features(
    backend: Backend,
    feature_map: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator ``[B, H, N, dv]`` and denominator ``[B, H, N]`` of ``feature_map`` on
    ``q [B, H, N, d]``, ``k [B, H, M, d]``, ``v [B, H, M, dv]`` through ``backend``.

    Fused when the backend has a fused entry and the map a
    :meth:`~kernelattn_core.interfaces.FeatureMap.fused_spec` (whose frequencies need no
    gradient); otherwise the features are materialised with ``raw_features``.
    """
    fm = feature_map
    spec = fm.fused_spec() if backend.load_fused is not None else None
    fused = spec is not None and not spec.omega.requires_grad
    if not fused and backend.load_grouped is not None:
        # the backend computes the features itself (torch: per group of positions, grouped.py,
        # with autocast off)
        num, den = backend.load_grouped()(
            fm, None, q, k, v, causal=causal, key_padding_mask=key_padding_mask, chunk_size=chunk_size
        )
        return num, den
    # the map's own products (a transform x @ A, a network's layers) in the inputs' dtype, as
    # on the grouped path: under the caller's autocast they ran in bfloat16 on float32 inputs
    with autocast_off(q.device):
        if fused:
            check_head_dim("q", q, fm.head_dim)
            half = (torch.float16, torch.bfloat16)
            q, k = (q.float(), k.float()) if q.dtype in half else (q, k)  # as raw_features does
            return backend.load_fused()(
                q,
                k,
                v,
                spec,
                log_space=fm.log_space,
                causal=causal,
                key_padding_mask=key_padding_mask,
                chunk_size=chunk_size,
            )
        phi_q = fm.raw_features(q, query=True)  # [B, H, N, D]
        phi_k = fm.raw_features(k, query=False)  # [B, H, M, D]
        return backend.load()(
            phi_q,
            phi_k,
            v,
            log_space=fm.log_space,
            causal=causal,
            key_padding_mask=key_padding_mask,
            chunk_size=chunk_size,
        )


def attend_normalized(
    backend: Backend,
    feature_map: Any,
    normalizer: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    chunk_size: int | None,
    scale: float = 1.0,
    fallback: Callable[[Backend], None] | None = None,
) -> torch.Tensor:
    """``normalizer.normalize(num, den)`` of :func:`attend_features` on ``scale * q`` and
    ``scale * k``.

    ``fallback`` (the backend was chosen automatically): when ``backend`` raises
    :class:`BackendLaunchError`, the torch backend computes the call instead, with a
    :class:`BackendWarning`, and ``fallback`` is called with it (to report which ran);
    ``None`` lets the error through.

    A backend with a grouped entry (``load_grouped``: the torch backend) applies ``scale``
    and the normaliser group by group inside its grouped pass
    (:mod:`kernelattn_core.engine.grouped`), so no whole-sequence scaled copy
    of the inputs, gradient of ``num`` or normaliser temporary is formed; other backends
    get the scaled inputs and the normaliser runs on their ``num`` and ``den``. Under
    ``torch.compile`` the torch backend runs :mod:`kernelattn_core.engine.traced` (one
    graph, the quarantine as tensor operations, autograd's backward).
    ``normalize`` acts row by row (the :class:`~kernelattn_core.interfaces.Normalizer`
    contract).
    """
    if backend.load_grouped is not None:
        (out,) = backend.load_grouped()(
            feature_map,
            normalizer,
            q,
            k,
            v,
            causal=causal,
            key_padding_mask=key_padding_mask,
            chunk_size=chunk_size,
            scale=scale,
        )
        return out
    token = _FALLBACK.set(fallback is not None)
    try:
        qs, ks = (q * scale, k * scale) if scale != 1.0 else (q, k)
        num, den = attend_features(
            backend, feature_map, qs, ks, v, causal=causal, key_padding_mask=key_padding_mask, chunk_size=chunk_size
        )
    except BackendLaunchError as exc:
        if fallback is None:
            raise
        _warn_fallback(exc)
        torch_backend = _BACKENDS["torch"]
        fallback(torch_backend)
        return attend_normalized(
            torch_backend,
            feature_map,
            normalizer,
            q,
            k,
            v,
            causal=causal,
            key_padding_mask=key_padding_mask,
            chunk_size=chunk_size,
            scale=scale,
        )
    finally:
        _FALLBACK.reset(token)
    return normalizer.normalize(num, den)


_WARNED: set[str] = set()


def _warn_fallback(exc: BackendLaunchError) -> None:
    """One :class:`BackendWarning` per distinct failure."""
    if str(exc) not in _WARNED:
        _WARNED.add(str(exc))
        warnings.warn(f"{exc}; running the torch backend instead", BackendWarning, stacklevel=4)


def attend_step(
    backend: Backend,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_space: bool,
    key_padding_mask: torch.Tensor | None,
    state: Any,
    chunk_size: int | None,
    fallback: Callable[[Backend], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """A decoding step (``(num, den, state)``) through ``backend``'s ``load_step``, or the
    torch backend's when it has none; ``fallback`` as in :func:`attend_normalized`."""
    from .torch_backend import feature_attention_step

    kw = dict(log_space=log_space, key_padding_mask=key_padding_mask, state=state, chunk_size=chunk_size)
    if backend.load_step is None:
        return feature_attention_step(phi_q, phi_k, v, **kw)
    token = _FALLBACK.set(fallback is not None)
    try:
        return backend.load_step()(phi_q, phi_k, v, **kw)
    except BackendLaunchError as exc:
        if fallback is None:
            raise
        _warn_fallback(exc)
        fallback(_BACKENDS["torch"])
        return feature_attention_step(phi_q, phi_k, v, **kw)
    finally:
        _FALLBACK.reset(token)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


@functools.cache
def _triton_installed() -> bool:
    """Whether Triton can be imported, looked up once per process: ``find_spec`` walks
    ``sys.path`` (about 0.2 ms, which every automatic backend choice paid, 2-3 % of a
    small attention call)."""
    return importlib.util.find_spec("triton") is not None


def _triton_available() -> bool:
    """Triton is installed and there is a device for it (CUDA, or the CPU interpreter)."""
    if not _triton_installed():
        return False
    return _interpreting() or torch.cuda.is_available()


_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _triton_supports(problem: Problem) -> bool:
    if problem.device.type == "cuda":  # the launch table covers compute capability 8.0 and later
        return problem.dtype in _TRITON_DTYPES and torch.cuda.get_device_capability(problem.device)[0] >= 8
    # the interpreter runs CPU tensors (and float64, for gradient checks)
    return problem.device.type == "cpu" and _interpreting() and problem.dtype in (*_TRITON_DTYPES, torch.float64)


def _load_triton() -> FeatureAttentionFn:
    from .triton_backend import feature_attention_triton

    return feature_attention_triton


def _load_triton_fused() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    from .triton_backend import fused_feature_attention_triton

    return fused_feature_attention_triton


def _load_triton_step() -> Callable[..., tuple[torch.Tensor, torch.Tensor, Any]]:
    from .triton_backend import feature_attention_step_triton

    return feature_attention_step_triton


register_backend(
    Backend(
        "torch",
        0,
        lambda: True,
        lambda problem: True,
        _load_torch,
        requirement="nothing",
        load_grouped=_load_torch_grouped,
    )
)
register_backend(
    Backend(
        "triton",
        10,
        _triton_available,
        _triton_supports,
        _load_triton,
        load_fused=_load_triton_fused,
        auto=lambda problem: problem.device.type == "cuda",  # never the interpreter unless asked for
        requirement=(
            "the triton extra (pip install kernelattn-core[triton]) and CUDA tensors (compute capability 8.0 or "
            "later) of dtype float16, bfloat16 or float32, or CPU tensors with TRITON_INTERPRET=1 set before "
            "triton is imported"
        ),
        load_step=_load_triton_step,
    )
)
