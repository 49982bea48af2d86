"""The conformance kit on the built-ins and the toy plugin, and its negative controls."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core import hookimpl
from kernelattn_core.testing import conformance_cases, conformance_tests

from . import toy_plugin

test_builtins_conform = conformance_tests("builtins")


def _registry(*classes: type) -> ka.Registry:
    import types

    reg = ka.Registry(autoload=False)
    reg.register_plugin(toy_plugin, "toys")
    mod = types.ModuleType("extra")
    mod.kernelattn_feature_maps = hookimpl(lambda: [c for c in classes if issubclass(c, ka.FeatureMap)])
    mod.kernelattn_estimators = hookimpl(lambda: [c for c in classes if issubclass(c, ka.AttentionEstimator)])
    reg.register_plugin(mod, "extra")
    return reg


@pytest.fixture
def toys(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    import kernelattn_core.registry as registry_module

    def install(*classes: type) -> ka.Registry:
        reg = _registry(*classes)
        monkeypatch.setattr(registry_module, "_REGISTRY", reg)
        return reg

    return install


def _run(reg: ka.Registry, name: str, check: str) -> None:
    (case,) = [c for c in conformance_cases(name, registry=reg, claims=False) if c.check == check]
    case.run("quick")


def test_toy_plugin_conforms(toys) -> None:  # type: ignore[no-untyped-def]
    reg = toys()
    cases = conformance_cases("toys", registry=reg)
    assert len(cases) > 20
    for case in cases:
        case.run("quick")


class ForgetsToSaveDraws(toy_plugin.ToyPRF):
    """Negative control: the draws are a plain attribute, not a buffer."""

    name: ClassVar[str] = "forgets-draws"

    def _build(self, head_dim: int) -> None:
        self.omega = torch.zeros(self.num_features, head_dim)

    def _redraw(self, generator):  # type: ignore[no-untyped-def]
        self.omega = self._draw("normal", tuple(self.omega.shape), self.omega, generator)


class FlaggedPositive(toy_plugin.ToyTrig):
    name: ClassVar[str] = "flagged-positive"
    positive: ClassVar[bool] = True


class MixesRows(toy_plugin.ToyPRF):
    """Negative control: features of one row depend on the other rows."""

    name: ClassVar[str] = "mixes-rows"

    def _features(self, x, is_query):  # type: ignore[no-untyped-def]
        return super()._features(x - x.mean(0, keepdim=True), is_query)


class SecretlyRandom(ka.EluFeatureMap):
    """Negative control: claims random=False but draws from the global generator."""

    name: ClassVar[str] = "secretly-random"

    def _features(self, x, is_query):  # type: ignore[no-untyped-def]
        return super()._features(x, is_query) * (1 + torch.rand(()))


class NoisyEval(ka.FeatureMapAttention):
    """Negative control: redraws in eval mode."""

    name: ClassVar[str] = "noisy-eval"

    def __init__(self, num_features: int = 8, **options):  # type: ignore[no-untyped-def]
        super().__init__("toy-prf", num_features=num_features, **options)

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        if self.feature_map.built:
            self.feature_map.redraw()
        return super()._attend(q, k, v, causal, key_padding_mask)


@pytest.mark.parametrize(
    ("cls", "check"),
    [
        (ForgetsToSaveDraws, "state_dict_round_trip"),
        (FlaggedPositive, "positive_flag"),
        (MixesRows, "batch_consistency"),
        (SecretlyRandom, "determinism"),
        (NoisyEval, "eval_determinism_and_state_dict"),
    ],
)
def test_conformance_negative_controls(toys, cls: type, check: str) -> None:  # type: ignore[no-untyped-def]
    reg = toys(cls)
    with pytest.raises(AssertionError):
        _run(reg, cls.name, check)


class OverflowsInHalf(ka.FeatureMapAttention):
    """Negative control: accumulates the key sums in the input dtype (float16 overflows)."""

    name: ClassVar[str] = "overflows-in-half"

    def __init__(self, **options):  # type: ignore[no-untyped-def]
        super().__init__("elu", **options)

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        fq, fk = self.feature_map.query(q), self.feature_map.key(k)  # in the input dtype
        kv = fk.transpose(-1, -2) @ v
        return (fq @ kv) / (fq @ fk.sum(-2, keepdim=True).transpose(-1, -2))


def test_half_precision_negative_control(toys) -> None:  # type: ignore[no-untyped-def]
    reg = toys(OverflowsInHalf)
    with pytest.raises(AssertionError, match="non-finite|relative error"):
        _run(reg, "overflows-in-half", "half_precision")


class CausalOnlyElu(ka.FeatureMapAttention):
    """A causal-only estimator (``supports_noncausal = False``) that refuses causal=False."""

    name: ClassVar[str] = "causal-only-elu"
    supports_noncausal: ClassVar[bool] = False

    def __init__(self, **options):  # type: ignore[no-untyped-def]
        super().__init__("elu", **options)

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        if not causal:
            raise ka.InputError("causal: causal-only-elu is causal only; got causal=False")
        return super()._attend(q, k, v, causal, key_padding_mask)


class ClaimsCausalOnlyButIsNot(ka.FeatureMapAttention):
    """Negative control: flagged causal only, yet causal=False runs (bidirectionally): its
    ``forward`` bypasses the base class's refusal."""

    name: ClassVar[str] = "claims-causal-only"
    supports_noncausal: ClassVar[bool] = False

    def __init__(self, **options):  # type: ignore[no-untyped-def]
        super().__init__("elu", **options)

    def forward(self, q, k, v, *, causal=False, key_padding_mask=None):  # type: ignore[no-untyped-def, override]
        type(self).supports_noncausal = True
        try:
            return super().forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
        finally:
            type(self).supports_noncausal = False


