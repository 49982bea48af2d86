"""RT001: a quantity the runtime object computes against a closed form written apart
from it (float64, seeded, parameters optionally perturbed to trained-like values)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..claims import RuntimeIdentity
from .engine import SEED, _perturb, build_estimator
from .result import CheckResult, verdict


def build_object(entry: Any, claim: RuntimeIdentity) -> Any:
    """The registered class built with ``claim.options`` in float64: a feature map built
    at head dimension ``claim.dim`` with ``claim.num_features`` (fixed generator), a
    normaliser or kernel from its constructor, an estimator through :func:`create`."""
    options = dict(claim.options)
    if entry.kind == "feature_map":
        if getattr(entry.cls, "has_budget", True) and "num_features" not in options:
            options["num_features"] = claim.num_features
        obj = entry.cls(**options)
        obj.build(claim.dim, generator=torch.Generator().manual_seed(SEED))
        return obj.double()
    if entry.kind in ("normalizer", "kernel"):
        return entry.cls(**options).double()
    return build_estimator(entry, options, claim.num_features)


def check_runtime_identity(entry: Any, claim: RuntimeIdentity, level: str, **ids: str) -> CheckResult:
    """RT001: ``evaluate(obj, generator) -> (value, target, note)`` agree to ``rtol``."""
    if claim.evaluate is None:
        raise ValueError("RuntimeIdentity.evaluate is not set")
    obj = build_object(entry, claim)
    _perturb(obj, claim.perturb, SEED + 13)
    with torch.no_grad():
        value, target, note = claim.evaluate(obj, torch.Generator().manual_seed(SEED + 17))
    value = torch.as_tensor(value, dtype=torch.float64)
    target = torch.as_tensor(target, dtype=torch.float64)
    if value.shape != target.shape:
        numbers: dict[str, Any] = {"value_shape": list(value.shape), "target_shape": list(target.shape)}
        ok = False
    else:
        scale = float(target.abs().max()) if target.numel() else 0.0
        diff = float((value - target).abs().max()) if target.numel() else 0.0
        finite = bool(torch.isfinite(value).all()) and bool(torch.isfinite(target).all())
        rel = diff / max(scale, 1e-300) if finite else math.inf
        ok = finite and rel <= claim.rtol
        numbers = {
            "elements": int(target.numel()),
            "max_rel_diff": float(f"{rel:.3g}") if math.isfinite(rel) else "inf",
            "rtol": claim.rtol,
        }
    if claim.perturb:
        numbers["perturb"] = claim.perturb
    return CheckResult(
        RuntimeIdentity.rule,
        claim=f"{claim.label or 'runtime'} == closed form ({note})",
        numbers=numbers,
        verdict=verdict(ok),
        **ids,
    )


__all__ = ["build_object", "check_runtime_identity"]
