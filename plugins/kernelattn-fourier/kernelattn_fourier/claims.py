"""Module-level callables used by the claims of this plugin (FM003, FM005).

SymPy is imported lazily: it is slow to import and only the checkers need it.

Variance of the trigonometric estimators (derivation)
----------------------------------------------------
For one frequency :math:`\\omega \\sim p` and :math:`\\delta = x - y`, the two features
:math:`[\\cos, \\sin]` give :math:`\\hat K_1 = \\cos(\\omega^\\top\\delta)`, so with
:math:`\\cos^2 a = (1 + \\cos 2a)/2`,

.. math:: \\mathrm{Var}[\\hat K_1] = \\mathbb{E}[\\cos^2(\\omega^\\top\\delta)] - g(\\delta)^2
          = \\frac{1 + g(2\\delta)}{2} - g(\\delta)^2 .

For the Gaussian kernel :math:`g(2\\delta) = g(\\delta)^4`, hence
:math:`\\mathrm{Var}[\\hat K_1] = \\tfrac12 (1 - K^2)^2` with :math:`K = g(\\delta)`. The map
with :math:`m` i.i.d. frequencies averages :math:`m` such terms:
:math:`\\mathrm{Var} = (1 - K^2)^2 / (2m)`; the issue's formula is the :math:`m = 1` case.

The offset map gives :math:`\\hat K_1 = 2\\cos(a + b)\\cos(c + b) = \\cos(a - c) + \\cos(a + c + 2b)`
with :math:`a = \\omega^\\top x`, :math:`c = \\omega^\\top y`; given :math:`\\omega` the second
term has mean 0 and second moment 1/2 over :math:`b \\sim U(0, 2\\pi)`, and it is
uncorrelated with the first, so :math:`\\mathrm{Var}[\\hat K_1] = \\tfrac12(1 - K^2)^2 + \\tfrac12`:
larger by :math:`1/(2m)` at equal :math:`m`, and larger at equal feature dimension
:math:`D` too (:math:`\\tfrac{(1-K^2)^2}{D}` against :math:`\\tfrac{(1-K^2)^2 + 1}{D}`).
"""

from __future__ import annotations

from typing import Any

import torch


def _gaussian_density_1d(w: Any, ell: Any) -> Any:
    import sympy as sp

    return ell / sp.sqrt(2 * sp.pi) * sp.exp(-(ell**2) * w**2 / 2)


def derive_gaussian_cos_expectation() -> tuple[Any, Any, str]:
    """FM005 for ``rff`` (Gaussian): :math:`\\mathbb{E}[\\cos(\\omega^\\top\\delta)]` for
    :math:`\\omega \\sim \\mathcal{N}(0, \\ell^{-2} I_2)`, by SymPy integration in
    :math:`d = 2` (:math:`\\cos(a + b) = \\cos a\\cos b - \\sin a \\sin b` and independent
    coordinates; each factor integrated over :math:`\\mathbb{R}`)."""
    import sympy as sp

    w = sp.Symbol("w", real=True)
    ell = sp.Symbol("ell", positive=True)
    t1, t2 = sp.symbols("t1 t2", real=True)
    p = _gaussian_density_1d(w, ell)

    def e(expr: Any) -> Any:
        return sp.integrate(expr * p, (w, -sp.oo, sp.oo))

    expectation = e(sp.cos(w * t1)) * e(sp.cos(w * t2)) - e(sp.sin(w * t1)) * e(sp.sin(w * t2))
    target = sp.exp(-(t1**2 + t2**2) / (2 * ell**2))
    note = "E[cos(w1 t1 + w2 t2)], w ~ N(0, I/ell^2), by sympy.integrate of each coordinate over R"
    return sp.simplify(expectation), target, note


def derive_trig_softmax_expectation() -> tuple[Any, Any, str]:
    """FM005 for ``trig-softmax-features`` (d = 1):
    :math:`\\mathbb{E}[e^{x^2/2} e^{y^2/2}(\\sin\\omega x \\sin\\omega y + \\cos\\omega x\\cos\\omega y)] = e^{xy}`."""
    import sympy as sp

    w = sp.Symbol("w", real=True)
    x, y = sp.symbols("x y", real=True)
    p = _gaussian_density_1d(w, sp.Integer(1))
    s = sp.Symbol("s", real=True)
    feat = sp.sin(w * x) * sp.sin(w * y) + sp.cos(w * x) * sp.cos(w * y)
    # the product of the two feature vectors collapses to cos(w (x - y)); SymPy checks the
    # identity, then integrates in the difference s = x - y (integrating the products
    # directly in two free symbols does not finish in reasonable time)
    if sp.simplify(sp.expand_trig(feat - sp.cos(w * (x - y)))) != 0:  # pragma: no cover - identity
        raise AssertionError("sin sin + cos cos != cos of the difference")
    e_cos = sp.integrate(sp.cos(w * s) * p, (w, -sp.oo, sp.oo)).subs(s, x - y)
    expectation = sp.exp(x**2 / 2 + y**2 / 2) * e_cos
    note = "E[exp(x^2/2 + y^2/2)(sin wx sin wy + cos wx cos wy)] = e^{(x^2+y^2)/2} E[cos w(x-y)], w ~ N(0, 1)"
    return sp.simplify(expectation), sp.exp(x * y), note


