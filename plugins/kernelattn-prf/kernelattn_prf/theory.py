"""Closed forms and symbolic derivations for PRF, hyperbolic PRF, CEXP and HCEXP.

Everything here is a plain module-level function so that the claims of the feature
maps (``kernelattn_core.claims``) can refer to it.

Notation: :math:`\\mathrm{SM}(x, y) = e^{x^\\top y}`, :math:`z = Ax + A^{-T}y` (for PRF
:math:`A = I`, so :math:`z = x + y`), :math:`t = \\|z\\|^2`, and :math:`m` is the number
of random vectors :math:`\\omega` (the two-sided maps have :math:`2m` features).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .feature_maps import PositiveRandomFeatures


# --------------------------------------------------------------------------- Lemma 3.1
def cexp_mse(z_sq: torch.Tensor, sm: torch.Tensor, m: int) -> torch.Tensor:
    """Lemma 3.1, one-sided (PRF / CEXP) with ``m`` random vectors:

    .. math:: \\mathrm{MSE} = \\frac{1}{m} e^{\\|z\\|^2}\\,\\mathrm{SM}^2\\,(1 - e^{-\\|z\\|^2})
              = \\frac{1}{m}\\,\\mathrm{SM}^2 (e^{\\|z\\|^2} - 1).
    """
    return sm * sm * torch.expm1(z_sq) / m


def hcexp_mse(z_sq: torch.Tensor, sm: torch.Tensor, m: int) -> torch.Tensor:
    """Lemma 3.1, two-sided (hyperbolic PRF / HCEXP) with ``m`` random vectors (``2m`` features):

    .. math:: \\mathrm{MSE} = \\frac{1}{2m} e^{\\|z\\|^2}\\,\\mathrm{SM}^2\\,(1 - e^{-\\|z\\|^2})^2
              = \\frac{1}{2m}\\,\\mathrm{SM}^2\\,\\big(2\\sinh(\\|z\\|^2/2)\\big)^2 .
    """
    return sm * sm * (2.0 * torch.sinh(0.5 * z_sq)) ** 2 / (2 * m)


def max_relative_error_w(r: float | torch.Tensor) -> Any:
    """The corrected :math:`W(r) = e^{2r^2}(1 - e^{-4r^2}) = 2\\sinh(2r^2)` of Lemma 3.2.

    :math:`\\epsilon_C(\\widehat{\\mathrm{SM}}^{hcexp}_{A,m}) \\le W(r)/\\sqrt{2m}` when
    :math:`\\|Ax\\|, \\|A^{-T}y\\| \\le r` on :math:`C` (the paper prints "=").
    """
    if isinstance(r, torch.Tensor):
        return 2.0 * torch.sinh(2.0 * r * r)
    return 2.0 * math.sinh(2.0 * r * r)


def max_relative_error_w_printed(r: float) -> float:
    """The paper's printed :math:`W(r) = e^{2r^2}(1 - e^{4r^2})`: negative for every :math:`r > 0`
    (a sign error; kept only so that a regression test can show it is not used)."""
    return math.exp(2 * r * r) * (1 - math.exp(4 * r * r))


def hcexp_relative_rms_bound(r: float, m: int) -> float:
    """:math:`\\epsilon_C \\le W(r) / \\sqrt{2m}` (corrected Lemma 3.2)."""
    return max_relative_error_w(r) / math.sqrt(2 * m)


def cexp_relative_rms_bound(r: float, m: int) -> float:
    """One-sided analogue: :math:`\\epsilon_C \\le \\sqrt{(e^{4r^2} - 1)/m}`."""
    return math.sqrt(math.expm1(4 * r * r) / m)


# --------------------------------------------------------------------------- claim helpers
def estimate_variance(x: torch.Tensor, y: torch.Tensor, feature_map: PositiveRandomFeatures) -> torch.Tensor:
    """:math:`\\mathrm{Var}[\\phi_q(x)^\\top \\phi_k(y)]` of the built map for ``x, y [pairs, d]``
    (iid :math:`\\omega`): Lemma 3.1 with the map's own :math:`A` (identity for PRF).

    Used by the FM003 claims. Orthogonal features have a smaller variance; the
    formula is for iid rows only.
    """
    x, y = x.double(), y.double()
    z = feature_map.transform(x, query=True) + feature_map.transform(y, query=False)  # [pairs, d]
    z_sq = (z * z).sum(-1)
    sm = (x * y).sum(-1).exp()
    m = feature_map.num_features
    return hcexp_mse(z_sq, sm, m) if feature_map.two_sided else cexp_mse(z_sq, sm, m)


# --------------------------------------------------------------------------- symbolic (SymPy, d = 1)
@functools.lru_cache(maxsize=1)
def gaussian_mgf() -> tuple[Any, Any]:
    """:math:`\\mathbb{E}_{\\omega \\sim N(0,1)}[e^{s\\omega}]` by SymPy's integral: ``(s, expression)``.

    The one integral every derivation below rests on (it evaluates to :math:`e^{s^2/2}`).
    """
    import sympy as sp

    w, s = sp.symbols("omega s", real=True)
    density = sp.exp(-(w**2) / 2) / sp.sqrt(2 * sp.pi)
    return s, sp.integrate(sp.exp(s * w) * density, (w, -sp.oo, sp.oo))


def _gaussian_expectation(expr: Any, w: Any) -> Any:
    """:math:`\\mathbb{E}_{\\omega\\sim N(0,1)}[\\mathrm{expr}]` for a sum of terms :math:`c\\,e^{a + b\\omega}`.

    Each term's expectation is :math:`c\\,e^{a}\\,\\mathbb{E}[e^{b\\omega}]` with the symbolic
    Gaussian integral of :func:`gaussian_mgf` (linearity of the integral). Faster and
    more robust than integrating each estimator (``erf`` terms that SymPy cannot
    always cancel).
    """
    import sympy as sp

    s, mgf = gaussian_mgf()
    total = sp.Integer(0)
    for term in sp.Add.make_args(sp.expand(sp.powsimp(sp.expand(expr.rewrite(sp.exp)), combine="exp"))):
        term = sp.powsimp(term, combine="exp")
        coeff, exponent = sp.Integer(1), sp.Integer(0)
        for factor in sp.Mul.make_args(term):
            if isinstance(factor, sp.exp):
                exponent += factor.args[0]
            else:
                coeff *= factor
        if coeff.has(w):
            raise ValueError(f"expected terms c * exp(a + b * omega), got {term}")
        exponent = sp.expand(exponent)
        poly = sp.Poly(exponent, w)
        if poly.degree() > 1:
            raise ValueError(f"expected an exponent linear in omega, got {exponent}")
        b = exponent.coeff(w, 1)
        a = exponent.coeff(w, 0)
        total += coeff * sp.exp(a) * mgf.subs(s, b)
    return total


def derive_prf_1d() -> tuple[Any, Any, str]:
    """FM005 for PRF: :math:`\\int \\xi(x,\\omega)\\xi(y,\\omega)\\,\\varphi(\\omega)\\,d\\omega = e^{xy}`
    with :math:`\\xi(u, \\omega) = e^{\\omega u - u^2/2}`, in one dimension."""
    import sympy as sp

    w, x, y = sp.symbols("omega x y", real=True)
    xi = lambda u: sp.exp(w * u - u**2 / 2)  # noqa: E731
    return _gaussian_expectation(xi(x) * xi(y), w), sp.exp(x * y), "1-D Gaussian integral over omega ~ N(0, 1)"


def derive_prf_hyperbolic_1d() -> tuple[Any, Any, str]:
    """FM005 for hyperbolic PRF: :math:`\\mathbb{E}[\\tfrac12(\\xi_+(x)\\xi_+(y) + \\xi_-(x)\\xi_-(y))] = e^{xy}`
    with :math:`\\xi_\\pm(u) = e^{\\pm\\omega u - u^2/2}`."""
    import sympy as sp

    w, x, y = sp.symbols("omega x y", real=True)
    plus = lambda u: sp.exp(w * u - u**2 / 2)  # noqa: E731
    minus = lambda u: sp.exp(-w * u - u**2 / 2)  # noqa: E731
    expr = (plus(x) * plus(y) + minus(x) * minus(y)) / 2
    return _gaussian_expectation(expr, w), sp.exp(x * y), "1-D Gaussian integral of the two-sided pair"


def derive_cexp_1d() -> tuple[Any, Any, str]:
    """FM005 for CEXP: with :math:`x' = ax`, :math:`y' = y/a` (:math:`a > 0`),
    :math:`\\mathbb{E}[\\xi(x',\\omega)\\xi(y',\\omega)] = e^{xy}` for every :math:`a`."""
    import sympy as sp

    w, x, y = sp.symbols("omega x y", real=True)
    a = sp.symbols("a", positive=True)
    xi = lambda u: sp.exp(w * u - u**2 / 2)  # noqa: E731
    return _gaussian_expectation(xi(a * x) * xi(y / a), w), sp.exp(x * y), "1-D, A = a > 0 symbolic"


def derive_hcexp_1d() -> tuple[Any, Any, str]:
    """FM005 for HCEXP: the two-sided CEXP pair averages to :math:`e^{xy}` for every :math:`a > 0`."""
    import sympy as sp

    w, x, y = sp.symbols("omega x y", real=True)
    a = sp.symbols("a", positive=True)
    plus = lambda u: sp.exp(w * u - u**2 / 2)  # noqa: E731
    minus = lambda u: sp.exp(-w * u - u**2 / 2)  # noqa: E731
    expr = (plus(a * x) * plus(y / a) + minus(a * x) * minus(y / a)) / 2
    return _gaussian_expectation(expr, w), sp.exp(x * y), "1-D two-sided, A = a > 0 symbolic"


def derive_lemma31_1d(two_sided: bool) -> tuple[Any, Any]:
    """Per-:math:`\\omega` variance (``m = 1``) by the Gaussian integral, and Lemma 3.1, in one dimension.

    Returns ``(variance, lemma)`` SymPy expressions in ``x, y, a``; their difference
    simplifies to zero.
    """
    import sympy as sp

    w, x, y = sp.symbols("omega x y", real=True)
    a = sp.symbols("a", positive=True)
    xp, yp = a * x, y / a
    z = xp + yp
    if two_sided:
        est = sp.exp(-(xp**2 + yp**2) / 2) * sp.cosh(w * z)
    else:
        est = sp.exp(w * z - (xp**2 + yp**2) / 2)
    second = _gaussian_expectation(est.rewrite(sp.exp) ** 2, w)
    variance = second - sp.exp(2 * x * y)
    sm2 = sp.exp(2 * x * y)
    t = z**2
    lemma = sp.exp(t) * sm2 * (1 - sp.exp(-t)) ** 2 / 2 if two_sided else sp.exp(t) * sm2 * (1 - sp.exp(-t))
    return variance, lemma


# --------------------------------------------------------------------------- Theorem 3.3
def chi2_quantile(q: float, dof: int) -> float:
    """Chi-square quantile :math:`\\chi^2_{d}(q)` (inverse of the regularised lower
    incomplete gamma, solved with mpmath at 30 digits; no SciPy needed).

    Examples
    --------
    >>> round(chi2_quantile(0.99736945, 6), 4)
    20.1254
    """
    import mpmath as mp

    if not (0.0 < q < 1.0):
        from kernelattn_core.toolkit import InputError

        raise InputError(f"q: expected a probability in (0, 1), got {q!r}")
    with mp.workdps(30):
        k = mp.mpf(dof) / 2
        target = mp.mpf(q)
        h = 2.0 / (9.0 * dof)  # Wilson-Hilferty start
        z = float(mp.sqrt(2) * mp.erfinv(2 * target - 1))
        start = max(dof * (1 - h + z * math.sqrt(h)) ** 3, 1e-6)
        x = mp.findroot(lambda t: mp.gammainc(k, 0, t / 2, regularized=True) - target, mp.mpf(start))
    return float(x)


def f_quantile(q: float, d1: int, d2: int) -> float:
    """Quantile of Fisher's :math:`F_{d_1, d_2}` (inverse regularised incomplete beta, mpmath)."""
    import mpmath as mp

    with mp.workdps(30):
        a, b = mp.mpf(d1) / 2, mp.mpf(d2) / 2
        beta = mp.findroot(
            lambda u: mp.betainc(a, b, 0, u, regularized=True) - q,
            (mp.mpf("1e-12"), 1 - mp.mpf("1e-12")),
            solver="anderson",
        )
        return float(beta * d2 / (d1 * (1 - beta)))


