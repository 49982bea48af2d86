"""Claim callables of random Maclaurin features that read the runtime object.

* SP001: the degree laws written in closed form (never through the symbolic sum the
  checker evaluates), compared with the :class:`~kernelattn_maclaurin.sampling.DegreeDistribution`
  a built map really samples from.
* FM005: the expectation of :math:`\\Phi(x)^\\top\\Phi(y)` assembled from the **runtime
  weights** of a built map (its ``_weights`` for each degree), the exact degree law and
  the exact Rademacher moment, against the Taylor polynomial of the kernel's SymPy
  expression.
"""

from __future__ import annotations

import itertools
from fractions import Fraction
from typing import Any

import torch

#: degrees summed in the runtime FM005 derivation
RUNTIME_ORDER = 12


def pmf_paper_closed_form(n: Any) -> Any:
    """:math:`P[N = n] = (p - 1) p^{-(n+1)}` with :math:`p = 1 + q`, written out."""
    import sympy

    q = sympy.Symbol("q", positive=True)
    return q * (1 + q) ** (-(n + 1))


def pmf_truncated_closed_form(start: int, stop: int) -> Any:
    """:math:`P[N = n] = p^{-(n+1)} (1 - p^{-1}) / (p^{-(s+1)} (1 - p^{-L}))`, :math:`L = c - s + 1`:
    the closed-form normaliser the runtime's ``log_normalizer`` implements."""
    import sympy

    def pmf(n: Any) -> Any:
        q = sympy.Symbol("q", positive=True)
        p = 1 + q
        length = stop - start + 1
        return p ** (-(n + 1)) * (1 - 1 / p) / (p ** (-(start + 1)) * (1 - p ** (-length)))

    return pmf


def runtime_law(mode: str, p: float) -> Any:
    """``runtime()`` of SP001: the degree law of a built ``rmf`` map and ``q = p - 1``."""

    def runtime() -> tuple[Any, dict[str, float]]:
        from .feature_maps import RandomMaclaurinFeatures

        fm = RandomMaclaurinFeatures(head_dim=4, num_features=8, mode=mode, p=p)
        return fm.distribution, {"q": p - 1.0}

    return runtime


def _snap(value: float, exact: Any) -> Any:
    """``exact`` (a SymPy rational) when the float agrees with it to 1e-12 relative, else the
    float's exact binary value, so that a wrong runtime weight leaves a non-zero residual."""
    import sympy

    if exact == 0:
        return sympy.Integer(0) if value == 0 else sympy.Rational(Fraction(value))
    if abs(value / float(exact) - 1.0) <= 1e-12:
        return exact
    return sympy.Rational(Fraction(value))


def derive_runtime_expectation(feature_map: Any) -> tuple[Any, Any, str]:
    """FM005 on the runtime object: for a built paper-mode ``rmf`` map,

    .. math:: \\mathbb{E}[\\Phi(x)^\\top\\Phi(y)] = \\sum_n P[n]\\, R\\, w_n^2\\, m(x, y)^n,

    with :math:`w_n` the map's own weight for a feature of degree :math:`n` (computed by
    its ``_weights``, which reads the kernel's coefficient table and the law's
    ``log_pmf``), :math:`P[n] = (p-1)p^{-(n+1)}` exact at the map's :math:`p` and
    :math:`m = \\mathbb{E}_\\omega[\\langle\\omega,x\\rangle\\langle\\omega,y\\rangle]` by exact
    enumeration of the Rademacher signs (``d = 2`` symbols). Summed to degree
    :data:`RUNTIME_ORDER`; the target is the kernel's SymPy expression expanded to the
    same order. A runtime weight off by more than 1e-12 relative leaves a residual.
    """
    import sympy

    fm = feature_map
    if fm.mode != "paper":
        raise ValueError("derive_runtime_expectation: paper mode only (released mode has a constant feature)")
    d = 2
    xs = sympy.symbols(f"x1:{d + 1}", real=True)
    ys = sympy.symbols(f"y1:{d + 1}", real=True)
    signs = list(itertools.product((-1, 1), repeat=d))
    m = sympy.expand(
        sum(sum(w * x for w, x in zip(s, xs)) * sum(w * y for w, y in zip(s, ys)) for s in signs) / len(signs)
    )
    p = sympy.Rational(Fraction(fm.p))
    degrees = torch.arange(RUNTIME_ORDER + 1)
    weights = fm._weights(degrees).tolist()  # runtime weights w_n = sqrt(a_n / P[n] / R)
    t = sympy.Symbol("t")
    taylor = sympy.series(fm.target.sympy_expr(t), t, 0, RUNTIME_ORDER + 1).removeO()
    expectation = sympy.Integer(0)
    for n, w in enumerate(weights):
        prob = (p - 1) * p ** (-(n + 1))
        exact_a = sympy.nsimplify(sympy.expand(taylor).coeff(t, n))
        term = _snap(float(prob) * fm.num_random * w * w, exact_a)
        expectation += term * m**n
    target = taylor.subs(t, m)
    note = (
        f"runtime weights of rmf(kernel={fm.kernel!r}, p={fm.p}) for degrees 0..{RUNTIME_ORDER}, "
        f"P[n] = (p-1)/p^(n+1), E over 2^{d} Rademacher sign vectors"
    )
    return sympy.expand(expectation), sympy.expand(target), note


