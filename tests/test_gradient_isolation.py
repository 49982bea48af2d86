"""A non-finite value reaches the gradients of no row that does not see it.

Every registered causal estimator (feature maps through feature-map attention, kernels
through exact attention), built from the registry at collection time: a NaN key or value
at position 8 (seen by rows >= 8 only) or a NaN query in row 8 (its own row only). A loss
on the rows that do not see it must give finite gradients at every other position. Before
the quarantine, the NaN rows sent 0 * NaN back through their own normaliser (exact
attention, ``ra``, ``ra-biased``; a NaN query in ``rfa-gate`` and ``sliding-window``).
"""

from __future__ import annotations

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core.testing.fuzz import make


def _causal_names() -> list[str]:
    names = []
    for entry in ka.get_registry().entries():
        if entry.kind in ("estimator", "feature_map", "kernel") and getattr(entry.cls, "supports_causal", True):
            names.append(entry.name)
    return sorted(names)


@pytest.mark.parametrize("where", ["k", "v", "q"])
@pytest.mark.parametrize("name", _causal_names())
def test_a_nan_reaches_no_gradient_of_a_row_that_does_not_see_it(name: str, where: str) -> None:
    try:
        est = make(ka.get_registry().get(name)).double().eval()
        if not getattr(est, "supports_causal", True):
            pytest.skip("non-causal estimator")
    except Exception as exc:  # a class that cannot be built with defaults is covered elsewhere
        pytest.skip(f"not buildable with defaults: {exc}")
    g = torch.Generator().manual_seed(0)
    q, k, v = (0.5 * torch.randn(1, 2, 12, 4, generator=g, dtype=torch.float64) for _ in range(3))
    {"q": q, "k": k, "v": v}[where][0, :, 8] = float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = est(q, k, v, causal=True)
    rows = torch.ones(12, dtype=torch.bool)
    rows[8 if where == "q" else slice(8, None)] = False  # the rows that see it
    assert bool(torch.isnan(out[:, :, ~rows]).all()), "a row that sees the NaN should be NaN"
    assert bool(torch.isfinite(out[:, :, rows]).all())
    grads = torch.autograd.grad(out[:, :, rows].sum(), (q, k, v), allow_unused=True)
    others = torch.ones(12, dtype=torch.bool)
    others[8] = False
    for arg, grad in zip("qkv", grads):
        if grad is not None:
            assert bool(torch.isfinite(grad[:, :, others]).all()), f"{name}: NaN in {arg}.grad of another position"