def theorem33_radius(
    a: torch.Tensor,
    mu_x: torch.Tensor,
    sigma_x: torch.Tensor,
    mu_y: torch.Tensor,
    sigma_y: torch.Tensor,
    p: float,
    s: int,
) -> float:
    """The radius :math:`r` of Theorem 3.3 (CEXP paper; spec 004 §2.4).

    .. math::
        r = \\max\\Big(\\sqrt{\\lambda_{Ax}\\,\\chi^2_d(p^{1/(2s)})} + \\|A\\mu_x\\|,\\
                  \\sqrt{\\lambda_{A^{-T}y}\\,\\chi^2_d(p^{1/(2s)})} + \\|A^{-T}\\mu_y\\|\\Big),

    with :math:`\\lambda` the largest eigenvalues of :math:`A\\Sigma_xA^\\top` and
    :math:`A^{-T}\\Sigma_yA^{-1}`. With probability at least ``p`` over ``s`` i.i.d.
    Gaussian queries and ``s`` keys, every :math:`\\|Ax_i\\|, \\|A^{-T}y_j\\| \\le r`, and then
    the **RMS** relative error of HCEXP is at most :math:`W(r)/\\sqrt{2m}`
    (:func:`hcexp_relative_rms_bound`); a single draw's error is not bounded.

    Parameters
    ----------
    a : Tensor ``[d, d]`` (invertible)
    mu_x, mu_y : Tensor ``[d]``
    sigma_x, sigma_y : Tensor ``[d, d]`` (positive definite)
    p : float in (0, 1)
    s : int
        Number of queries (and of keys).
    """
    d = a.shape[-1]
    a = a.to(torch.float64)
    a_inv_t = torch.linalg.inv(a).T
    cov_x = a @ sigma_x.to(torch.float64) @ a.T
    cov_y = a_inv_t @ sigma_y.to(torch.float64) @ a_inv_t.T
    chi = chi2_quantile(p ** (1.0 / (2 * s)), d)
    rx = math.sqrt(float(torch.linalg.eigvalsh(cov_x).max()) * chi) + float((a @ mu_x.to(torch.float64)).norm())
    ry = math.sqrt(float(torch.linalg.eigvalsh(cov_y).max()) * chi) + float((a_inv_t @ mu_y.to(torch.float64)).norm())
    return max(rx, ry)