def derive_gaussian_variance() -> tuple[Any, Any, str]:
    """:math:`\\mathrm{Var}[\\cos(\\omega t)] = \\mathbb{E}[\\cos^2] - \\mathbb{E}[\\cos]^2` for
    :math:`\\omega \\sim \\mathcal{N}(0, \\ell^{-2})`, by SymPy integration, against the
    closed form :math:`\\tfrac12 (1 - K^2)^2`, :math:`K = e^{-t^2/2\\ell^2}` (the FM003 formula
    per frequency; in 1-D since the variance depends on :math:`\\delta` only through
    :math:`K`)."""
    import sympy as sp

    w = sp.Symbol("w", real=True)
    ell = sp.Symbol("ell", positive=True)
    t = sp.Symbol("t", real=True)
    p = _gaussian_density_1d(w, ell)
    second = sp.integrate(sp.cos(w * t) ** 2 * p, (w, -sp.oo, sp.oo))
    first = sp.integrate(sp.cos(w * t) * p, (w, -sp.oo, sp.oo))
    k = sp.exp(-(t**2) / (2 * ell**2))
    return sp.simplify(second - first**2), sp.Rational(1, 2) * (1 - k**2) ** 2, "Var[cos(w t)], w ~ N(0, 1/ell^2)"


# --------------------------------------------------------------------------- FM003 closed forms
def per_frequency_variance(g_delta: torch.Tensor, g_2delta: torch.Tensor, variant: str = "cos-sin") -> torch.Tensor:
    """:math:`\\mathrm{Var}[\\hat K_1]` for one frequency: :math:`(1 + g(2\\delta))/2 - g(\\delta)^2`,
    plus :math:`1/2` for the offset map."""
    var = 0.5 * (1.0 + g_2delta) - g_delta**2
    return var + 0.5 if variant == "offset" else var


def rff_variance(x: torch.Tensor, y: torch.Tensor, feature_map: Any) -> torch.Tensor:
    """FM003 closed form for ``rff`` with i.i.d. frequencies: ``[pairs]`` variances of
    :math:`\\phi(x_i)^\\top\\phi(y_i)` for ``x, y [pairs, d]``."""
    if feature_map.orthogonal:
        raise ValueError("rff_variance: the closed form holds for i.i.d. frequencies (orthogonal=False)")
    kern = feature_map.target_kernel()
    delta = x - y  # [pairs, d]
    var = per_frequency_variance(kern.g(delta), kern.g(2 * delta), feature_map.variant)
    return var / feature_map.num_features


def trig_softmax_variance(x: torch.Tensor, y: torch.Tensor, feature_map: Any) -> torch.Tensor:
    """FM003 closed form for ``trig-softmax-features``:
    :math:`e^{\\|x\\|^2 + \\|y\\|^2} (1 - K^2)^2 / (2m)`, :math:`K = e^{-\\|x - y\\|^2/2}`."""
    k = torch.exp(-0.5 * ((x - y) ** 2).sum(-1))  # [pairs]
    scale = torch.exp((x * x).sum(-1) + (y * y).sum(-1))
    return scale * 0.5 * (1 - k**2) ** 2 / feature_map.num_features


# --------------------------------------------------------------------------- KN004 closed forms
def gaussian_closed_form(x: list[Any], y: list[Any]) -> Any:
    """KN004: :math:`\\exp(-\\|x - y\\|^2 / 2)` (lengthscale 1), from Rahimi & Recht (2007)."""
    import mpmath as mp

    return mp.exp(-sum((a - b) ** 2 for a, b in zip(x, y)) / 2)


def gaussian_closed_form_l07(x: list[Any], y: list[Any]) -> Any:
    """KN004: :math:`\\exp(-\\|x - y\\|^2 / (2 \\cdot 0.7^2))`."""
    import mpmath as mp

    return mp.exp(-sum((a - b) ** 2 for a, b in zip(x, y)) / (2 * mp.mpf("0.7") ** 2))


