"""Declared negative controls (``expect="fail"`` as data) of KN001-KN003, KN005, KN006, AT002,
EN001 and RT001: each is on a registered class, ``kernelattn verify`` runs it, the checker
rejects it for the stated reason, and the same claim without the declared defect passes."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kernelattn_core import get_registry
from kernelattn_core.verify import check_claim, claims_of


def _control(name: str, rule: str, reference: Any = None) -> tuple[Any, Any]:
    """The one declared control of ``rule`` on ``name`` (of those with ``reference``, when
    a class declares several)."""
    entry = get_registry().get(name)
    (claim,) = [
        c
        for c in claims_of(entry)
        if c.rule == rule and c.expect == "fail" and (reference is None or c.reference is reference)
    ]
    return entry, claim


def _rejected(name: str, rule: str, level: str = "quick", reference: Any = None) -> dict[str, Any]:
    entry, claim = _control(name, rule, reference)
    result = check_claim(entry, claim, level)
    assert result.passed and result.numbers["checker_verdict"] == "fail", result.numbers
    assert result.claim.startswith("negative control, must fail")
    return result.numbers


def _honest_twin_passes(name: str, rule: str, control: Any = None, **undo: Any) -> None:
    """The control's claim (the one with reference ``control`` when several are declared)
    with its declared defect removed passes on the runtime object."""
    entry, claim = _control(name, rule, control)
    twin = dataclasses.replace(claim, expect="pass", **undo)
    result = check_claim(entry, twin, "quick")
    assert result.passed, result.numbers


def test_kn001_printed_sqrt_table_is_rejected_from_n_4() -> None:
    pytest.importorskip("kernelattn_maclaurin")
    numbers = _rejected("sqrt", "KN001")
    assert numbers["first_bad_n"] == 4 and (numbers["sympy_a_n"], numbers["plugin_a_n"]) == ("5/128", "5/384")
    _honest_twin_passes("sqrt", "KN001", coefficients=None, label="")


def test_kn002_negative_offset_polynomial_has_negative_coefficients() -> None:
    pytest.importorskip("kernelattn_maclaurin")
    numbers = _rejected("polynomial", "KN002")
    assert numbers["negative_terms"] == 2 and numbers["first_negative_n"] == 0 and numbers["a_n"] == "-1"
    _honest_twin_passes("polynomial", "KN002", coefficients=None, label="")


def test_kn003_printed_logi_row_sums_to_the_inv_kernel() -> None:
    pytest.importorskip("kernelattn_maclaurin")
    numbers = _rejected("logi", "KN003")
    assert numbers["min_digits_agreed"] < 1  # not a rounding issue: a different function
    _honest_twin_passes("logi", "KN003", expression=None, label="")


def test_kn005_gaussian_density_with_swapped_lengthscale_is_rejected() -> None:
    pytest.importorskip("kernelattn_fourier")
    numbers = _rejected("gaussian", "KN005")
    assert numbers["torch"][0] == pytest.approx(1.0) and numbers["integral"][0] == pytest.approx(1.0)  # both normalised
    assert abs(numbers["integral"][1] - numbers["torch"][1]) > 0.1  # they differ away from delta = 0
    _honest_twin_passes("gaussian", "KN005", density=None, label="")


def test_kn006_negative_offset_polynomial_gram_matrix_is_indefinite() -> None:
    pytest.importorskip("kernelattn_maclaurin")
    numbers = _rejected("polynomial", "KN006")
    assert numbers["min_eig_over_max"] < -0.1
    _honest_twin_passes("polynomial", "KN006", subject=None, label="")


def test_at002_ra_biased_keeps_its_bias_as_the_budget_grows() -> None:
    pytest.importorskip("kernelattn_sampling")
    numbers = _rejected("ra-biased", "AT002")
    # the stated reasons: the bias does not fall (slope about 0, not <= -1/2) and its
    # extrapolated limit is far from zero; the variance falls, only the bias stays
    assert set(numbers["failed"]) == {"limit", "slope"}
    assert numbers["bias_slope"] > -0.1 and numbers["limit_bias_max_z"] > 3 * numbers["z_threshold"]
    assert numbers["mse_D64"] < numbers["mse_D4"]


def test_each_listed_rule_has_a_declared_control_that_verify_runs() -> None:
    pytest.importorskip("kernelattn_maclaurin")
    pytest.importorskip("kernelattn_fourier")
    pytest.importorskip("kernelattn_sampling")
    pytest.importorskip("kernelattn_hybrid")
    from kernelattn_core.verify import plan

    declared = {c.rule for _, c in plan() if c.expect == "fail"}
    assert {"KN001", "KN002", "KN003", "KN005", "KN006", "AT002", "EN001", "RT001"} <= declared


def test_en001_sliding_window_reference_without_global_tokens_is_rejected() -> None:
    """EN001 sees the global tokens: the reference that leaves them out is not what the
    estimator computes, and the honest reference (with them) passes."""
    pytest.importorskip("kernelattn_hybrid")
    from kernelattn_hybrid.claims import sliding_window_reference, sliding_window_reference_no_globals

    numbers = _rejected("sliding-window", "EN001", reference=sliding_window_reference_no_globals)
    assert any(key.endswith(":out") for key in numbers["failing"])  # the outputs differ, not only gradients
    _honest_twin_passes(
        "sliding-window", "EN001", sliding_window_reference_no_globals, reference=sliding_window_reference
    )


def test_en001_sliding_window_reference_without_heavy_keys_is_rejected() -> None:
    """EN001 sees the heavy keys: the reference that sends them through the features is not
    what the estimator computes, and the honest reference (choosing them from the full
    feature matrix) passes."""
    pytest.importorskip("kernelattn_hybrid")
    from kernelattn_hybrid.claims import sliding_window_reference, sliding_window_reference_no_heavy

    numbers = _rejected("sliding-window", "EN001", reference=sliding_window_reference_no_heavy)
    assert any(key.endswith(":out") for key in numbers["failing"])
    control = sliding_window_reference_no_heavy
    _honest_twin_passes("sliding-window", "EN001", control, reference=sliding_window_reference)


def test_rt001_ppsbn_default_form_is_not_the_section_3_2_operator() -> None:
    """At trained-like gamma, beta the two printed post-scaling forms differ, and RT001
    tells them apart (at gamma = beta = 1 they agree)."""
    pytest.importorskip("kernelattn_maclaurin")
    from kernelattn_maclaurin.claims import ppsbn_post

    numbers = _rejected("ppsbn", "RT001")
    assert numbers["max_rel_diff"] > 1e-3
    _honest_twin_passes("ppsbn", "RT001", evaluate=ppsbn_post)
    entry, claim = _control("ppsbn", "RT001")
    untrained = dataclasses.replace(claim, perturb=0.0)
    assert check_claim(entry, untrained, "quick").numbers["checker_verdict"] == "pass"  # gamma = beta = 1
