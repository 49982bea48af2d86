"""The redraw policy: schedule, eval freezing, seeding, state_dict round trips."""

from __future__ import annotations

import io
import itertools

import pytest
import torch

import kernelattn_core as ka

from .conftest import qkv


def _omega(est: ka.FeatureMapAttention) -> torch.Tensor:
    return est.feature_map.omega.clone()


def test_redraw_every_k_training_steps(use_registry) -> None:
    q, k, v = qkv()
    est = ka.create("toy-prf", redraw_every=3, seed=11)
    est.train()
    seen = []
    for _ in range(7):
        est(q, k, v)
        seen.append(_omega(est))
    changes = [not torch.equal(a, b) for a, b in itertools.pairwise(seen)]
    # calls 0,1,2 use draw 0; call 3 redraws; call 6 redraws
    assert changes == [False, False, True, False, False, True]


def test_never_redraw_when_every_is_zero(use_registry) -> None:
    q, k, v = qkv()
    est = ka.create("toy-prf", redraw_every=0, seed=1).train()
    est(q, k, v)
    first = _omega(est)
    for _ in range(5):
        est(q, k, v)
    assert torch.equal(_omega(est), first)


def test_eval_mode_is_frozen(use_registry) -> None:
    q, k, v = qkv()
    est = ka.create("toy-prf", redraw_every=1, seed=2)
    est(q, k, v)
    est.eval()
    outs = [est(q, k, v) for _ in range(4)]
    assert all(torch.equal(outs[0], o) for o in outs)


def test_same_seed_same_draws_on_replicas(use_registry) -> None:
    """Data-parallel replicas with the same seed draw identical features at every step."""
    q, k, v = qkv()
    a = ka.create("toy-prf", redraw_every=2, seed=5).train()
    b = ka.create("toy-prf", redraw_every=2, seed=5).train()
    for _ in range(5):
        torch.testing.assert_close(a(q, k, v), b(q, k, v), rtol=0, atol=0)
    c = ka.create("toy-prf", redraw_every=2, seed=6).train()
    c(q, k, v)
    a2 = ka.create("toy-prf", redraw_every=2, seed=5).train()
    a2(q, k, v)
    assert not torch.equal(_omega(c), _omega(a2))


def test_global_seed_makes_unseeded_policies_reproducible(use_registry) -> None:
    q, k, v = qkv()
    torch.manual_seed(0)
    a = ka.create("toy-prf")(q, k, v)
    torch.manual_seed(0)
    b = ka.create("toy-prf")(q, k, v)
    assert torch.equal(a, b)


def test_state_dict_round_trip_is_bit_identical_and_keeps_the_schedule(use_registry) -> None:
    q, _k, _v = qkv(dtype=torch.float32)
    model = ka.KernelAttention(24, 3, estimator="toy-prf", redraw_every=2, num_features=16, batch_first=True)
    model.train()
    for _ in range(3):
        model(q[:, 0, :, :].repeat(1, 1, 3))  # advance the schedule (3 training steps)
    x = torch.randn(2, 9, 24)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    reloaded = ka.KernelAttention(24, 3, estimator="toy-prf", redraw_every=2, num_features=16, batch_first=True)
    reloaded.load_state_dict(torch.load(buffer))
    model.eval()
    reloaded.eval()
    assert torch.equal(model(x)[0], reloaded(x)[0])
    model.train()
    reloaded.train()
    for _ in range(3):  # the reloaded model continues the same redraw schedule
        assert torch.equal(model(x)[0], reloaded(x)[0])


def test_redraw_policy_rejects_bad_arguments() -> None:
    with pytest.raises(ka.InputError, match="redraw_every: expected an integer >= 0, got -1"):
        ka.RedrawPolicy(-1)
    with pytest.raises(ka.InputError, match="seed: expected an int or None"):
        ka.RedrawPolicy(1, seed="x")  # type: ignore[arg-type]


def test_budget_whose_draw_would_not_fit_is_refused_with_the_size_it_needs() -> None:
    from kernelattn_core.validation import MAX_DRAW_ELEMENTS

    with pytest.raises(ka.InputError, match=r"num_features: .*got num_features = 1,000,000,000.*7\.5 GiB"):
        ka.create("elu", num_features=10**9)
    with pytest.raises(ka.InputError, match=r"num_features: .*got num_features = 1,000,000,000"):
        ka.create("feature-map", num_features=10**9)
    # fits alone, not once the head dimension is known: refused at build, before any allocation
    est = ka.create("elu", num_features=MAX_DRAW_ELEMENTS // 4)
    q = torch.randn(1, 1, 2, 8)
    with pytest.raises(ka.InputError, match=r"num_features = 67,108,864 × head_dim = 8"):
        est(q, q, q)


def test_seeded_estimator_built_at_construction_or_lazily_draws_the_same() -> None:
    name = "example-antithetic" if "example-antithetic" in ka.get_registry().names() else "rff"
    a = ka.create(name, seed=3, head_dim=4, num_features=8)
    b = ka.create(name, seed=3, num_features=8)
    c = ka.create(name, seed=4, num_features=8)
    q = torch.randn(1, 1, 3, 4)
    torch.testing.assert_close(a(q, q, q), b(q, q, q))
    assert not torch.allclose(a(q, q, q), c(q, q, q))  # the seed does matter


def test_policy_seed_survives_a_state_dict_round_trip_untouched() -> None:
    from kernelattn_core.redraw import RedrawPolicy

    p = RedrawPolicy(1, seed=None)
    p2 = RedrawPolicy(1, seed=None)
    p2._seed_settled = False
    p2.load_state_dict(p.state_dict())
    assert p2._seed_settled and int(p2.seed) == int(p.seed)