# --------------------------------------------------------------------------- negative controls
def pmf_as_printed(n: Any) -> Any:
    """Negative control of SP001: the papers print :math:`P[N = n] = 1/p^{n+1}`, which sums
    to :math:`1/(p - 1)` (a law only at :math:`p = 2`)."""
    import sympy

    q = sympy.Symbol("q", positive=True)
    return (1 + q) ** (-(n + 1))


def variance_paper_form(x: torch.Tensor, y: torch.Tensor, feature_map: Any) -> torch.Tensor:
    """Negative control of FM003: the paper-mode variance formula applied to a released-mode
    map (whose constant feature removes the :math:`a_0^2 (p - 1)` term)."""
    from .variance import rmf_variance

    return rmf_variance(
        x,
        y,
        feature_map.target,
        p=feature_map.p,
        projection=feature_map.projection,
        mode="paper",
        max_degree=None,
        num_features=feature_map.num_features,
    )


# --------------------------------------------------------------------------- ppSBN and SchoenbAt (spec 1.1)
def _post_closed_form(a: float, gamma: float, beta: float | None, form: str) -> float:
    """The paper's post-scaling of one output entry, in Python floats (signed power for a
    negative base): Algorithm 1's :math:`\\gamma\\,\\mathrm{sign}(a)|a|^\\beta`, §3.2's
    :math:`\\mathrm{sign}(\\gamma a)|\\gamma a|^\\beta`, or the released code's :math:`\\gamma a`."""
    import math

    if form == "gamma_only" or beta is None:
        return gamma * a
    if form == "pow_gamma":
        x = gamma * a
        return math.copysign(abs(x) ** beta, x) if x != 0 else 0.0
    return gamma * (math.copysign(abs(a) ** beta, a) if a != 0 else 0.0)


def _post_identity(form_of: Any) -> Any:
    def evaluate(norm: Any, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, str]:
        dv = norm.channels or 5
        a = torch.randn(2, 2, 7, dv, generator=generator, dtype=torch.float64)
        value = norm.post(a)
        gamma = norm.gamma.detach().double().expand(dv).tolist()
        beta = None if norm.beta is None else norm.beta.detach().double().expand(dv).tolist()
        form = form_of(norm)
        flat = a.reshape(-1, dv).tolist()
        target = [
            [_post_closed_form(x, gamma[c], None if beta is None else beta[c], form) for c, x in enumerate(row)]
            for row in flat
        ]
        return value, torch.tensor(target, dtype=torch.float64).reshape(a.shape), f"post_form={form}"

    return evaluate


#: RT001: post-scaling as the runtime's own form states it (at trained-like gamma, beta)
ppsbn_post = _post_identity(lambda norm: norm.post_form)
#: negative control: the default (Algorithm 1) runtime against §3.2's (gamma a)^beta
ppsbn_post_other_form = _post_identity(lambda norm: "pow_gamma")


def ppsbn_pre(norm: Any, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, str]:
    """RT001: pre-scaling with per-token statistics against the row-by-row reference
    (:func:`~kernelattn_maclaurin.naive.pre_sbn_naive`) times :math:`s`."""
    from .naive import pre_sbn_naive

    q = torch.randn(2, 2, 6, 8, generator=generator, dtype=torch.float64) * 1.7 + 0.3
    k = torch.randn(2, 2, 6, 8, generator=generator, dtype=torch.float64)
    got_q, got_k = norm.pre(q, k)
    s = norm.row_scale if norm.row_scale is not None else 8**-0.25
    want = torch.cat([pre_sbn_naive(q, norm.bn_eps), pre_sbn_naive(k, norm.bn_eps)], -1) * s
    return torch.cat([got_q, got_k], -1), want, "row standardisation, unit norm, times s"


def _ppsbn_claims() -> dict[str, tuple[Any, ...]]:
    from kernelattn_core.toolkit import EngineReference, RuntimeIdentity

    return {
        "ppsbn": (
            RuntimeIdentity(
                evaluate=ppsbn_post,
                label="ppSBN post-scaling",
                perturb=0.3,
                options={"post_form": "gamma_pow"},
                grid=({"post_form": "pow_gamma"}, {"post_form": "gamma_only"}, {"channels": 5}),
            ),
            RuntimeIdentity(evaluate=ppsbn_pre, label="ppSBN pre-scaling", options={"row_scale": 0.7}),
            # at gamma = beta = 1 the two printed forms agree; away from 1 they do not, and the
            # check must tell them apart
            RuntimeIdentity(evaluate=ppsbn_post_other_form, label="ppSBN post-scaling", perturb=0.3, expect="fail"),
        ),
        # SchoenbAt through the engine at trained-like gamma, beta, in both printed forms
        "schoenbat": (
            EngineReference(
                perturb=0.3,
                options={"post_form": "pow_gamma", "kernel": "inv"},
                grid=({"post_form": "gamma_pow", "channels": 5, "kernel": "logi"}, {"post_form": None, "power": False}),
            ),
        ),
    }


#: the claims each class of this plugin adds for its options, by registry name
OPTION_CLAIMS: dict[str, tuple[Any, ...]] = _ppsbn_claims()