def test_a_causal_only_estimator_is_checked_causally(toys) -> None:  # type: ignore[no-untyped-def]
    reg = toys(CausalOnlyElu)
    cases = conformance_cases("causal-only-elu", registry=reg, claims=False)
    assert {c.check for c in cases} >= {"attention_shapes_and_dtypes", "padding_excluded", "causal_prefix_invariance"}
    for case in cases:
        case.run("quick")  # each would raise InputError if the kit called it with causal=False


def test_causal_only_flag_negative_control(toys) -> None:  # type: ignore[no-untyped-def]
    reg = toys(ClaimsCausalOnlyButIsNot)
    with pytest.raises(AssertionError, match="supports_noncausal=False but causal=False did not raise"):
        _run(reg, "claims-causal-only", "causal_prefix_invariance")


# --------------------------------------------------------------------------- kit = verify + structure
class DropsTheDiagonal(ka.FeatureMapAttention):
    """A third-party estimator that overrides ``_attend`` with its own causal form, whose
    mask is off by one: row ``t`` sees keys ``j < t`` (its own key dropped). Shapes, dtypes,
    padding, determinism, prefix invariance and half precision all hold, so every structural
    case passes; only the engine claim EN001 (the quadratic reference) sees it."""

    name: ClassVar[str] = "drops-the-diagonal"

    def __init__(self, num_features: int = 8, **options):  # type: ignore[no-untyped-def]
        super().__init__("toy-prf", num_features=num_features, **options)

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        if not causal:
            return super()._attend(q, k, v, causal, key_padding_mask)
        fm = self.feature_map
        if not fm.built:
            self.redraw_policy.initial(fm, q.shape[-1])
        out_dtype = v.dtype
        work = torch.promote_types(q.dtype, torch.float32)  # half inputs summed in float32
        q, k, v = (torch.where(torch.isfinite(t), t, torch.zeros_like(t)).to(work) for t in (q, k, v))
        a = fm.query(q) @ fm.key(k).transpose(-1, -2)
        keep = torch.ones(a.shape[-2:], dtype=torch.bool).tril(-1)
        if key_padding_mask is not None:
            keep = keep & ~key_padding_mask[:, None, None, :]
        a = a.masked_fill(~keep, 0.0)
        den = a.sum(-1, keepdim=True)
        return ((a @ v) / torch.where(den == 0, torch.ones_like(den), den)).to(out_dtype)


def test_kit_runs_the_engine_claims_on_a_third_party_estimator(toys) -> None:  # type: ignore[no-untyped-def]
    """Kit = verify + structure: the kit's cases for a class are its structural cases and one
    case per claim verify runs on it, engine claims included; a defect in an overridden
    ``_attend`` that every structural case misses fails EN001."""
    from kernelattn_core.verify import claims_of

    reg = toys(DropsTheDiagonal)
    cases = conformance_cases("drops-the-diagonal", registry=reg)
    claim_checks = [c.check for c in cases if c.check.startswith("claim-")]
    assert [c.split("-")[1] for c in claim_checks] == [c.rule for c in claims_of(reg.get("drops-the-diagonal"))]
    assert {"claim-EN001-0", "claim-EN002-1", "claim-EN003-2"} <= set(claim_checks)
    failed = set()
    for case in cases:
        try:
            case.run("quick")
        except AssertionError:
            failed.add(case.check)
    assert failed == {"claim-EN001-0"}, failed  # the structural cases all pass
