"""The verification framework: every checker passes a true claim and fails a false
one (negative controls that stay in the suite)."""

from __future__ import annotations

import json

import pytest

import kernelattn_core as ka
from kernelattn_core import claims as C
from kernelattn_core.cli.main import main
from kernelattn_core.verify import check_claim, claims_of, run_checks
from kernelattn_core.verify.result import z_threshold
from kernelattn_core.verify.symbolic import check_pmf

from . import toy_plugin, verify_plugin


@pytest.fixture
def reg(monkeypatch: pytest.MonkeyPatch) -> ka.Registry:
    import kernelattn_core.registry as registry_module

    registry = ka.Registry(autoload=False)
    registry.register_plugin(toy_plugin, "toys")
    registry.register_plugin(verify_plugin, "verify-tests")
    monkeypatch.setattr(registry_module, "_REGISTRY", registry)
    return registry


def _results(reg: ka.Registry, name: str, rule: str) -> list:  # type: ignore[type-arg]
    entry = reg.get(name)
    out = [check_claim(entry, c, "quick") for c in claims_of(entry) if c.rule == rule]
    assert out, f"{name} has no {rule} claim"
    for r in out:
        assert r.verdict in ("pass", "fail") and r.numbers, r  # numbers, never a bare boolean
    return out


def _verdict(reg: ka.Registry, name: str, rule: str) -> str:
    results = _results(reg, name, rule)
    return "pass" if all(r.passed for r in results) else "fail"


def test_z_threshold_controls_the_family_wise_false_failure_rate() -> None:
    assert z_threshold(1) == pytest.approx(4.8916, abs=1e-3)  # two-sided 1e-6
    assert z_threshold(16) > z_threshold(1)


# --------------------------------------------------------------------------- symbolic
def test_kn001_exact_coefficients(reg) -> None:  # type: ignore[no-untyped-def]
    assert _verdict(reg, "good-exp", "KN001") == "pass"
    bad = _results(reg, "off-by-one-term", "KN001")[0]
    assert bad.verdict == "fail"
    assert bad.numbers["first_bad_n"] == 5 and bad.numbers["mismatches"] == 1
    assert bad.numbers["sympy_a_n"] == "1/120"


def test_kn002_nonnegative_coefficients(reg) -> None:  # type: ignore[no-untyped-def]
    assert _verdict(reg, "good-exp", "KN002") == "pass"
    bad = _results(reg, "negative-coefficient", "KN002")[0]
    assert bad.verdict == "fail" and bad.numbers["first_negative_n"] == 1
    assert _verdict(reg, "negative-coefficient", "KN001") == "pass"  # its coefficients are right, only negative


def test_kn003_torch_function_against_30_digits(reg) -> None:  # type: ignore[no-untyped-def]
    assert _verdict(reg, "good-exp", "KN003") == "pass"
    bad = _results(reg, "wrong-torch-function", "KN003")[0]
    assert bad.verdict == "fail" and bad.numbers["min_digits_agreed"] < 9


def test_sp001_pmf_sums_to_one_and_the_papers_pmf_does_not() -> None:
    good = check_pmf(C.PmfSumsToOne(pmf=verify_plugin.geometric_pmf_s), plugin="t", target="t")
    assert good.verdict == "pass" and good.numbers["sum"] == "1"
    bad = check_pmf(C.PmfSumsToOne(pmf=verify_plugin.papers_pmf_s), plugin="t", target="t")
    assert bad.verdict == "fail"
    assert bad.numbers["sum"] == "1/s"  # = 1/(p - 1) with p = 1 + s


def test_fm005_symbolic_expectation(reg) -> None:  # type: ignore[no-untyped-def]
    assert _verdict(reg, "checked-prf", "FM005") == "pass"
    bad = _results(reg, "wrong-claims", "FM005")[0]
    assert bad.verdict == "fail" and bad.numbers["difference"] != "0"


# --------------------------------------------------------------------------- high precision
def test_hp001_quadrature_identity(reg) -> None:  # type: ignore[no-untyped-def]
    good = _results(reg, "checked-prf", "HP001")[0]
    assert good.verdict == "pass"
    assert good.numbers["digits_agreed"] == "all" or good.numbers["digits_agreed"] >= 25
    bad = _results(reg, "wrong-claims", "HP001")[0]
    assert bad.verdict == "fail" and 10 < bad.numbers["digits_agreed"] < 25