def hotelling_new_observation_quantile(q: float, n: int, d: int) -> float:
    """Quantile of :math:`T^2 = (x - \\bar x)^\\top S^{-1}(x - \\bar x)` for a **new** observation
    when mean and covariance are estimated from ``n`` samples (the Hotelling reading of the
    paper's remark, spec 004 §2.4): :math:`\\frac{(n+1)(n-1)d}{n(n-d)} F_{d, n-d}(q)`."""
    return (n + 1) * (n - 1) * d / (n * (n - d)) * f_quantile(q, d, n - d)


# --------------------------------------------------------------------------- option coverage (spec 1.1)
def nonsymmetric_matrix(d: int) -> torch.Tensor:
    """A fixed invertible, non-symmetric :math:`A` ``[d, d]``: the identity plus a seeded
    strictly upper-triangular part and a diagonal between 0.7 and 1.3, so that
    :math:`A^{-T} \\ne A^{-1}` and a map that confused them is biased."""
    g = torch.Generator().manual_seed(20_261_130)
    upper = torch.randn(d, d, generator=g, dtype=torch.float64).triu(1) * (0.6 / math.sqrt(d))
    diag = 0.7 + 0.6 * torch.rand(d, generator=g, dtype=torch.float64)
    return torch.diag(diag) + upper


