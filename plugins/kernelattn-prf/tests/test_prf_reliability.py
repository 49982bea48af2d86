"""Reliability of the data-adapted maps CEXP / HCEXP (issue #15): a batch without
statistics (every key padded, no key at all, non-finite tokens) is skipped and the
running statistics never hold a non-finite value."""

from __future__ import annotations

import pytest
import torch

import kernelattn_core as ka

STATS = ("running_mean_q", "running_mean_k", "running_var_q", "running_var_k")


def _qkv(b=2, n=6, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, 2, n, d, generator=g) for _ in range(3))


def _buffers(est):
    fm = est.feature_map
    return {name: getattr(fm, name).clone() for name in STATS}, int(fm.num_batches_tracked)


@pytest.mark.parametrize("rule", ["means", "variance", "full"])
@pytest.mark.parametrize("name", ["cexp", "hcexp"])
def test_prf_all_padded_training_batch_is_skipped_and_eval_stays_finite(name, rule) -> None:
    est = ka.create(name, num_features=8, seed=0, rule=rule).train()
    q, k, v = _qkv()
    est(q, k, v)
    before, tracked = _buffers(est)
    est(q, k, v, key_padding_mask=torch.ones(2, 6, dtype=torch.bool))  # every key padded
    after, tracked_after = _buffers(est)
    assert tracked_after == tracked
    for key in STATS:
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=0)
    est.eval()
    assert torch.isfinite(est(q, k, v)).all()


@pytest.mark.parametrize("name", ["cexp", "hcexp"])
def test_prf_non_finite_tokens_never_enter_the_running_statistics(name) -> None:
    est = ka.create(name, num_features=8, seed=0, rule="variance").train()
    q, k, v = _qkv()
    q2, k2 = q.clone(), k.clone()
    q2[0, 0, 1] = float("nan")
    k2[1, 1, 2] = float("inf")
    est(q2, k2, v)
    for key, value in _buffers(est)[0].items():
        assert torch.isfinite(value).all(), key
    est.eval()
    assert torch.isfinite(est(q, k, v)).all()


@pytest.mark.parametrize("name", ["cexp", "hcexp"])
def test_prf_first_batch_all_padded_keeps_a_identity(name) -> None:
    est = ka.create(name, num_features=8, seed=0, rule="means").train()
    q, k, v = _qkv()
    est(q, k, v, key_padding_mask=torch.ones(2, 6, dtype=torch.bool))
    assert int(est.feature_map.num_batches_tracked) == 0
    torch.testing.assert_close(est.feature_map.scale, torch.ones(4))


def test_prf_fit_without_a_finite_row_is_a_clear_error() -> None:
    fm = ka.create("cexp", num_features=8, seed=0, rule="means").feature_map
    with pytest.raises(ka.InputError, match="finite row"):
        fm.fit(torch.full((3, 4), float("nan")), torch.randn(3, 4))
