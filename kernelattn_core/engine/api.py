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
    return estimator(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