def gaussian_density_swapped_l07(omega: list[Any]) -> Any:
    """KN005 negative control: :math:`\\mathcal N(0, \\ell^2)` at :math:`\\ell = 0.7`, the density
    with the lengthscale where its inverse belongs (the Gaussian kernel of lengthscale
    :math:`\\ell` has :math:`p = \\mathcal N(0, \\ell^{-2})`)."""
    import mpmath as mp

    var = mp.mpf("0.7") ** 2
    return (2 * mp.pi * var) ** (-mp.mpf(len(omega)) / 2) * mp.exp(-sum(w * w for w in omega) / (2 * var))


def laplacian_closed_form(x: list[Any], y: list[Any]) -> Any:
    """KN004: :math:`\\exp(-\\|x - y\\|_1)` (lengthscale 1), the product Laplacian."""
    import mpmath as mp

    return mp.exp(-sum(abs(a - b) for a, b in zip(x, y)))


def matern32_closed_form(x: list[Any], y: list[Any]) -> Any:
    """KN004: Matérn 3/2, :math:`(1 + \\sqrt3 r) e^{-\\sqrt3 r}` (lengthscale 1)."""
    import mpmath as mp

    r = mp.sqrt(sum((a - b) ** 2 for a, b in zip(x, y)))
    return (1 + mp.sqrt(3) * r) * mp.exp(-mp.sqrt(3) * r)


def matern52_closed_form(x: list[Any], y: list[Any]) -> Any:
    """KN004: Matérn 5/2, :math:`(1 + \\sqrt5 r + 5r^2/3) e^{-\\sqrt5 r}` (lengthscale 1)."""
    import mpmath as mp

    r = mp.sqrt(sum((a - b) ** 2 for a, b in zip(x, y)))
    return (1 + mp.sqrt(5) * r + 5 * r * r / 3) * mp.exp(-mp.sqrt(5) * r)


# --------------------------------------------------------------------------- option coverage (spec 1.1)
def rfa_gate_reference(
    est: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, key_padding_mask: torch.Tensor | None
) -> torch.Tensor:
    """EN001 reference of ``rfa-gate``: the recurrence one position at a time
    (:func:`~kernelattn_fourier.gate.gated_sums_naive`) on the estimator's own features and
    gate, padded keys zeroed first as the estimator does, then its normaliser."""
    from .gate import gated_sums_naive

    if key_padding_mask is not None:
        k = k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    q, k = est.normalizer.pre(q, k, key_padding_mask=key_padding_mask)
    fm = est.feature_map
    phi_q, phi_k = fm.query(q), fm.key(k)
    num, den = gated_sums_naive(phi_q, phi_k, v, est.gate(k), key_padding_mask=key_padding_mask)
    return est.normalizer.post(est.normalizer.normalize(num, den)).to(v.dtype)


def _claims() -> dict[str, tuple[Any, ...]]:
    from kernelattn_core.toolkit import EngineReference, UnbiasedKernelEstimate

    sampler = {"dims": (16,), "norm_range": (0.2, 2.0), "num_features": 16}
    return {
        # every spectral family's sampler, and a lengthscale other than 1
        "rff": (
            UnbiasedKernelEstimate(
                **sampler,
                options={"kernel": "laplacian"},
                grid=(
                    {"kernel": "matern", "nu": 1.5},
                    {"kernel": "matern", "nu": 2.5},
                    {"kernel": "gaussian", "lengthscale": 0.7},
                    {"kernel": "laplacian", "lengthscale": 1.6},
                    {"kernel": "matern", "nu": 1.5, "orthogonal": True},
                ),
            ),
        ),
        "trig-softmax-features": (
            UnbiasedKernelEstimate(dims=(16,), norm_range=(0.2, 1.0), num_features=16, options={"orthogonal": True}),
        ),
        # learned per-head scales at trained-like values: outputs and gradients of the engine
        "rfa-features": (
            EngineReference(
                perturb=0.3,
                options={"num_heads": 2, "init_scale": 0.7},
                grid=({"learn_scale": False, "init_scale": 1.4}, {"orthogonal": True}),
            ),
        ),
        "trig-softmax": (EngineReference(options={"orthogonal": True}, grid=({"normalizer": "row"},)),),
        "rfa": (
            EngineReference(
                perturb=0.3,
                options={"num_heads": 2, "init_scale": 0.7},
                grid=({"learn_scale": False, "orthogonal": True},),
            ),
        ),
        "rfa-gate": (
            EngineReference(
                reference=rfa_gate_reference,
                modes=(True,),
                perturb=0.3,
                options={"num_heads": 2, "init_gate_bias": 0.5},
                grid=({"init_gate_bias": -1.0, "learn_scale": False},),
            ),
        ),
    }


#: the claims each class of this plugin adds for its options, by registry name
OPTION_CLAIMS: dict[str, tuple[Any, ...]] = _claims()
