"""Decoding states know their owner, and checkpoints know their family.

* Every ``step`` (feature-map attention's running sums, ``rfa-gate``'s gated sums, the
  key-value cache of :class:`~kernelattn_core.KernelAttention` for the others) refuses a
  foreign state with an :class:`~kernelattn_core.InputError` naming ``state``: another
  batch size, another width, another feature count, another estimator's state, or not a
  state at all. Before (issue 25), of 1041 such states over every registered causal name,
  198 were accepted silently (a batch-1 state broadcast over batch 2, another map's sums
  of the same width) and 409 failed with an AttributeError or a torch shape error.
* ``load_state_dict`` refuses another family's checkpoint naming both (252 pairs of
  registered names were accepted before, prf into prf-hyperbolic, cexp into hcexp,
  hedgehog into sliding-window among them); a checkpoint saved before states named their
  family still loads.

CI cost: about 20 s.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core.engine.torch_backend import feature_attention_step
from kernelattn_core.interfaces.state import FAMILY_KEY, StateOwner

REG = ka.get_registry()
CAUSAL_NAMES = sorted(
    e.name
    for e in REG.entries()
    if e.kind in ("estimator", "feature_map", "kernel") and getattr(e.cls, "supports_causal", True)
)


def _module(name: str, embed: int = 16, num_features: int = 16) -> ka.KernelAttention:
    entry = REG.get(name)
    opts: dict[str, Any] = {}
    if getattr(entry.cls, "has_budget", False) and entry.kind != "kernel":
        opts["num_features"] = num_features
    if getattr(entry.cls, "random", False) and entry.kind != "kernel":
        opts["seed"] = 0
    torch.manual_seed(0)
    return ka.KernelAttention(embed, 2, estimator=name, causal=True, batch_first=True, **opts).double()


def _state(module: ka.KernelAttention, batch: int = 2, embed: int = 16) -> Any:
    x = 0.1 * torch.randn(batch, 3, embed, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        return module.step(x)[1]


@pytest.fixture(scope="module")
def states() -> dict[str, Any]:
    return {name: _state(_module(name)) for name in CAUSAL_NAMES}


@pytest.mark.parametrize("name", CAUSAL_NAMES)
def test_every_foreign_state_is_refused_naming_state(name: str, states: dict[str, Any]) -> None:
    module = _module(name)
    foreign: list[tuple[str, Any]] = [("a batch-1 state", _state(module, batch=1)), ("a dict", {"kv": 1})]
    foreign.append(("another width", _state(_module(name, embed=32), embed=32)))
    entry = REG.get(name)
    if getattr(entry.cls, "has_budget", False) and entry.kind != "kernel":
        foreign.append(("another feature count", _state(_module(name, num_features=32))))
    foreign += [(f"the state of {other}", st) for other, st in states.items() if other != name]
    x = 0.1 * torch.randn(2, 1, 16, dtype=torch.float64)
    problems = []
    for label, state in foreign:
        try:
            with torch.no_grad():
                module.step(x, state)
        except ka.InputError as exc:
            if not str(exc).startswith("state:"):
                problems.append(f"{label}: InputError not naming state: {exc}")
        except Exception as exc:
            problems.append(f"{label}: {type(exc).__name__}: {exc}")
        else:
            problems.append(f"{label}: accepted silently")
    assert not problems, f"{name}: " + "\n".join(problems)
    with torch.no_grad():  # its own state continues
        module.step(x, states[name])


def test_another_maps_state_of_the_same_width_names_both_owners() -> None:
    """prf with 32 features and prf-hyperbolic with 16 both have D = 32: the sums fitted,
    and were continued silently with the other map's meaning."""
    a, b = ka.create("prf", num_features=32, seed=0), ka.create("prf-hyperbolic", num_features=16, seed=0)
    q = torch.randn(1, 2, 3, 8)
    _, state = a.step(q, q, q)
    with pytest.raises(
        ka.InputError, match=r"state: expected the state of FeatureMapAttention\(feature_map='prf-hyperb"
    ):
        b.step(q, q, q, state)
    with pytest.raises(
        ka.InputError, match="got the state of FeatureMapAttention\\(feature_map='prf'.*differs in options"
    ):
        b.step(q, q, q, state)


def test_a_batch_one_state_is_not_broadcast_over_a_larger_batch() -> None:
    est = ka.create("elu")
    q1, q2 = torch.randn(1, 2, 3, 8), torch.randn(2, 2, 1, 8)
    _, state = est.step(q1, q1, q1)
    with pytest.raises(ka.InputError, match="state: .*differs in batch"):
        est.step(q2, q2, q2, state)


def test_a_state_made_by_the_engine_directly_still_continues() -> None:
    """States without an owner (feature_attention_step, or made before states knew
    theirs) are checked by shape only."""
    est = ka.create("prf", num_features=8, seed=0).double()
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    full = est(q, q, q, causal=True)
    qs = q * est._input_root(4)
    fm = est.feature_map
    _, _, state = feature_attention_step(
        fm.raw_features(qs[:, :, :3], query=True),
        fm.raw_features(qs[:, :, :3], query=False),
        q[:, :, :3],
        log_space=True,
        key_padding_mask=None,
        state=None,
    )
    assert state.owner is None
    out, state = est.step(q[:, :, 3:], q[:, :, 3:], q[:, :, 3:], state)
    torch.testing.assert_close(out, full[:, :, 3:])
    assert isinstance(state.owner, StateOwner)
    state.z = state.z[:, :1]
    with pytest.raises(ka.InputError, match=r"state: expected z of shape \[1, 2, 8\]"):
        est.step(q[:, :, 4:], q[:, :, 4:], q[:, :, 4:], state)


