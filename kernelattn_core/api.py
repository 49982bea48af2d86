"""The user-facing vocabulary: :func:`create` and :func:`list_plugins`."""

from __future__ import annotations

from typing import Any

from .builtins.estimators import ExactAttention, FeatureMapAttention
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
