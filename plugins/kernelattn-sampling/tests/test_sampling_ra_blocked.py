"""RA's memory-bounded blocked path against the full path (same estimator, same draws
in evaluation)."""

from __future__ import annotations

import kernelattn_sampling.chunked as chunked
import pytest
import torch

import kernelattn_core as ka


def _inputs(n: int = 13, d: int = 4, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 2, n, d, generator=g, dtype=torch.float64) for _ in range(3))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("eval_noise", [False, True])
def test_blocked_path_equals_full_path_in_evaluation(
    monkeypatch: pytest.MonkeyPatch, causal: bool, eval_noise: bool
) -> None:
    q, k, v = _inputs()
    mask = torch.zeros(2, 13, dtype=torch.bool)
    mask[0, :2] = True  # the first causal rows of batch 0 see no key
    mask[1, 7] = True
    est = ka.create("ra", num_features=3, eval_noise=eval_noise).eval()
    weight = torch.linspace(-1, 1, 4, dtype=torch.float64)
    results = []
    for blocked in (False, True):
        monkeypatch.setattr(chunked, "THRESHOLD", 0 if blocked else 1 << 40)
        monkeypatch.setattr(chunked, "BLOCK_ELEMENTS", 5 * 3 * 13)  # blocks of 5 rows: 3 blocks
        a, b, c = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = est(a, b, c, causal=causal, key_padding_mask=mask)
        (out * weight).sum().backward()
        results.append((out, a.grad, b.grad, c.grad))
    for got, ref in zip(*results):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    if causal:
        assert (results[1][0][0, :, :2] == 0).all()


def test_blocked_path_memory_does_not_hold_the_full_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peak memory of a blocked RA call stays below one [N, M] float32 matrix, which the
    full path (the negative control) holds several times over."""
    from kernelattn_core.toolkit import peak_memory

    q, k, v = (t[:1, :1].float() for t in _inputs(n=2048, d=8, seed=1))
    est = ka.create("ra", num_features=1).eval()
    one_matrix = 2048 * 2048 * 4
    peaks = []
    for blocked in (False, True):
        monkeypatch.setattr(chunked, "THRESHOLD", 0 if blocked else 1 << 40)
        monkeypatch.setattr(chunked, "BLOCK_ELEMENTS", 1 << 17)  # 64 rows per block
        with torch.no_grad():
            peaks.append(peak_memory(lambda: est(q, k, v, causal=True), q.device))
    assert peaks[0] > 2 * one_matrix
    assert peaks[1] < one_matrix


def test_training_draws_are_unbiased_in_the_blocked_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Training draws come from the generator block by block: averaged over many calls
    the blocked estimate approaches exact softmax attention (RA is unbiased)."""
    monkeypatch.setattr(chunked, "THRESHOLD", 0)
    monkeypatch.setattr(chunked, "BLOCK_ELEMENTS", 4 * 64 * 9)
    q, k, v = (0.5 * t[:1, :1] for t in _inputs(n=9, d=4, seed=2))
    est = ka.create("ra", num_features=64, generator=torch.Generator().manual_seed(0)).train()
    mean = sum(est(q, k, v, causal=True) for _ in range(40)) / 40
    exact = ka.create("softmax")(q, k, v, causal=True)
    naive_err = (v.mean(2, keepdim=True) - exact).abs().max()  # a wrong estimator's scale of error
    assert (mean - exact).abs().max() < 0.1 * naive_err
