"""The public engine call."""

from __future__ import annotations

import torch

from ..errors import InputError
from ..interfaces.estimator import AttentionEstimator


def kernel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    estimator: AttentionEstimator,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of ``q [B, H, N, d]`` over ``k [B, H, M, d]``, ``v [B, H, M, dv]``.

    Parameters
    ----------
    q, k, v : Tensor
        Queries, keys and values. ``M`` may differ from ``N`` (cross-attention) and
        ``dv`` from ``d``.
    estimator : AttentionEstimator
        For example ``create("softmax")`` (exact) or ``create("elu")``.
    causal : bool
        Query ``i`` attends to keys ``j <= i`` only (needs ``N == M``).
    key_padding_mask : Tensor ``[B, M]`` of bool, optional
        ``True`` marks a padded key; padded keys leave numerator and normaliser. A
        query whose keys are all masked gets zeros.
    backend : {"auto", "torch", "triton"} or a registered backend name
        The feature-attention backend of feature-map estimators. ``"auto"`` picks the
        fastest available one that supports the call (``"triton"`` for CUDA tensors
        when Triton imports, else ``"torch"``); a name forces it, and a backend that
        cannot run the call raises :class:`~kernelattn_core.errors.InputError` saying
        what it needs. ``"triton"`` runs CPU tensors only under ``TRITON_INTERPRET=1``.
        Estimators that do not go through feature attention (exact softmax, sampling)
        accept ``"auto"`` and ``"torch"`` only.

    Returns
    -------
    Tensor ``[B, H, N, dv]`` in the dtype of ``q``.

    Examples
    --------
    >>> import torch, kernelattn_core as ka
    >>> q = k = v = torch.randn(2, 4, 16, 8, dtype=torch.float64)
    >>> out = ka.kernel_attention(q, k, v, ka.create("softmax"), causal=True)
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> bool(torch.allclose(out, ref, atol=1e-12))
    True
    """
    if not isinstance(estimator, AttentionEstimator):
        raise InputError(
            f"estimator: expected an AttentionEstimator (e.g. kernelattn_core.create('softmax')), "
            f"got {type(estimator).__name__}"
        )
    from ..builtins.estimators import FeatureMapAttention
    from .backends import _BACKENDS

    if backend != "auto" and backend not in _BACKENDS:
        raise InputError(f"backend: expected 'auto' or one of {sorted(_BACKENDS)}, got {backend!r}")
    if backend == "auto" or not isinstance(estimator, FeatureMapAttention):
        if backend not in ("auto", "torch"):
            raise InputError(
                f"backend: estimator {estimator.name!r} does not run through feature-attention backends; "
                f"expected 'auto' or 'torch', got {backend!r}"
            )
        return estimator(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
    saved = estimator.backend
    estimator.backend = backend  # for this call only
    try:
        return estimator(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
    finally:
        estimator.backend = saved
