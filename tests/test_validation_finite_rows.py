"""``finite_rows``: the rows of a tensor whose every entry is finite, from two reductions
(the non-finite checks of the engine and the plugins go through it)."""

from __future__ import annotations

import pytest
import torch

from kernelattn_core.toolkit import finite_rows


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_finite_rows_equals_isfinite_all_for_every_position_and_kind_of_bad_value(dtype: torch.dtype) -> None:
    """Each row length from 1 to 70 (below, at and across the CPU's vector widths), a NaN,
    +inf or -inf at every position in turn, among finite values of both signs."""
    g = torch.Generator().manual_seed(0)
    for n in range(1, 71):
        x = torch.randn(3 * n + 1, n, generator=g).to(dtype)
        for j in range(n):
            x[3 * j, j] = float("nan")
            x[3 * j + 1, j] = float("inf")
            x[3 * j + 2, j] = float("-inf")
        got = finite_rows(x)
        assert torch.equal(got, torch.isfinite(x).all(-1)), n
        assert int(got.sum()) == 1  # only the last row is finite


def test_finite_rows_of_batched_views_and_empty_rows() -> None:
    x = torch.randn(2, 3, 40, 16).transpose(-1, -2)  # a non-contiguous view, rows of 40
    x[1, 2, 5, 7] = float("nan")
    assert torch.equal(finite_rows(x), torch.isfinite(x).all(-1))
    assert finite_rows(torch.zeros(4, 0)).tolist() == [True] * 4
    y = torch.randn(5, 3, requires_grad=True)
    assert not finite_rows(y).requires_grad


def test_all_finite_agrees_with_isfinite_all_including_a_sum_that_overflows() -> None:
    from kernelattn_core.validation import all_finite

    x = torch.randn(3, 4, 5)
    big = torch.full((4,), 3e38)  # finite entries whose float32 sum overflows to inf
    cases = [x, big, torch.empty(0), x.clone().index_put_((torch.tensor([1]),), torch.tensor(float("nan")))]
    cases.append(x.clone().index_put_((torch.tensor([2]),), torch.tensor(float("-inf"))))
    for t in cases:
        assert all_finite(t) == bool(torch.isfinite(t).all())
    assert all_finite(x, big) and not all_finite(x, cases[3])
