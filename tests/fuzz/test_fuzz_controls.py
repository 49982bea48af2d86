"""Negative controls of the fuzz suite: toy estimators with one defect each must fail
exactly the property that targets that defect, with a message naming the estimator and
the property; a correct estimator passes them all."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core.testing.fuzz import PROPERTIES, PropertyFailure, fuzz_cases


def _softmax(q, k, v, causal, mask, *, multiply: bool, causal_ok: bool = True, stable: bool = True):  # type: ignore[no-untyped-def]
    logits = q @ k.transpose(-1, -2)  # [B, H, N, M]
    allowed = torch.ones_like(logits, dtype=torch.bool)
    if causal and causal_ok:
        allowed = allowed & torch.ones(logits.shape[-2:], dtype=torch.bool).tril()
    if mask is not None:
        allowed = allowed & ~mask[:, None, None, :]
    if multiply:  # the defect: weights times a 0/1 mask (0 * NaN = NaN)
        w = (logits - logits.amax(-1, keepdim=True)).exp() * allowed
    else:
        lg = logits.masked_fill(~allowed, float("-inf"))
        top = lg.amax(-1, keepdim=True) if stable else torch.zeros_like(lg[..., :1])
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        w = (lg - top).exp()
    den = w.sum(-1, keepdim=True)

    return (w @ v) / torch.where(den == 0, torch.ones_like(den), den)


class Correct(ka.AttentionEstimator):
    name: ClassVar[str] = "ctl-correct"

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        return ka.ExactAttention(backend="naive")._attend(q, k, v, causal, key_padding_mask)


class MultipliesMask(ka.AttentionEstimator):
    name: ClassVar[str] = "ctl-multiplies-mask"

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        return _softmax(q, k, v, causal, key_padding_mask, multiply=True)


class LeaksFuture(ka.AttentionEstimator):
    name: ClassVar[str] = "ctl-leaks-future"

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        return ka.ExactAttention(backend="naive")._attend(q, k, v, False, key_padding_mask)


class LeaksGradient(ka.AttentionEstimator):
    """Masks by replacing logits (so a later NaN key gives finite earlier rows) but keeps
    non-finite rows in the products: the earlier rows' q.grad is 0 * NaN."""

    name: ClassVar[str] = "ctl-leaks-gradient"

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        return _softmax(q, k, v, causal, key_padding_mask, multiply=False)


class Overflows(ka.AttentionEstimator):
    name: ClassVar[str] = "ctl-overflows"

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        w = (q @ k.transpose(-1, -2)).exp() * 1e30  # no max subtraction, in the input dtype
        return (w @ v) / w.sum(-1, keepdim=True)


