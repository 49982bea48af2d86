"""Module-level callables used by the claims of the spectral maps (FM005, HP001).

* ``derive_*``: SymPy expectations of the single-frequency estimators against the closed forms
  (FM005), in one dimension, with the reparameterised frequency
  :math:`\\omega = a n + \\mu \\sim \\mathcal N(\\mu, a^2)`.
* ``evaluate_*``: two-dimensional expectations over the noise :math:`n \\sim \\mathcal N(0, I_2)`
  by a tensor-product Gauss–Hermite rule at ``dps`` digits (HP001), against the closed forms
  of :mod:`kernelattn_spectral.kernels`. The quadrature never uses the closed form.
"""

from __future__ import annotations

from typing import Any

#: Two-component 2-D mixture used by the quadrature identities (fixed, "random-looking").
MEANS_2D = (("0.3", "-0.5"), ("-0.7", "0.2"))
FACTORS_2D = ((("0.9", "0.0"), ("-0.4", "0.7")), (("0.5", "0.3"), ("0.2", "1.1")))  # full A_c (GMM-RKS)
SCALES_2D = (("0.8", "1.3"), ("0.6", "0.9"))  # diagonal a_c (GMM-PRF)
X_2D = ("0.45", "-0.3")
Y_2D = ("-0.35", "0.3")
GH_NODES = 60


def _gauss_normal_expectation(f: Any, dps: int) -> Any:
    """:math:`\\mathbb{E}_{n \\sim \\mathcal N(0, I_2)}[f(n_1, n_2)]` by a 2-D Gauss–Hermite rule."""
    import mpmath as mp

    nodes, weights = mp.gauss_quadrature(GH_NODES, "hermite")  # weight e^{-t^2}
    r2 = mp.sqrt(2)
    total = mp.mpf(0)
    for t1, w1 in zip(nodes, weights):
        for t2, w2 in zip(nodes, weights):
            total += w1 * w2 * f(r2 * t1, r2 * t2)
    return total / mp.pi


def derive_rks_1d() -> tuple[Any, Any, str]:
    """FM005 for GMM-RKS: :math:`\\mathbb{E}[\\cos\\omega x \\cos\\omega y + \\sin\\omega x \\sin\\omega y]`
    with :math:`\\omega \\sim \\mathcal N(\\mu, a^2)` equals :math:`e^{-a^2\\delta^2/2}\\cos(\\mu\\delta)`."""
    import sympy as sp

    w = sp.Symbol("omega", real=True)
    y, delta = sp.symbols("y delta", real=True)
    a = sp.Symbol("a", positive=True)
    mu = sp.Symbol("mu", real=True)
    x = y + delta
    density = sp.exp(-((w - mu) ** 2) / (2 * a**2)) / (a * sp.sqrt(2 * sp.pi))
    estimate = sp.cos(w * x) * sp.cos(w * y) + sp.sin(w * x) * sp.sin(w * y)  # phi(x).phi(y), one frequency
    single = sp.simplify(sp.trigsimp(estimate))
    terms = sp.Add.make_args(sp.expand(single.rewrite(sp.exp)))
    expectation = sp.expand_complex(
        sum(sp.integrate(term * density, (w, -sp.oo, sp.oo), conds="none") for term in terms)
    )
    target = sp.exp(-(a**2) * delta**2 / 2) * sp.cos(mu * delta)
    return expectation, target, "integral over omega ~ N(mu, a^2) (omega = a n + mu) of the product of RKS features"


def derive_prf_1d() -> tuple[Any, Any, str]:
    """FM005 for GMM-PRF: :math:`\\mathbb{E}[e^{\\omega q - q^2/2} e^{\\omega k - k^2/2}]` with
    :math:`\\omega \\sim \\mathcal N(\\mu, a^2)` equals :math:`e^{\\mu s + a^2 s^2/2 - q^2/2 - k^2/2}`."""
    import sympy as sp

    w = sp.Symbol("omega", real=True)
    q, k = sp.symbols("q k", real=True)
    a = sp.Symbol("a", positive=True)
    mu = sp.Symbol("mu", real=True)
    density = sp.exp(-((w - mu) ** 2) / (2 * a**2)) / (a * sp.sqrt(2 * sp.pi))
    estimate = sp.exp(w * q - q**2 / 2) * sp.exp(w * k - k**2 / 2)  # phi(q) phi(k), one frequency
    # split the log-estimate into omega * c + rest (rest free of omega), integrate e^{omega t}, put t = c
    log_est = sp.expand(sp.log(sp.powsimp(estimate)), force=True)
    c = log_est.coeff(w)
    rest = sp.simplify(log_est - c * w)
    if w in rest.free_symbols:  # pragma: no cover - the estimator is log-linear in omega
        raise AssertionError("PRF log-estimate is not linear in omega")
    t = sp.Symbol("t", real=True)
    mgf = sp.integrate(sp.exp(w * t) * density, (w, -sp.oo, sp.oo), conds="none")
    expectation = sp.simplify(mgf.subs(t, c)) * sp.exp(rest)
    s = q + k
    target = sp.exp(mu * s + a**2 * s**2 / 2 - q**2 / 2 - k**2 / 2)
    return expectation, target, "integral over omega ~ N(mu, a^2) of the product of PRF features"


