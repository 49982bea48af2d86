"""FastFood's dense path (V materialised once, one matrix product) against the
structured product: same values and the same gradients, for x and the learned diagonals."""

from __future__ import annotations

import pytest
import torch

import kernelattn_core as ka


@pytest.mark.parametrize("name", ["fastfood-prf", "fastfood-rks"])
def test_dense_projection_equals_structured_product(name: str) -> None:
    fm = ka.get_registry().feature_map(name)(head_dim=8, num_features=16, learn="sgb").double()
    x = torch.randn(3, 40, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    assert x.numel() > 8 * 8  # takes the dense path
    weight = torch.randn(3, 40, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    results = []
    for dense in (True, False):
        fm.zero_grad()
        x.grad = None
        y = fm.project(x) if dense else fm._structured(x)
        (y * weight).sum().backward()
        params = [p.grad.clone() for p in fm.parameters()]
        assert params, "learn='sgb' has learned diagonals"
        results.append((y, x.grad.clone(), *params))
    for dense, structured in zip(*results):
        torch.testing.assert_close(dense, structured, rtol=1e-12, atol=1e-12)
