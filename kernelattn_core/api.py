"""The user-facing vocabulary: :func:`create`, :func:`kernel_attention` and :func:`list_plugins`.

The one spine of issue 27: ``create`` resolves every registry name (what it builds
receives classes and instances), ``kernel_attention`` calls the estimator it is given
with the backend as a call argument (the estimator is not changed).
"""

from __future__ import annotations

from typing import Any

import torch

from .builtins.estimators import ExactAttention, FeatureMapAttention
from .engine.backends import backend_for_call
from .engine.backends import backends as registered_backends
from .errors import InputError
from .interfaces import AttentionEstimator
from .registry import construct, get_registry
from .validation import check_budget


def create(name: str, **options: Any) -> AttentionEstimator:
    """A ready attention estimator from any registered name.

    * an **estimator** name builds that estimator with ``options``;
    * a **feature-map** name is wrapped in
      :class:`~kernelattn_core.builtins.FeatureMapAttention` with the default
      normaliser (``options`` go to it and to the map: ``num_features``, ``redraw_every``,
      ``seed``, ``normalizer``, ...);
    * a **kernel** name gives exact attention with that kernel
      (:class:`~kernelattn_core.builtins.ExactAttention`).

    The budget option is ``num_features`` for every estimator that has one (random
    features, samples or landmarks), so one loop sweeps them all; a budget above
    :data:`~kernelattn_core.validation.MAX_DRAW_ELEMENTS` is refused with the size it
    would need.

    Examples
    --------
    >>> import kernelattn_core as ka
    >>> ka.create("softmax")
    ExactAttention(kernel=SoftmaxKernel(), scale=None)
    >>> ka.create("elu").feature_map.name
    'elu'
    """
    registry = get_registry()
    entry = registry.get(name)
    if "num_features" in options and options["num_features"] is not None:
        check_budget("num_features", options["num_features"])
    # every name is resolved here: what is built below receives classes and instances
    if entry.kind == "estimator":
        return construct("estimator", entry.cls, f"create({name!r})", options)
    if entry.kind == "feature_map":
        normalizer = options.get("normalizer")
        if normalizer is None:
            normalizer = _default_normalizer(entry.cls)
        if isinstance(normalizer, str):
            options = {**options, "normalizer": registry.get(normalizer, "normalizer").cls}
        return FeatureMapAttention(entry.cls, **options)
    if entry.kind == "kernel":
        return ExactAttention(entry.cls, **options)
    from .errors import UnknownNameError

    raise UnknownNameError(
        f"create: {name!r} is a {entry.kind.replace('_', ' ')}, not an estimator, feature map or kernel; "
        f"pass it as normalizer={name!r} to a feature-map estimator"
    )


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
        The feature-attention backend of feature-map estimators, for this call (the
        estimator's own ``backend`` option is not changed; concurrent calls do not see
        each other's). ``"auto"`` picks the
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
    if not isinstance(backend, str) or backend != "auto":
        # read from the registry at each call (a name bound at import would keep an old table)
        known = sorted(b.name for b in registered_backends())
        if backend not in known:
            raise InputError(f"backend: expected 'auto' or one of {known}, got {backend!r}")
    if backend == "auto" or not isinstance(estimator, FeatureMapAttention):
        if backend not in ("auto", "torch"):
            raise InputError(
                f"backend: estimator {estimator.name!r} does not run through feature-attention backends; "
                f"expected 'auto' or 'torch', got {backend!r}"
            )
        return estimator(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
    with backend_for_call(estimator, backend):  # this call only: the estimator is not changed
        return estimator(q, k, v, causal=causal, key_padding_mask=key_padding_mask)


def _default_normalizer(cls: type) -> object:
    """The ``default_normalizer`` a feature-map class declares (inherited included); a
    property (a per-instance choice) gives ``None``: the estimator then asks the map."""
    for klass in cls.__mro__:
        if "default_normalizer" in vars(klass):
            value = vars(klass)["default_normalizer"]
            return value if isinstance(value, str) else None
    return None


def list_plugins() -> list[dict[str, Any]]:
    """Each plugin with its distribution, version, registered classes and their
    capability flags (the data behind ``kernelattn plugins``)."""
    out = []
    for info in get_registry().plugins():
        out.append(
            {
                "plugin": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "classes": [
                    {
                        "name": e.name,
                        "kind": e.kind,
                        "class": f"{e.cls.__module__}.{e.cls.__qualname__}",
                        "aliases": list(vars(e.cls).get("aliases", ())),
                        **e.flags(),
                    }
                    for e in info.entries
                ],
                "errors": list(info.errors),
            }
        )
    return out