# --------------------------------------------------------------------------- statistical
def test_fm001_unbiasedness_catches_a_three_percent_bias(reg) -> None:  # type: ignore[no-untyped-def]
    good = _results(reg, "checked-prf", "FM001")[0]
    assert good.verdict == "pass" and good.numbers["max_abs_z"] < good.numbers["z_threshold"]
    bad = _results(reg, "biased-prf", "FM001")[0]
    assert bad.verdict == "fail" and bad.numbers["max_abs_z"] > bad.numbers["z_threshold"]
    assert 0.02 < bad.numbers["max_rel_bias"] < 0.05


def test_fm002_positivity(reg) -> None:  # type: ignore[no-untyped-def]
    assert _verdict(reg, "elu", "FM002") == "pass"
    bad = _results(reg, "wrongly-positive", "FM002")[0]
    assert bad.verdict == "fail" and bad.numbers["non_positive_or_nonfinite"] > 0


def test_fm002_on_a_log_space_map_is_deprecated_and_checked_as_finite_log_features(reg) -> None:  # type: ignore[no-untyped-def]
    """Spec 1.1's deprecation policy: FM002 on a log-space map (vacuous as stated) warns and
    is checked in its meaningful form instead of failing with a TypeError (spec 1.0 plugins
    declare it)."""
    from kernelattn_core.claims.spec import ClaimDeprecationWarning

    assert "FM002" not in {c.rule for c in claims_of(reg.get("checked-prf"))}  # not implied by `positive`
    with pytest.warns(ClaimDeprecationWarning, match="FM002 on a log-space map is deprecated since plugin spec 1.1"):
        result = check_claim(reg.get("checked-prf"), C.PositiveFeatures())
    assert result.verdict == "pass" and "error" not in result.numbers
    assert result.numbers["non_finite"] == 0 and result.numbers["log_features_checked"] > 0
    assert "removed" not in result.numbers["deprecated"] and "1.2" in result.numbers["deprecated"]