FAMILY_NAMES = sorted(e.name for e in REG.entries() if e.kind in ("estimator", "feature_map", "kernel", "normalizer"))


def _built(name: str) -> torch.nn.Module:
    entry = REG.get(name)
    if entry.kind == "normalizer":
        return entry.cls()
    torch.manual_seed(0)
    opts = {"num_features": 16} if getattr(entry.cls, "has_budget", False) and entry.kind != "kernel" else {}
    est = ka.create(name, **opts)
    x = 0.1 * torch.randn(1, 2, 4, 8)
    est(x, x, x, causal=not getattr(est, "supports_noncausal", True))  # builds lazily made state
    return est


def _family(module: torch.nn.Module) -> tuple:
    return tuple(sorted((k, bytes(v.tolist()).decode()) for k, v in module.state_dict().items() if FAMILY_KEY in k))


def test_load_state_dict_refuses_another_familys_checkpoint_naming_both() -> None:
    modules = {name: _built(name) for name in FAMILY_NAMES}
    problems, pairs = [], 0
    for a, ma in modules.items():
        saved = ma.state_dict()
        for b, mb in modules.items():
            if _family(ma) == _family(mb):  # aliases of one family ("feature-map" is elu's)
                continue
            pairs += 1
            try:
                mb.load_state_dict(saved)
            except ka.InputError as exc:
                if "state_dict: a checkpoint of" not in str(exc) or "cannot be loaded into" not in str(exc):
                    problems.append(f"{a} -> {b}: {exc}")
            except Exception as exc:
                problems.append(f"{a} -> {b}: {type(exc).__name__}: {exc}")
            else:
                problems.append(f"{a} -> {b}: accepted")
    assert pairs > 1000
    assert not problems, "\n".join(problems[:20])


def test_the_message_names_both_families_and_the_keys() -> None:
    a = ka.create("prf", num_features=8, head_dim=4, seed=0)
    b = ka.create("prf-hyperbolic", num_features=4, head_dim=4, seed=0)
    with pytest.raises(
        ka.InputError,
        match=r"a checkpoint of 'prf' \(keys under 'feature_map\.'\) cannot be loaded into 'prf-hyperbolic'",
    ):
        b.load_state_dict(a.state_dict())


def test_the_same_family_round_trips_and_an_old_checkpoint_still_loads() -> None:
    a = ka.create("gmm-prf", num_features=8, head_dim=4, seed=0)
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b = ka.create("gmm-prf", num_features=8, seed=1)
    b.load_state_dict(torch.load(buffer))
    q = torch.randn(1, 2, 5, 4)
    torch.testing.assert_close(b(q, q, q), a(q, q, q))
    old = {k: v for k, v in a.state_dict().items() if FAMILY_KEY not in k}  # saved before markers existed
    c = ka.create("gmm-prf", num_features=8, seed=2)
    c.load_state_dict(old)
    torch.testing.assert_close(c(q, q, q), a(q, q, q))


@pytest.mark.parametrize("name", ["prf", "softmax", "rfa-gate", "gmm-prf", "schoenbat"])
def test_modules_still_pickle_whole(name: str) -> None:
    """The family hooks are module-level functions: torch.save(module) keeps working (a
    closure made it fail with "Can't pickle local object")."""
    est = _built(name).eval()
    buffer = io.BytesIO()
    torch.save(est, buffer)
    buffer.seek(0)
    back = torch.load(buffer, weights_only=False)
    x = 0.1 * torch.randn(1, 2, 4, 8)
    mode = {"causal": True} if not getattr(est, "supports_noncausal", True) else {}
    torch.testing.assert_close(back(x, x, x, **mode), est(x, x, x, **mode))
    assert _family(back) == _family(est)


def test_continued_sums_takes_only_the_planned_state_and_position() -> None:
    """The short decoding steps' shared precondition: the plan comes back for a state of its
    type, owner (or an equal one), sums shape and dtype, not poisoned, and inputs of the one
    planned position; every other case gives None (the guarded step then checks)."""
    from dataclasses import replace

    from kernelattn_core.engine.chunked import CausalState
    from kernelattn_core.toolkit import continued_sums

    est = ka.create("prf", num_features=8, head_dim=4, seed=0)
    q = torch.randn(1, 2, 3, 4)
    _, state = est.step(q, q, q)
    plan = est._finite_step
    one = torch.randn(1, 2, 1, 4)
    assert continued_sums(plan, state, CausalState, one, one, one) is plan
    equal_owner = replace(state, owner=replace(state.owner))
    assert continued_sums(plan, equal_owner, CausalState, one, one, one) is plan
    refused = {
        "no plan": (None, state, CausalState, (one, one, one)),
        "another state type": (plan, state, dict, (one, one, one)),
        "poisoned": (plan, replace(state, poisoned=torch.zeros(1, 2, dtype=torch.bool)), CausalState, (one,) * 3),
        "another owner": (plan, replace(state, owner=replace(state.owner, batch=2)), CausalState, (one,) * 3),
        "sums of another shape": (plan, replace(state, kv=state.kv[..., :1]), CausalState, (one,) * 3),
        "sums of another dtype": (plan, replace(state, kv=state.kv.double()), CausalState, (one,) * 3),
        "two positions": (plan, state, CausalState, (q[:, :, :2],) * 3),
        "another dtype": (plan, state, CausalState, (one.double(),) * 3),
    }
    for why, (p, s, kind, xs) in refused.items():
        assert continued_sums(p, s, kind, *xs) is None, why
