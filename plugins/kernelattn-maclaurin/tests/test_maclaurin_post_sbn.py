"""PostSBN forms of ppSBN: Algorithm 1's gamma * a^beta (default) and the §3.2 operator
(gamma X)^beta (``post_form="pow_gamma"``), both as signed powers."""

from __future__ import annotations

import pytest
import torch
from kernelattn_maclaurin import PPSBN

import kernelattn_core as ka
from kernelattn_core.toolkit import InputError

A = torch.tensor([-8.0, -1.0, 0.0, 0.5, 27.0], dtype=torch.float64)


def _norm(post_form: str | None, gamma: float, beta: float, channels: int | None = None) -> PPSBN:
    norm = PPSBN(post_form=post_form, channels=channels).double()
    with torch.no_grad():
        norm.gamma.fill_(gamma)
        norm.beta.fill_(beta)
    return norm


def test_pow_gamma_is_the_power_of_gamma_times_x() -> None:
    """(2a)^(1/3), signed: -16^(1/3) at a = -8, 1 at a = 1/2, 54^(1/3) at a = 27. Algorithm 1's
    2 * a^(1/3) gives -4, 2 * 0.5^(1/3) = 1.587 and 6 there, so this fails for the previous form."""
    out = _norm("pow_gamma", 2.0, 1.0 / 3.0).post(A)
    c = 1.0 / 3.0
    expected = torch.tensor([-(16.0**c), -(2.0**c), 0.0, 1.0, 54.0**c], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=1e-14, atol=1e-15)
    previous = _norm("gamma_pow", 2.0, 1.0 / 3.0).post(A)
    assert float((out - previous).detach().abs().max()) > 1.0


def test_the_default_is_still_algorithm_1() -> None:
    norm = _norm(None, 2.0, 1.0 / 3.0)
    assert norm.post_form == "gamma_pow" and PPSBN(power=False).post_form == "gamma_only"
    expected = torch.tensor([-4.0, -2.0, 0.0, 2 * 0.5 ** (1 / 3), 6.0], dtype=torch.float64)
    torch.testing.assert_close(norm.post(A), expected, rtol=1e-14, atol=1e-15)


def test_the_two_forms_agree_with_gamma_raised_to_beta_and_differ_in_sign_for_negative_gamma() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        _norm("pow_gamma", 1.7, 0.6).post(a), _norm("gamma_pow", 1.7**0.6, 0.6).post(a), rtol=1e-13, atol=1e-15
    )
    # gamma < 0: (gamma a)^beta has the sign of gamma * a, and |gamma|^beta |a|^beta as magnitude
    out = _norm("pow_gamma", -2.0, 0.5).post(A)
    expected = torch.sign(-2.0 * A) * (2.0 * A.abs()) ** 0.5
    torch.testing.assert_close(out, expected, rtol=1e-14, atol=1e-15)


def test_identity_at_init_and_per_channel_parameters() -> None:
    torch.testing.assert_close(PPSBN(post_form="pow_gamma").double().post(A), A, rtol=1e-14, atol=0.0)
    norm = _norm("pow_gamma", 1.0, 1.0, channels=2)
    with torch.no_grad():
        norm.gamma.copy_(torch.tensor([2.0, 3.0]))
        norm.beta.copy_(torch.tensor([0.5, 2.0]))
    a = torch.tensor([[8.0, -1.0], [0.5, 2.0]], dtype=torch.float64)
    expected = torch.tensor([[4.0, -9.0], [1.0, 36.0]], dtype=torch.float64)
    torch.testing.assert_close(norm.post(a), expected, rtol=1e-14, atol=1e-15)


def test_gradients_are_finite_at_zero_and_exact() -> None:
    """At a = 0 the gradients stay finite; elsewhere, for y = sign(g x)|g x|^b with g > 0:
    dy/dg = b y / g, dy/db = y log|g x|, and gradcheck in x."""
    norm = _norm("pow_gamma", 2.0, 1.0 / 3.0)
    norm.post(A).sum().backward()
    assert bool(torch.isfinite(norm.gamma.grad)) and bool(torch.isfinite(norm.beta.grad))
    x = torch.tensor([-2.0, -0.3, 0.7, 1.9], dtype=torch.float64)
    norm = _norm("pow_gamma", 1.3, 0.7)
    y = norm.post(x)
    d_gamma, d_beta = torch.autograd.grad(y.sum(), [norm.gamma, norm.beta])
    y = y.detach()
    torch.testing.assert_close(d_gamma, (0.7 * y / 1.3).sum(), rtol=1e-12, atol=0.0)
    torch.testing.assert_close(d_beta, (y * (1.3 * x).abs().log()).sum(), rtol=1e-12, atol=0.0)
    assert torch.autograd.gradcheck(norm.post, (x.clone().requires_grad_(),))


def test_schoenbat_takes_the_form_by_name() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    plain = ka.create("schoenbat", num_features=16, seed=0, power=False).double()
    gated = ka.create("schoenbat", num_features=16, seed=0, post_form="pow_gamma").double()
    assert gated.normalizer.post_form == "pow_gamma"
    with torch.no_grad():
        gated.normalizer.gamma.fill_(3.0)
        gated.normalizer.beta.fill_(0.5)
        att = plain(q, k, v)  # gamma = 1, no power: the RMFA output A
        out = gated(q, k, v)
    torch.testing.assert_close(out, torch.sign(att) * (3.0 * att.abs()) ** 0.5, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("options", "argument"),
    [({"post_form": "gamma-pow"}, "post_form"), ({"power": False, "post_form": "pow_gamma"}, "power")],
)
def test_bad_forms_are_refused_naming_the_argument(options: dict, argument: str) -> None:
    with pytest.raises(InputError, match=argument):
        PPSBN(**options)


def test_schoenbat_refuses_post_form_for_another_normalizer() -> None:
    """post_form belongs to ppSBN: with the row normaliser it has nothing to act on."""
    with pytest.raises(InputError, match="post_form.*ppsbn"):
        ka.create("schoenbat", num_features=16, seed=0, normalizer="row", post_form="pow_gamma")
