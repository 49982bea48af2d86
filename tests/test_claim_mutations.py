"""Mutation meta-test: every claim kind can fail.

For each claim kind (each checker in :func:`kernelattn_core.verify._checkers`), a
subject that satisfies the claim passes, and the same subject with a planted defect
(a scaled weight, a shifted coefficient, a flipped sign, a dropped normalisation)
fails. A claim kind without a mutation here fails :func:`test_every_claim_kind_has_a_mutation`:
a claim no mutation can fail must be removed or rewritten.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core import claims as C
from kernelattn_core.registry import Entry
from kernelattn_core.verify import _checkers, check_claim

from . import toy_plugin, verify_plugin


@pytest.fixture
def reg(monkeypatch: pytest.MonkeyPatch) -> ka.Registry:
    import kernelattn_core.registry as registry_module

    registry = ka.Registry(autoload=True)
    registry.register_plugin(toy_plugin, "toys")
    registry.register_plugin(verify_plugin, "verify-tests")
    monkeypatch.setattr(registry_module, "_REGISTRY", registry)
    return registry


def _mutant(entry: Entry, name: str, **body: Any) -> Entry:
    """The entry's class with methods overridden (a planted defect), as an unregistered entry."""
    cls = type(f"Mutant{entry.cls.__name__}", (entry.cls,), body)
    return Entry(entry.name + f"[{name}]", entry.kind, cls, entry.plugin)


def _claim(entry: Entry, rule: str, **match: Any) -> C.Claim:
    for claim in getattr(entry.cls, "claims", ()):
        if claim.rule == rule and all(getattr(claim, k, None) == v for k, v in match.items()):
            return claim
    raise LookupError(f"{entry.name} declares no {rule} claim matching {match}")


# ----------------------------------------------------------------------------- mutations
def _scaled_log_features(entry: Entry) -> Entry:
    def _features(self, x, is_query):  # type: ignore[no-untyped-def]
        return entry.cls._features(self, x, is_query) + (math.log(1.03) if is_query else 0.0)

    return _mutant(entry, "query weights x1.03", _features=_features)


def _scaled_log_features_big(entry: Entry) -> Entry:
    def _features(self, x, is_query):  # type: ignore[no-untyped-def]
        return entry.cls._features(self, x, is_query) + (math.log(1.2) if is_query else 0.0)

    return _mutant(entry, "query weights x1.2", _features=_features)


def _flipped_feature(entry: Entry) -> Entry:
    def _features(self, x, is_query):  # type: ignore[no-untyped-def]
        f = entry.cls._features(self, x, is_query).clone()
        f[..., 0] = -f[..., 0]
        return f

    return _mutant(entry, "feature 0 sign flipped", _features=_features)


def _scaled_rmf_weight(entry: Entry) -> Entry:
    def _weights(self, degrees):  # type: ignore[no-untyped-def]
        w = entry.cls._weights(self, degrees).clone()
        return torch.where(degrees == 3, w * 1.001, w)

    return _mutant(entry, "weight of degree 3 x1.001", _weights=_weights)


def _shifted_coefficient(entry: Entry) -> Entry:
    def coefficient(self, n):  # type: ignore[no-untyped-def]
        a = entry.cls.coefficient(self, n)
        return a + Fraction(1, 10**6) if n == 4 else a

    return _mutant(entry, "a_4 + 1e-6", coefficient=coefficient)


def _flipped_coefficient(entry: Entry) -> Entry:
    def coefficient(self, n):  # type: ignore[no-untyped-def]
        a = entry.cls.coefficient(self, n)
        return -a if n == 3 else a

    return _mutant(entry, "a_3 sign flipped", coefficient=coefficient)


def _shifted_log_table(entry: Entry) -> Entry:
    def log_coefficients(self, n_max):  # type: ignore[no-untyped-def]
        out = entry.cls.log_coefficients(self, n_max).clone()
        out[4] += 1e-6
        return out

    return _mutant(entry, "runtime log a_4 + 1e-6", log_coefficients=log_coefficients)


def _scaled_f(entry: Entry) -> Entry:
    def f(self, t):  # type: ignore[no-untyped-def]
        return entry.cls.f(self, t) * (1 + 1e-7)

    return _mutant(entry, "f x(1 + 1e-7)", f=f)


def _scaled_kernel(factor: float) -> Callable[[Entry], Entry]:
    def mutate(entry: Entry) -> Entry:
        def _evaluate(self, q, k):  # type: ignore[no-untyped-def]
            return entry.cls._evaluate(self, q, k) * factor

        return _mutant(entry, f"K x{factor}", _evaluate=_evaluate)

    return mutate


def _scaled_density(entry: Entry) -> Entry:
    def spectral_density_mp(self, omega):  # type: ignore[no-untyped-def]
        return entry.cls.spectral_density_mp(self, omega) * (1 + 1e-6)

    return _mutant(entry, "p(w) x(1 + 1e-6)", spectral_density_mp=spectral_density_mp)