class _OverflowsInHalfBackward(torch.autograd.Function):
    """Identity whose backward scales by 1e9 and back in the gradient's dtype: float16
    overflows to inf (a defect of the computation), float32 returns the gradient."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        return (g * 1e9) / 1e9


class HalfGradientOverflow(Correct):
    """Correct outputs; its float16 gradient overflows inside the backward although the
    exact gradient is small."""

    name: ClassVar[str] = "ctl-half-grad-overflow"

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        return super()._attend(_OverflowsInHalfBackward.apply(q), k, v, causal, key_padding_mask)


class IgnoresSeed(Correct):
    name: ClassVar[str] = "ctl-ignores-seed"
    random: ClassVar[bool] = True

    def __init__(self, *, seed: object = None, scale: float | None = None) -> None:
        super().__init__(scale=scale)
        self.seed = seed  # the defect: never checked (seed="0" is accepted silently)


class Unseeded(Correct):
    name: ClassVar[str] = "ctl-unseeded"
    random: ClassVar[bool] = True

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        return super()._attend(q, k, v, causal, key_padding_mask) + 0.1 * torch.randn(())


class SequenceMeanNormalizer(ka.Normalizer):
    """Centres keys by their mean over the whole sequence: later keys move earlier rows."""

    name: ClassVar[str] = "ctl-sequence-mean"

    def pre(self, q, k, *, key_padding_mask=None):  # type: ignore[no-untyped-def]
        return q, k - k.mean(-2, keepdim=True)


class CausalOnly(Correct):
    """Correct, and causal only (``supports_noncausal = False``): refuses causal=False."""

    name: ClassVar[str] = "ctl-causal-only"
    supports_noncausal: ClassVar[bool] = False

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        if not causal:
            raise ka.InputError("causal: ctl-causal-only is causal only; got causal=False")
        return super()._attend(q, k, v, causal, key_padding_mask)


class Plugin:
    @ka.hookimpl
    def kernelattn_estimators(self):  # type: ignore[no-untyped-def]
        return [
            Correct,
            MultipliesMask,
            LeaksFuture,
            LeaksGradient,
            Overflows,
            HalfGradientOverflow,
            IgnoresSeed,
            Unseeded,
            CausalOnly,
        ]

    @ka.hookimpl
    def kernelattn_normalizers(self):  # type: ignore[no-untyped-def]
        return [SequenceMeanNormalizer]


@pytest.fixture
def controls(monkeypatch: pytest.MonkeyPatch) -> ka.Registry:
    import kernelattn_core.registry as registry_module

    reg = ka.Registry(autoload=False)
    reg.register_plugin(Plugin(), "controls")
    monkeypatch.setattr(registry_module, "_REGISTRY", reg)
    return reg


def _outcome(reg: ka.Registry, name: str, prop: str) -> str | None:
    (case,) = fuzz_cases(name, registry=reg, properties=(prop,))
    try:
        case.run()
    except PropertyFailure as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    ("name", "prop"),
    [
        ("ctl-multiplies-mask", "padding_non_finite"),
        ("ctl-multiplies-mask", "causal_prefix_non_finite"),
        ("ctl-leaks-future", "causal_prefix_finite"),
        ("ctl-leaks-gradient", "gradient_isolation"),
        ("ctl-overflows", "finite_at_norm"),
        ("ctl-half-grad-overflow", "finite_at_norm"),
        ("ctl-ignores-seed", "bad_inputs"),
        ("ctl-unseeded", "replica_agreement"),
    ],
)
def test_each_defect_fails_its_property_naming_estimator_and_property(controls, name: str, prop: str) -> None:  # type: ignore[no-untyped-def]
    message = _outcome(controls, name, prop)
    assert message is not None, f"{name} passed {prop} despite its defect"
    assert message.startswith(f"{name}: {prop}:"), message
    if name == "ctl-half-grad-overflow":  # failed on the float16 gradient, not on anything else
        assert "float16" in message and "although the float32 gradient is" in message, message


def test_a_leaking_normalizer_fails_normalizer_causal_naming_it(controls) -> None:  # type: ignore[no-untyped-def]
    message = _outcome(controls, "elu", "normalizer_causal")
    assert message is not None and message.startswith("elu: normalizer_causal:"), message
    assert "ctl-sequence-mean()" in message and "row()" not in message


@pytest.mark.parametrize(
    "prop",
    [
        "padding_non_finite",
        "gradient_isolation",
        "causal_prefix_finite",
        "causal_prefix_non_finite",
        "finite_at_norm",
        "empty_shapes",
        "bad_inputs",
    ],
)
def test_a_correct_estimator_passes(controls, prop: str) -> None:  # type: ignore[no-untyped-def]
    assert _outcome(controls, "ctl-correct", prop) is None


@pytest.mark.parametrize("prop", sorted(PROPERTIES))
def test_a_causal_only_estimator_is_fuzzed_causally(controls, prop: str) -> None:  # type: ignore[no-untyped-def]
    """Every property calls a ``supports_noncausal = False`` class with causal=True (a
    non-causal call would raise its InputError and fail the property)."""
    assert _outcome(controls, "ctl-causal-only", prop) is None


def test_the_catalogue_has_at_least_40_kinds_each_naming_an_argument() -> None:
    from kernelattn_core.testing.fuzz import BAD_INPUTS

    assert len(BAD_INPUTS) >= 40
    assert len({b.kind for b in BAD_INPUTS}) == len(BAD_INPUTS)
    assert all(b.argument for b in BAD_INPUTS)


def test_fuzz_tests_is_the_conformance_kit_hook(controls) -> None:  # type: ignore[no-untyped-def]
    """A plugin's ``fuzz_tests("plugin")`` covers exactly that plugin's classes, with every property."""
    from kernelattn_core.testing import fuzz_tests
    from kernelattn_core.testing.fuzz import PROPERTIES

    cases = fuzz_cases("controls", registry=controls)
    assert {c.target for c in cases} == {e.name for e in controls.entries("estimator") if e.plugin == "controls"}
    assert {c.prop for c in cases} == set(PROPERTIES)
    test = fuzz_tests("controls", properties=("empty_shapes",))
    (mark,) = [m for m in test.pytestmark if m.name == "parametrize"]
    assert sorted(c.id for c in mark.args[1]) == sorted(
        f"{c.target}-empty_shapes" for c in cases if c.prop == "empty_shapes"
    )


@pytest.mark.parametrize("name", ["rff", "trig-softmax-features"])
def test_a_half_gradient_near_a_zero_denominator_is_accepted(name: str) -> None:
    """Found at 300 examples: float16, scaled norm 3, d = 3, causal. The half call's
    output is 98 / 204 against 61-81 in float32 (the rounded inputs move a near-zero
    denominator), its gradient overflows; the float32 gradient, 2.5e4-5.8e4, is within
    a factor of 8 of float16's maximum: accepted as not representable. The same check
    rejects the control (gradient about 1) above."""
    from kernelattn_core.testing.fuzz import _beyond_range, _tensors, make

    est = make(ka.get_registry().get(name)).eval()
    q, k, v = (t.requires_grad_() for t in _tensors(24, 1, 2, 24, 24, 3, 3, 3.0, torch.float16))
    est(q, k, v, causal=True).float().square().mean().backward()
    bad = [a for a, t in zip("qkv", (q, k, v)) if not bool(torch.isfinite(t.grad).all())]
    assert bad  # the case still overflows in half: otherwise this test checks nothing
    _beyond_range(est, name, "finite_at_norm", "case", (q, k, v), True, bad)  # does not raise
