"""Backends of feature-map attention, described by data and chosen at run time.

A backend is a :class:`Backend` record: a name, a priority, an availability check
that imports nothing heavy, a predicate saying which problems it supports, and a
loader that imports the implementation only when it is first used. The engine picks
the available, supporting backend of highest priority (or the one asked for by
name) and reports which one ran through ``estimator.last_backend``.

Only the plain torch backend exists in the core; fast paths (Triton) register
themselves here with a higher priority.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import InputError


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
    """

    name: str
    priority: int
    is_available: Callable[[], bool]
    supports: Callable[[Problem], bool]
    load: Callable[[], FeatureAttentionFn]


def _load_torch() -> FeatureAttentionFn:
    from .torch_backend import feature_attention_torch

    return feature_attention_torch


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add a backend (a plugin's fast path). Names are unique."""
    if backend.name in _BACKENDS:
        raise InputError(f"backend.name: {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend


def backends() -> list[Backend]:
    """All registered backends, highest priority first."""
    return sorted(_BACKENDS.values(), key=lambda b: -b.priority)


def select_backend(problem: Problem, prefer: str | None = None) -> Backend:
    """The backend to run ``problem``: ``prefer`` if given (an error if it cannot),
    else the available supporting backend of highest priority."""
    if prefer is not None:
        if prefer not in _BACKENDS:
            raise InputError(f"backend: expected one of {sorted(_BACKENDS)}, got {prefer!r}")
        chosen = _BACKENDS[prefer]
        if not chosen.is_available():
            raise InputError(f"backend: {prefer!r} is not available on this machine")
        if not chosen.supports(problem):
            raise InputError(f"backend: {prefer!r} does not support {problem}")
        return chosen
    for candidate in backends():
        if candidate.is_available() and candidate.supports(problem):
            return candidate
    raise InputError(f"backend: no backend supports {problem}")  # pragma: no cover - torch supports all


register_backend(Backend("torch", 0, lambda: True, lambda problem: True, _load_torch))