def test_a_removed_deprecation_is_refused_with_a_reason_not_a_crash(reg, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Once the core's spec reaches the version that removes a deprecated form, the check
    fails with the reason (no TypeError, no warning)."""
    import kernelattn_core.claims.spec as spec

    monkeypatch.setattr(spec, "SPEC_VERSION", "1.2")
    result = check_claim(reg.get("checked-prf"), C.PositiveFeatures())
    assert result.verdict == "fail" and "deprecated since plugin spec 1.1" in result.numbers["refused"]


def test_fm003_variance_against_closed_form(reg) -> None:  # type: ignore[no-untyped-def]
    good = _results(reg, "checked-prf", "FM003")[0]
    assert good.verdict == "pass" and 0.8 < good.numbers["worst_sample_over_declared"] < 1.25
    bad = _results(reg, "wrong-claims", "FM003")[0]
    assert bad.verdict == "fail"


def test_fm004_error_decay_slope(reg) -> None:  # type: ignore[no-untyped-def]
    good = _results(reg, "checked-prf", "FM004")[0]
    assert good.verdict == "pass" and abs(good.numbers["slope"] + 1) < 0.2
    bad = _results(reg, "wrong-claims", "FM004")[0]
    assert bad.verdict == "fail"


def test_at001_unbiased_attention(reg) -> None:  # type: ignore[no-untyped-def]
    good = _results(reg, "toy-ra", "AT001")[0]
    assert good.verdict == "pass"
    bad = _results(reg, "falsely-unbiased", "AT001")[0]
    assert bad.verdict == "fail" and bad.numbers["max_abs_z"] > bad.numbers["z_threshold"]


def test_at002_consistency(reg) -> None:  # type: ignore[no-untyped-def]
    good = _results(reg, "consistent-prf", "AT002")[0]
    assert good.verdict == "pass"
    assert good.numbers["bias_detected_smallest_budget"] is True  # self-normalised: biased at D = 4
    assert good.numbers["budgets"] == [4, 8, 16, 32, 64]  # >= 4 budgets
    assert good.numbers["bias_slope"] < -0.4 and good.numbers["min_detectable_limit_bias"] < 0.025
    assert good.numbers["slope_tested"] is True and "bias slope <= -0.5," in good.claim
    unbiased = _results(reg, "toy-ra", "AT002")[0]
    assert unbiased.verdict == "pass"
    # no bias resolved at two budgets: the result says the slope was not tested (it said
    # "bias slope <= -0.5" and passed with no slope fitted)
    assert unbiased.numbers["slope_tested"] is False and unbiased.numbers["bias_slope"] is None
    assert "bias slope not tested" in unbiased.claim and "bias slope <=" not in unbiased.claim
    bad = _results(reg, "not-consistent", "AT002")[0]
    assert bad.verdict == "fail" and "mse" in bad.numbers["failed"]


def test_at002_fails_an_estimator_that_converges_to_a_wrong_limit(reg) -> None:  # type: ignore[no-untyped-def]
    """Negative control: PRF attention at a temperature off by 30 % has a bias that falls,
    but to the wrong limit: the extrapolated limit is detected."""
    bad = _results(reg, "wrong-limit-prf", "AT002")[0]
    assert bad.verdict == "fail" and "limit" in bad.numbers["failed"], bad.numbers
    assert bad.numbers["limit_bias_max_z"] > bad.numbers["z_threshold"]


def test_at002_budgets_of_spec_1_0_are_filled_in_geometrically() -> None:
    from kernelattn_core.verify.statistical import at002_budgets

    assert at002_budgets((4, 64)) == (4, 8, 16, 32, 64)
    assert at002_budgets((2, 16)) == (2, 3, 6, 10, 16)
    assert at002_budgets((8, 16, 32, 64, 128)) == (8, 16, 32, 64, 128)
    with pytest.raises(ValueError, match="span"):
        at002_budgets((8, 8))


def test_rt001_runtime_identity(reg) -> None:  # type: ignore[no-untyped-def]
    good, wrong = _results(reg, "identified-prf", "RT001")  # the stated formula, a declared wrong one
    assert good.verdict == "pass" and good.numbers["max_rel_diff"] == 0.0
    assert wrong.verdict == "pass" and wrong.numbers["checker_verdict"] == "fail"  # the control is rejected


@pytest.mark.parametrize(
    ("name", "rule"),
    [("drops-own-key", "EN001"), ("normalizer-sees-future", "EN002"), ("padding-in-normalizer", "EN003")],
)
def test_engine_claims_negative_controls(reg, name, rule) -> None:  # type: ignore[no-untyped-def]
    """en001: the causal diagonal dropped; en002: a normaliser over every key; en003: padded
    keys counted in the normaliser (details in test_verify_engine.py)."""
    assert _verdict(reg, name, rule) == "fail"
    assert _verdict(reg, "consistent-prf", rule) == "pass"


def test_implied_claims_from_capability_data(reg) -> None:  # type: ignore[no-untyped-def]
    rules = {c.rule for c in claims_of(reg.get("softmax"))}
    assert {"KN001", "KN002", "KN003", "KN006"} <= rules
    engine = {"EN001", "EN002", "EN003"}  # every feature map: the engine against the quadratic reference
    assert {c.rule for c in claims_of(reg.get("toy-prf"))} == {"FM001"} | engine  # log space: no FM002
    assert {c.rule for c in claims_of(reg.get("toy-trig"))} == {"FM001"} | engine
    assert {c.rule for c in claims_of(reg.get("toy-ra"))} == {"AT001", "AT002", "EN003"}  # non-causal only


def test_a_crashing_check_is_a_failure_with_the_reason(reg) -> None:  # type: ignore[no-untyped-def]
    result = check_claim(reg.get("toy-prf"), C.EstimateVariance(variance=None))
    assert result.verdict == "fail" and "variance is not set" in result.numbers["error"]


# --------------------------------------------------------------------------- CLI
def test_verify_cli_json_records_and_exit_code(reg, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["verify", "softmax", "toy-prf", "--format", "json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert {r["rule"] for r in records} == {"KN001", "KN002", "KN003", "KN006", "FM001", "EN001", "EN002", "EN003"}
    for r in records:
        assert set(r) == {"rule", "plugin", "target", "claim", "numbers", "verdict"}
        assert r["verdict"] == "pass" and isinstance(r["numbers"], dict)
    assert main(["verify", "off-by-one-term", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "KN001" in out and "fail" in out and "3 passed, 1 failed" in out


def test_verify_by_plugin_name_and_unknown_name(reg, capsys) -> None:  # type: ignore[no-untyped-def]
    results = run_checks(["toys"], registry=reg)
    assert {r.target for r in results} == {"toy-prf", "toy-trig"} and all(r.passed for r in results)
    assert main(["verify", "no-such-thing"]) == 2
    assert "neither a plugin" in capsys.readouterr().err


def test_declared_negative_control_passes_only_when_the_checker_rejects(reg) -> None:  # type: ignore[no-untyped-def]
    control = check_claim(reg.get("falsely-unbiased"), C.UnbiasedAttention(num_features=1, expect="fail"))
    assert control.verdict == "pass" and control.numbers["checker_verdict"] == "fail"
    assert control.claim.startswith("negative control")
    wrong = check_claim(reg.get("toy-ra"), C.UnbiasedAttention(num_features=2, expect="fail"))
    assert wrong.verdict == "fail"  # an unbiased estimator is no negative control of AT001
    crash = check_claim(reg.get("toy-prf"), C.EstimateVariance(variance=None, expect="fail"))
    assert crash.verdict == "fail" and "error" in crash.numbers  # a crashing check proves nothing


# --------------------------------------------------------------------------- kernels of any family
def test_kn004_closed_form(reg) -> None:  # type: ignore[no-untyped-def]
    from kernelattn_core.verify.kernels import check_closed_form

    def exp_dot(x, y):  # type: ignore[no-untyped-def]
        import mpmath

        return mpmath.exp(mpmath.fsum(a * b for a, b in zip(x, y)))

    good = check_closed_form(verify_plugin.GoodExp(), C.KernelClosedForm(expression=exp_dot), plugin="t", target="t")
    assert good.verdict == "pass" and good.numbers["min_digits_agreed"] >= 11
    bad = check_closed_form(
        verify_plugin.WrongTorchFunction(), C.KernelClosedForm(expression=exp_dot), plugin="t", target="t"
    )
    assert bad.verdict == "fail" and bad.numbers["min_digits_agreed"] < 11


def test_kn005_spectral_density_integral() -> None:
    from kernelattn_fourier.kernels import GaussianKernel, LaplacianKernel

    from kernelattn_core.verify.kernels import check_spectral_integral

    claim = C.SpectralDensityIntegral(deltas=(0.0, 0.8))
    good = check_spectral_integral(LaplacianKernel(), claim, plugin="t", target="t")
    assert good.verdict == "pass"

    class LaplacianWithGaussianDensity(LaplacianKernel):  # a map sampling the wrong density
        spectral_density_mp = GaussianKernel.spectral_density_mp

    bad = check_spectral_integral(LaplacianWithGaussianDensity(), claim, plugin="t", target="t")
    assert bad.verdict == "fail" and bad.numbers["min_digits_agreed"] < 3


def test_kn006_positive_definite(reg) -> None:  # type: ignore[no-untyped-def]
    assert _verdict(reg, "good-exp", "KN006") == "pass"
    bad = _results(reg, "negative-coefficient", "KN006")[0]  # exp(-x.y) is not positive definite
    assert bad.verdict == "fail" and bad.numbers["min_eig_over_max"] < -1e-10


def test_full_level_dimension_adapts_a_budget_the_map_refuses_only_there() -> None:
    """FastFood needs a multiple of d: at the added d = 128 the declared budget 64 becomes
    128 (reported), at a declared dimension the refusal stays an error."""
    from kernelattn_core.errors import InputError
    from kernelattn_core.registry import resolve_class
    from kernelattn_core.verify.statistical import FULL_LEVEL_DIM, make_map_at

    cls = resolve_class("fastfood-prf", "feature_map")
    fm, budget = make_map_at(cls, FULL_LEVEL_DIM, 64, {}, (16, 64))
    assert budget == 128 and fm.num_features == 128
    fm, budget = make_map_at(cls, 64, 64, {}, (16, 64))
    assert budget == 64
    with pytest.raises(InputError, match="num_features"):
        make_map_at(cls, FULL_LEVEL_DIM, 64, {}, (FULL_LEVEL_DIM,))
