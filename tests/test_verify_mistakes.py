"""``kernelattn verify`` on what the plugin audit found: a map that names its target as a
class (``target_kernel_class``) is checked like one that names it (FM001 implied, its
target listed); a deterministic exact map passes FM001 and a deterministic wrong one
fails it; a malformed claims entry gives a failing row, never a traceback."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import pytest
import torch

import kernelattn_core as ka
from kernelattn_core.claims import Claim, UnbiasedKernelEstimate
from kernelattn_core.interfaces import Kernel
from kernelattn_core.registry import Entry, target_kernel_name, target_kernel_type
from kernelattn_core.verify import check_claim, claims_of, implied_kernel_estimate
from kernelattn_core.verify.statistical import EXACT_RTOL, unbiased_pairs

from . import toy_plugin


class HalfPRF(toy_plugin.ToyPRF):
    """The audit's ``auditbug-half``: every estimate is K/2 (a normalisation copied from a
    two-sided map), flagged unbiased."""

    name: ClassVar[str] = "half-prf"

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        return super()._features(x, is_query) - 0.5 * math.log(2.0)


class HalfPRFByClass(HalfPRF):
    """The same bug, the target declared as a class (spec 1.1+) instead of a name."""

    name: ClassVar[str] = "half-prf-tk"
    kernel: ClassVar[str | None] = None
    target_kernel_class: ClassVar[type[Kernel] | None] = ka.SoftmaxKernel


class LinearKernel(Kernel):
    """:math:`K(x, y) = x^\\top y`."""

    name: ClassVar[str] = "verify-linear"

    def _evaluate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-1, -2)


class ExactLinearMap(ka.FeatureMap):
    """Deterministic and exact for :class:`LinearKernel`: three copies of
    :math:`x / \\sqrt 3` (the estimate equals the kernel up to rounding, not bit for bit)."""

    name: ClassVar[str] = "exact-linear"
    target_kernel_class: ClassVar[type[Kernel] | None] = LinearKernel
    unbiased: ClassVar[bool] = True
    random: ClassVar[bool] = False
    has_budget: ClassVar[bool] = False
    default_normalizer: ClassVar[str] = "signed-row"
    factor: ClassVar[float] = 1.0

    def _feature_dim(self) -> int:
        assert self.head_dim is not None
        return 3 * self.head_dim

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        return torch.cat([x * (self.factor / math.sqrt(3.0))] * 3, dim=-1)


class WrongLinearMap(ExactLinearMap):
    """Deterministic, flagged unbiased, and 69 % off: the estimate is 1.69 K."""

    name: ClassVar[str] = "wrong-linear"
    factor: ClassVar[float] = 1.3


def _entry(cls: type, plugin: str = "audit") -> Entry:
    return Entry(cls.name, "feature_map", cls, plugin)


def _fm001(entry: Entry) -> UnbiasedKernelEstimate:
    (claim,) = [c for c in claims_of(entry) if isinstance(c, UnbiasedKernelEstimate)]
    return claim


# --------------------------------------------------------------------------- 1: the target in either form
def test_target_kernel_is_read_from_either_form() -> None:
    assert target_kernel_name(HalfPRF) == "softmax" and target_kernel_name(HalfPRFByClass) == "softmax"
    assert target_kernel_name(ka.EluFeatureMap) is None
    assert target_kernel_type(HalfPRFByClass) is ka.SoftmaxKernel
    assert target_kernel_type(HalfPRF, ka.Registry(autoload=False)) is ka.SoftmaxKernel
    assert target_kernel_type(ka.EluFeatureMap) is None
    assert target_kernel_name(HalfPRFByClass(head_dim=4)) == "softmax"  # an instance too
    assert _entry(HalfPRFByClass).flags()["kernel"] == "softmax"


def test_a_biased_map_declaring_its_target_as_a_class_fails_fm001() -> None:
    """It used to get no FM001 (``claims_of`` read ``kernel``), so verify and the
    conformance kit passed a map whose estimates are half the kernel."""
    entry = _entry(HalfPRFByClass)
    claim = dataclasses.replace(_fm001(entry), dims=(4,), redraws=200)
    result = check_claim(entry, claim)
    assert not result.passed and result.numbers["max_rel_bias"] == pytest.approx(0.5, abs=0.05)
    control = check_claim(_entry(toy_plugin.ToyPRF, "toys"), claim)
    assert control.passed, control.numbers


def test_the_conformance_kit_runs_fm001_on_a_map_declaring_its_target_as_a_class() -> None:
    from kernelattn_core.testing import conformance_cases

    reg = ka.Registry(autoload=False)
    plugin = type(
        "P", (), {"KERNELATTN_SPEC": "1.1", "kernelattn_feature_maps": ka.hookimpl(lambda self: [HalfPRFByClass])}
    )
    reg.register_plugin(plugin(), "halfbug")
    checks = [c.check for c in conformance_cases("halfbug", registry=reg)]
    assert any(c.startswith("claim-FM001") for c in checks), checks


# --------------------------------------------------------------------------- 4: deterministic maps
def test_fm001_is_implied_for_a_deterministic_unbiased_map_with_a_target() -> None:
    implied = implied_kernel_estimate(ExactLinearMap)
    assert implied is not None and implied.redraws < 10
    assert implied_kernel_estimate(ka.EluFeatureMap) is None  # no target, not unbiased
    assert implied_kernel_estimate(HalfPRF) == UnbiasedKernelEstimate()


def test_a_deterministic_exact_map_passes_fm001_implied_and_declared() -> None:
    entry = _entry(ExactLinearMap)
    for claim in (_fm001(entry), UnbiasedKernelEstimate(dims=(4,), redraws=4)):
        result = check_claim(entry, claim)
        assert result.passed, result.numbers
        assert result.numbers["pairs_without_variance"] == claim.pairs
        assert result.numbers["max_abs_z"] == 0 and result.numbers["max_rel_bias"] < EXACT_RTOL


def test_a_deterministic_wrong_map_fails_the_implied_fm001() -> None:
    result = check_claim(_entry(WrongLinearMap), _fm001(_entry(WrongLinearMap)))
    assert not result.passed and result.numbers["max_rel_bias"] == pytest.approx(0.69, rel=1e-6)


def test_a_pair_without_variance_is_tested_for_exactness() -> None:
    """The audit's numbers: a rounding bias of 2.7e-16 on a zero standard error gave
    z = 2e284; now it passes, and a bias above the tolerance fails."""
    target = torch.tensor([1.5, 0.25, 3.0], dtype=torch.float64)
    for rel, passes in ((2.7e-16, True), (1e-6, False)):
        est = (target * (1 + rel)).expand(4, 3)
        z, got_rel, exact, ok = unbiased_pairs(est, target, threshold=5.0)
        assert bool(exact.all()) and bool((z == 0).all()) and bool(ok.all()) is passes
        assert float(got_rel.max()) == pytest.approx(rel, rel=0.5)
    noisy = target + 0.01 * torch.randn(400, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    _, _, exact, ok = unbiased_pairs(noisy, target, threshold=5.0)
    assert not bool(exact.any()) and bool(ok.all())  # a random map keeps the z-test


# --------------------------------------------------------------------------- 3: malformed claims
@pytest.mark.parametrize("claim", ["FM001", UnbiasedKernelEstimate])
def test_a_claims_entry_that_is_no_claim_gives_a_failing_row(claim: Any) -> None:
    """The registry refuses such a class; one checked without it (an entry built by
    hand) gets a failing row naming the entry instead of a traceback."""
    cls = type("Mistaken", (toy_plugin.ToyPRF,), {"name": "mistaken", "claims": (claim,)})
    entry = _entry(cls)
    rows = [check_claim(entry, c) for c in claims_of(entry) if not isinstance(c, Claim)]
    assert len(rows) == 1 and not rows[0].passed
    assert "not a claim instance" in rows[0].numbers["error"]


def test_verify_cli_lists_a_malformed_claims_entry_as_a_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kernelattn_core.verify as verify

    cls = type("Mistaken", (ka.EluFeatureMap,), {"name": "mistaken", "claims": ("FM001",)})
    entry = _entry(cls)
    monkeypatch.setattr(verify, "plan", lambda names, level=None: [(entry, c) for c in claims_of(entry)][:1])
    from kernelattn_core.toolkit import cli_main

    assert cli_main(["verify", "mistaken", "--no-progress"]) == 1
    assert "not a claim instance" in capsys.readouterr().out
