"""S2 (spec 002 §3.3): the KL-Transformer's Eq. 34 is off by 2^m; the corrected form
matches quadrature to 25 digits."""

from __future__ import annotations

import mpmath
import pytest
from kernelattn_spectral.theory import eq34_corrected, eq34_printed, eq34_quadrature


@pytest.mark.parametrize(("x", "a"), [(["0.7"], ["1.3"]), (["0.4", "-1.1"], ["0.8", "2.5"]), (["0"], ["0.5"])])
def test_s2_eq34_corrected_matches_quadrature_and_printed_is_off_by_two_to_the_m(x: list[str], a: list[str]) -> None:
    with mpmath.workdps(30):
        value = eq34_quadrature(x, a)
        correct, printed = eq34_corrected(x, a), eq34_printed(x, a)
        assert abs(value / correct - 1) < mpmath.mpf(10) ** -25
        assert abs(value / printed - 2 ** len(x)) < mpmath.mpf(10) ** -24  # the erratum, documented


def test_s2_one_dimensional_closed_form() -> None:
    with mpmath.workdps(30):
        a, x = mpmath.mpf("1.3"), mpmath.mpf("0.7")
        assert abs(eq34_corrected([x], [a]) - mpmath.sqrt(mpmath.pi / a) * mpmath.exp(-x * x / a)) < 1e-28
