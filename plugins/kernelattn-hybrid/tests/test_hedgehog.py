"""hedgehog: the stated features, per-head weights, determinism, and that it learns."""

from __future__ import annotations

import io

import pytest
import torch
from kernelattn_hybrid import HedgehogFeatureMap

import kernelattn_core as ka
from kernelattn_core.toolkit import InputError

F64 = torch.float64


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _trained_like(fm: HedgehogFeatureMap, seed: int = 0) -> HedgehogFeatureMap:
    """Give every parameter a non-trivial value, as after training."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in fm.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.5)
    return fm


@pytest.mark.parametrize("activation", ["exp", "softmax"])
def test_features_are_the_stated_formula(activation):
    fm = _trained_like(HedgehogFeatureMap(head_dim=4, num_features=6, num_heads=2, activation=activation).double())
    x = _rand(3, 2, 5, 4, seed=1)
    for query, w, b in ((True, fm.weight_q, fm.bias_q), (False, fm.weight_k, fm.bias_k)):
        got = fm.query(x) if query else fm.key(x)
        for h in range(2):
            u = x[:, h] @ w[h] + b[h]  # [3, 5, m]
            if activation == "exp":
                want = torch.cat([u.exp(), (-u).exp()], -1)
            else:
                want = torch.cat([u.softmax(-1), (-u).softmax(-1)], -1)
            torch.testing.assert_close(got[:, h], want * fm.log_scale[h].exp(), rtol=1e-12, atol=1e-14)
    assert fm.feature_dim == 6 and got.shape == (3, 2, 5, 6)


def test_shared_map_is_the_same_for_every_head_and_tied_shares_sides():
    fm = _trained_like(HedgehogFeatureMap(head_dim=4, num_features=8).double())
    x = _rand(2, 3, 5, 4, seed=2)
    one = fm.query(x[:, 1:2])
    torch.testing.assert_close(fm.query(x)[:, 1:2], one, rtol=0, atol=0)
    assert not torch.allclose(fm.query(x), fm.key(x))  # separate query and key weights
    tied = _trained_like(HedgehogFeatureMap(head_dim=4, num_features=8, tied=True).double())
    torch.testing.assert_close(tied.query(x), tied.key(x), rtol=0, atol=0)
    assert sum(p.numel() for p in tied.parameters()) < sum(p.numel() for p in fm.parameters())


def test_construction_is_deterministic_and_identity_like():
    a, b = (
        HedgehogFeatureMap(head_dim=8, num_features=32, num_heads=3),
        HedgehogFeatureMap(head_dim=8, num_features=32, num_heads=3),
    )
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na
    w = a.weight_q.detach()
    assert w.shape == (3, 8, 16)
    assert float((w[:, :, :8] - torch.eye(8)).abs().max()) < 0.5  # identity plus a small perturbation
    assert not torch.equal(a.weight_q, a.weight_k)  # different perturbations: sides not tied


def test_log_scale_cancels_in_feature_attention_but_not_in_the_hybrid():
    q, k, v = _rand(1, 2, 30, 8, seed=3), _rand(1, 2, 30, 8, seed=4), _rand(1, 2, 30, 3, seed=5)
    for name, options, cancels in (("hedgehog", {}, True), ("sliding-window", {"window": 2}, False)):
        est = ka.create(name, num_features=16, num_heads=2, **options).double()
        with torch.no_grad():
            before = est(q, k, v)
            est.feature_map.log_scale.fill_(3.0)
            after = est(q, k, v)
        same = torch.allclose(before, after, rtol=1e-12, atol=1e-12)
        assert same == cancels, name


def test_fitting_reduces_the_attention_error():
    torch.manual_seed(0)
    q, k, v = _rand(1, 2, 64, 8, seed=6), _rand(1, 2, 64, 8, seed=7), _rand(1, 2, 64, 4, seed=8)
    ref = ka.create("softmax")(q, k, v)
    est = ka.create("sliding-window", window=2, num_features=16, num_heads=2, head_dim=8).double()
    opt = torch.optim.Adam(est.parameters(), lr=0.05)

    def err() -> torch.Tensor:
        return (est(q, k, v) - ref).norm() / ref.norm()

    start = float(err().detach())
    for _ in range(60):
        opt.zero_grad()
        loss = err()
        loss.backward()
        opt.step()
    final = float(err().detach())
    assert final < 0.6 * start, (start, final)
    assert all(p.grad is not None for p in est.feature_map.parameters())


def test_state_dict_round_trip_with_heads():
    fm = _trained_like(HedgehogFeatureMap(head_dim=4, num_features=8, num_heads=3).double())
    buffer = io.BytesIO()
    torch.save(fm.state_dict(), buffer)
    buffer.seek(0)
    fresh = HedgehogFeatureMap(num_features=8, num_heads=3)  # not built: built from the state dict
    fresh.load_state_dict(torch.load(buffer))
    x = _rand(2, 3, 5, 4, seed=9)
    assert torch.equal(fresh.query(x), fm.query(x)) and fresh.weight_q.dtype == F64


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"num_features": 7}, "even"),
        ({"num_features": 0}, "num_features"),
        ({"num_heads": 0}, "num_heads"),
        ({"activation": "relu"}, "activation"),
        ({"tied": 1}, "tied"),
        ({"init_scale": -1.0}, "init_scale"),
    ],
)
def test_bad_options_are_named(options, needle):
    with pytest.raises(InputError, match=needle):
        HedgehogFeatureMap(**options)


def test_per_head_weights_need_matching_heads():
    fm = HedgehogFeatureMap(head_dim=4, num_features=8, num_heads=3)
    with pytest.raises(InputError, match=r"num_heads = 3"):
        fm.query(torch.randn(2, 4, 5, 4))
    with pytest.raises(InputError, match=r"num_heads = 3"):
        fm.query(torch.randn(5, 4))


def test_prf_init_is_calibrated_against_exact_softmax():
    # init="prf": antithetic positive random features, so before any fitting the map
    # estimates e^{q.k} on the exact terms' scale and the error falls as D grows
    q, k, v = (_rand(1, 2, 200, 16, seed=s) * 0.5 for s in (10, 11, 12))
    ref = ka.create("softmax")(q, k, v)
    errors = []
    with torch.no_grad():
        for d_total in (16, 256, 4096):
            est = ka.create("sliding-window", window=0, num_features=d_total, init="prf").double()
            errors.append(float((est(q, k, v) - ref).norm() / ref.norm()))
            fm = est.feature_map
            assert torch.equal(fm.weight_q, fm.weight_k)  # one draw for both sides
    assert errors[0] > errors[1] > errors[2] and errors[2] < 0.12, errors
    # the identity init is not an estimator of e^{q.k}: its error does not fall with D
    with torch.no_grad():
        ident = ka.create("sliding-window", window=0, num_features=4096).double()
        assert float((ident(q, k, v) - ref).norm() / ref.norm()) > 0.3