def fit_anisotropic(feature_map: Any, generator: torch.Generator) -> None:
    """``setup`` of the data-adapted claims: fit the map's statistics (``rule`` means,
    variance or full) on queries and keys with different per-coordinate scales, means and a
    correlation, so :math:`A` is far from the identity (and not diagonal for ``full``)."""
    d = feature_map.head_dim
    scale_x = torch.linspace(0.3, 1.5, d, dtype=torch.float64)
    scale_y = torch.linspace(1.2, 0.4, d, dtype=torch.float64)
    mix = torch.eye(d, dtype=torch.float64) + 0.3 * torch.randn(d, d, generator=generator, dtype=torch.float64) / d
    x = torch.randn(512, d, generator=generator, dtype=torch.float64) @ mix * scale_x + 0.2
    y = torch.randn(512, d, generator=generator, dtype=torch.float64) * scale_y - 0.1
    feature_map.fit(x * 0.4, y * 0.4)


def _cexp_claims() -> tuple[Any, ...]:
    from kernelattn_core.toolkit import EngineReference, EstimateVariance, UnbiasedKernelEstimate

    fixed = {"rule": "fixed", "matrix": nonsymmetric_matrix(16)}
    return (
        # a non-symmetric A: unbiased and the Lemma 3.1 variance (z = Ax + A^-T y)
        UnbiasedKernelEstimate(dims=(16,), options=fixed),
        EstimateVariance(variance=estimate_variance, options=fixed),
        # A adapted to anisotropic data by every data rule (diagonal and full)
        UnbiasedKernelEstimate(
            dims=(16,),
            setup=fit_anisotropic,
            options={"rule": "variance"},
            grid=({"rule": "full"}, {"rule": "means"}),
        ),
        EstimateVariance(variance=estimate_variance, setup=fit_anisotropic, options={"rule": "full"}),
        # the engine with data-adapted statistics (the map's prepare in the loop)
        EngineReference(setup=lambda est, g: fit_anisotropic(est.feature_map, g), options={"rule": "full"}),
    )


#: claims of ``cexp`` and ``hcexp`` for their options (non-symmetric and data-adapted A)
CEXP_OPTION_CLAIMS: tuple[Any, ...] = _cexp_claims()