def gmm_rks_closed_form_2d(dps: int, *, paper_covariance: bool = False) -> Any:
    """The closed form :math:`\\frac1C\\sum_c e^{-\\delta^\\top A_c A_c^\\top \\delta/2}\\cos(\\mu_c^\\top\\delta)`
    at the fixed 2-D parameters; ``paper_covariance=True`` uses :math:`A_c` as the covariance
    (the paper's Eq. 4 read literally; wrong for the sampler of Eq. 5)."""
    import mpmath as mp

    with mp.workdps(dps):
        dl = [mp.mpf(a) - mp.mpf(b) for a, b in zip(X_2D, Y_2D)]
        total = mp.mpf(0)
        for mu, fac in zip(MEANS_2D, FACTORS_2D):
            a = [[mp.mpf(v) for v in row] for row in fac]
            if paper_covariance:
                quad = sum(dl[i] * a[i][j] * dl[j] for i in range(2) for j in range(2))
            else:
                at_d = [a[0][j] * dl[0] + a[1][j] * dl[1] for j in range(2)]  # A^T delta
                quad = at_d[0] ** 2 + at_d[1] ** 2
            total += mp.exp(-quad / 2) * mp.cos(mp.mpf(mu[0]) * dl[0] + mp.mpf(mu[1]) * dl[1])
        return total / len(MEANS_2D)


def evaluate_gmm_rks_2d(dps: int) -> tuple[Any, Any, str]:
    """HP001: 2-D expectation of the GMM-RKS estimator (full :math:`A_c`, :math:`C = 2`) equals the
    ``spectral-gmm`` closed form."""
    import mpmath as mp

    with mp.workdps(dps):
        x = [mp.mpf(v) for v in X_2D]
        y = [mp.mpf(v) for v in Y_2D]
        value = mp.mpf(0)
        for mu, fac in zip(MEANS_2D, FACTORS_2D):
            a = [[mp.mpf(v) for v in row] for row in fac]
            m = [mp.mpf(v) for v in mu]

            def f(n1: Any, n2: Any, a: Any = a, m: Any = m) -> Any:
                w = [a[i][0] * n1 + a[i][1] * n2 + m[i] for i in range(2)]  # omega = A n + mu
                wx, wy = w[0] * x[0] + w[1] * x[1], w[0] * y[0] + w[1] * y[1]
                return mp.cos(wx) * mp.cos(wy) + mp.sin(wx) * mp.sin(wy)

            value += _gauss_normal_expectation(f, dps)
        value /= len(MEANS_2D)
        return value, gmm_rks_closed_form_2d(dps), "2-D Gauss-Hermite (60^2 nodes) over n ~ N(0, I)"


def gmm_prf_closed_form_2d(dps: int) -> Any:
    """:math:`\\frac1C\\sum_c e^{\\mu_c^\\top s + s^\\top \\mathrm{diag}(a_c^2) s/2 - |x|^2/2 - |y|^2/2}` at the
    fixed 2-D parameters."""
    import mpmath as mp

    with mp.workdps(dps):
        x = [mp.mpf(v) for v in X_2D]
        y = [mp.mpf(v) for v in Y_2D]
        s = [x[i] + y[i] for i in range(2)]
        norms = (x[0] ** 2 + x[1] ** 2 + y[0] ** 2 + y[1] ** 2) / 2
        total = mp.mpf(0)
        for mu, sc in zip(MEANS_2D, SCALES_2D):
            expo = sum(mp.mpf(mu[i]) * s[i] + mp.mpf(sc[i]) ** 2 * s[i] ** 2 / 2 for i in range(2))
            total += mp.exp(expo - norms)
        return total / len(MEANS_2D)


def evaluate_gmm_prf_2d(dps: int) -> tuple[Any, Any, str]:
    """HP001: 2-D expectation of the GMM-PRF estimator (diagonal :math:`a_c`, :math:`C = 2`) equals the
    ``spectral-prf`` closed form."""
    import mpmath as mp

    with mp.workdps(dps):
        x = [mp.mpf(v) for v in X_2D]
        y = [mp.mpf(v) for v in Y_2D]
        nx, ny = (x[0] ** 2 + x[1] ** 2) / 2, (y[0] ** 2 + y[1] ** 2) / 2
        value = mp.mpf(0)
        for mu, sc in zip(MEANS_2D, SCALES_2D):
            a = [mp.mpf(v) for v in sc]
            m = [mp.mpf(v) for v in mu]

            def f(n1: Any, n2: Any, a: Any = a, m: Any = m) -> Any:
                w = (a[0] * n1 + m[0], a[1] * n2 + m[1])  # omega = a * n + mu
                return mp.exp(w[0] * x[0] + w[1] * x[1] - nx) * mp.exp(w[0] * y[0] + w[1] * y[1] - ny)

            value += _gauss_normal_expectation(f, dps)
        value /= len(MEANS_2D)
        return value, gmm_prf_closed_form_2d(dps), "2-D Gauss-Hermite (60^2 nodes) over n ~ N(0, I)"


# --------------------------------------------------------------------------- option coverage (spec 1.1)
def _generative_claims() -> tuple[Any, ...]:
    from kernelattn_core.toolkit import EngineReference

    # a small generator network at trained-like weights: the engine's outputs and the
    # gradients reaching every weight of the network (what fitting the spectral density uses)
    return (
        EngineReference(
            perturb=0.1,
            options={"noise_dim": 4, "hidden_dims": (16, 16), "output_scale": 0.5},
            grid=({"noise_dim": 6, "hidden_dims": (12,), "negative_slope": 0.0, "output_scale": 1.5},),
        ),
    )


#: claims of the generative maps for their options (network shape, slope, output scale)
GENERATIVE_CLAIMS: tuple[Any, ...] = _generative_claims()