def _scaled_output(factor: float, offset: float = 0.0) -> Callable[[Entry], Entry]:
    def mutate(entry: Entry) -> Entry:
        def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
            return entry.cls._attend(self, q, k, v, causal, key_padding_mask) * factor + offset

        return _mutant(entry, f"output x{factor} + {offset}", _attend=_attend)

    return mutate


# Each case: (rule, subject name, claim selector, mutation of the class or None, mutation of the claim or None)
CASES: list[tuple[str, str, Callable[[Entry], C.Claim], Any, Any]] = [
    ("FM001", "checked-prf", lambda e: C.UnbiasedKernelEstimate(dims=(8,)), _scaled_log_features, None),
    ("FM002", "elu", lambda e: C.PositiveFeatures(), _flipped_feature, None),
    ("FM003", "checked-prf", lambda e: _claim(e, "FM003"), _scaled_log_features_big, None),
    ("FM004", "checked-prf", lambda e: _claim(e, "FM004"), _scaled_log_features_big, None),
    ("FM005", "rmf", lambda e: _claim(e, "FM005", options={"kernel": "inv"}), _scaled_rmf_weight, None),
    (
        "SP001",
        "rmf",
        lambda e: _claim(e, "SP001", start=1),
        None,
        lambda c: dataclasses.replace(c, pmf=lambda n: c.pmf(n) * 2),  # drop a normalisation
    ),
    (
        "SP001",
        "rmf",
        lambda e: _claim(e, "SP001", start=1),
        None,
        lambda c: dataclasses.replace(c, runtime=_wrong_sampler(c.runtime)),  # the sampler draws another law
    ),
    ("KN001", "exp", lambda e: C.MaclaurinCoefficients(order=8), _shifted_coefficient, None),
    ("KN002", "exp", lambda e: C.NonNegativeCoefficients(order=8), _flipped_coefficient, None),
    ("KN002", "exp", lambda e: C.NonNegativeCoefficients(order=8), _shifted_log_table, None),
    ("KN003", "exp", lambda e: C.KernelMatchesExpression(), _scaled_f, None),
    ("KN004", "gaussian", lambda e: _claim(e, "KN004"), _scaled_kernel(1 + 1e-7), None),
    ("KN005", "laplacian", lambda e: C.SpectralDensityIntegral(), _scaled_density, None),
    ("KN006", "gaussian", lambda e: C.PositiveDefinite(), _scaled_kernel(-1.0), None),
    (
        "HP001",
        "checked-prf",
        lambda e: _claim(e, "HP001"),
        None,
        lambda c: dataclasses.replace(c, evaluate=_perturbed_identity(c.evaluate)),
    ),
    ("AT001", "toy-ra", lambda e: _claim(e, "AT001"), _scaled_output(1.25), None),
    ("AT002", "toy-ra", lambda e: _claim(e, "AT002"), _scaled_output(1.0, 0.2), None),
    (
        "AT002",
        "consistent-prf",
        lambda e: _claim(e, "AT002"),
        None,
        lambda c: dataclasses.replace(c, biased_at_finite_budget=False),  # a biased estimator claiming no bias
    ),
]


def _wrong_sampler(runtime: Any) -> Any:
    def wrapped() -> Any:
        law, values = runtime()

        class Shifted:
            def pmf(self, n: int) -> float:
                return law.pmf(n)

            def sample(self, u: torch.Tensor) -> torch.Tensor:
                return law.sample(u**1.05)  # a slightly different law than pmf() says

        return Shifted(), values

    return wrapped


def _perturbed_identity(evaluate: Any) -> Any:
    def wrapped(dps: int) -> Any:
        value, target, note = evaluate(dps)
        import mpmath

        return value * (1 + mpmath.mpf(10) ** -(dps // 2)), target, note

    return wrapped


RULE_OF = {cls: cls.rule for cls in _checkers()}


def test_every_claim_kind_has_a_mutation() -> None:
    covered = {rule for rule, *_ in CASES}
    missing = sorted(set(RULE_OF.values()) - covered)
    assert not missing, f"claim kinds with no mutation that makes them fail: {missing}"


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_claim_passes_and_its_mutant_fails(reg: ka.Registry, case: Any) -> None:
    rule, name, select, mutate_class, mutate_claim = case
    entry = reg.get(name)
    claim = select(entry)
    assert claim.rule == rule
    good = check_claim(entry, claim, "quick")
    assert good.verdict == "pass", good
    bad_entry = mutate_class(entry) if mutate_class is not None else entry
    bad_claim = mutate_claim(claim) if mutate_claim is not None else claim
    bad = check_claim(bad_entry, bad_claim, "quick")
    assert bad.verdict == "fail", bad
    assert "error" not in bad.numbers, f"the mutant crashed the checker instead of failing it: {bad.numbers}"
