"""Generative maps: architecture, determinism of initialisation, train/eval consistency, bounds."""

from __future__ import annotations

import pytest
import torch
from kernelattn_spectral import GenerativePRFFeatureMap, GenerativeRKSFeatureMap

from kernelattn_core.toolkit import InputError


def test_architecture_defaults_and_options() -> None:
    fm = GenerativeRKSFeatureMap(8, 16)
    assert [tuple(w.shape) for w in fm.weights] == [(16, 8), (16, 16), (16, 16), (16, 16)]  # 4 blocks of 2d
    assert tuple(fm.out_weight.shape) == (8, 16) and fm.feature_dim == 32
    fm2 = GenerativePRFFeatureMap(8, 16, noise_dim=3, hidden_dims=(5, 7), negative_slope=0.1)
    assert [tuple(w.shape) for w in fm2.weights] == [(5, 3), (7, 5)] and fm2.feature_dim == 16
    assert tuple(fm2.noise.shape) == (16, 3)


def test_errors() -> None:
    with pytest.raises(InputError, match="num_features"):
        GenerativeRKSFeatureMap(4, 1)
    with pytest.raises(InputError, match="hidden_dims"):
        GenerativeRKSFeatureMap(4, 8, hidden_dims=(4, 0))
    with pytest.raises(InputError, match="output_scale"):
        GenerativePRFFeatureMap(4, 8, output_scale=0.0)


@pytest.mark.parametrize("cls", [GenerativeRKSFeatureMap, GenerativePRFFeatureMap])
def test_initialisation_comes_from_the_generator(cls) -> None:
    a = cls(8, 16, generator=torch.Generator().manual_seed(3))
    b = cls(8, 16, generator=torch.Generator().manual_seed(3))
    c = cls(8, 16, generator=torch.Generator().manual_seed(4))
    for (_, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.weights[0], c.weights[0])
    w0 = a.weights[0].detach().clone()
    a.redraw(generator=torch.Generator().manual_seed(9))  # a redraw changes the noise, not the network
    assert torch.equal(a.weights[0], w0)
    assert not torch.equal(a.noise, b.noise)


def test_frequencies_bounded_and_mode_independent() -> None:
    fm = GenerativeRKSFeatureMap(8, 64, output_scale=2.0, generator=torch.Generator().manual_seed(0))
    w_train = fm.frequencies()
    fm.eval()
    w_eval = fm.frequencies()
    torch.testing.assert_close(w_train, w_eval)  # batch statistics over the M samples in both modes
    assert w_train.abs().max() < 2.0
    # gradients reach every generator parameter
    x = torch.randn(5, 8)
    fm.kernel_estimate(x, x).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in fm.named_parameters() if "bn_bias" not in n)


def test_prf_features_positive_for_large_inputs() -> None:
    fm = GenerativePRFFeatureMap(8, 32, generator=torch.Generator().manual_seed(0))
    x = 30 * torch.randn(10, 8)
    logs = fm.query_log(x)
    assert logs.isfinite().all()
    # naive reference of the log features
    w = fm.frequencies()
    ref = x @ w.T - 0.5 * x.pow(2).sum(-1, keepdim=True) - 0.5 * torch.log(torch.tensor(32.0))
    torch.testing.assert_close(logs, ref)
