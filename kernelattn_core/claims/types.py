"""Claims: what a registered class promises, declared as data.

A class lists its claims in its ``claims`` class attribute; the checkers in
:mod:`kernelattn_core.verify` read them, and ``kernelattn verify`` and the
conformance kit run them. Each claim type has a stable rule ID documented in
``spec/claims.rst``. IDs are never reused: a retired rule keeps its number.

Rule families: ``FM`` feature maps, ``KN`` kernels, ``SP`` sampling
distributions, ``AT`` attention estimators, ``HP`` high-precision identities.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

Options = Mapping[str, Any]


@dataclass(frozen=True)
class Claim:
    """Base of every claim; ``rule`` is the stable ID, ``summary`` one line of prose.

    ``expect="fail"`` declares a negative control: the class is known *not* to satisfy
    the claim (for example biased randomized attention against the unbiasedness test),
    and the check passes only when the checker rejects it. ``kernelattn verify`` lists
    these rows as "negative control, must fail", so every checker is seen failing.
    """

    rule: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    expect: str = field(default="pass", kw_only=True)

    def describe(self) -> str:
        return self.summary


# --------------------------------------------------------------------------- feature maps
@dataclass(frozen=True)
class UnbiasedKernelEstimate(Claim):
    """FM001: :math:`\\mathbb{E}[\\phi_q(x)^\\top \\phi_k(y)] = K(x, y)` on the declared domain.

    Checked by Monte Carlo in float64: ``redraws`` independent draws (fixed seeds) of a
    map with ``num_features`` features, at each head dimension in ``dims``, on
    ``pairs`` point pairs with norms in ``norm_range`` (the scaled coordinates the
    map sees); every pair's z-score must stay below a threshold whose false-failure
    rate over all pairs is below 1e-6 (Bonferroni over pairs).

    Parameters
    ----------
    dims : tuple of int
        Head dimensions to test.
    norm_range : (float, float)
        Range of input norms :math:`|x|, |y|`.
    num_features : int
    options : mapping
        Constructor options of the map (beside ``head_dim`` and ``num_features``).
    inputs : callable, optional
        ``(d, pairs, generator) -> (x, y)`` float64 tensors ``[pairs, d]`` on the
        domain, replacing the default sampler (unit directions scaled into ``norm_range``).
    """

    rule: ClassVar[str] = "FM001"
    summary: ClassVar[str] = "unbiased kernel estimate E[phi_q(x).phi_k(y)] = K(x, y)"
    dims: tuple[int, ...] = (16, 64)
    norm_range: tuple[float, float] = (0.2, 1.0)
    num_features: int = 128
    pairs: int = 8
    redraws: int = 2000
    options: Options = field(default_factory=dict)
    inputs: Callable[..., Any] | None = None


@dataclass(frozen=True)
class PositiveFeatures(Claim):
    """FM002: every feature the map returns (:meth:`query` and :meth:`key`, the tensors
    attention uses) is :math:`> 0` and finite, on inputs of large norm and many draws.

    Implied by the ``positive`` flag for maps that compute features directly. A
    log-space map (``log_space=True``) is positive by construction (the engine only
    ever exponentiates its log-features), so the claim cannot fail there and the
    checker refuses it: the ``positive`` flag of a log-space map is justified by
    ``log_space`` alone."""

    rule: ClassVar[str] = "FM002"
    summary: ClassVar[str] = "features are positive"
    dims: tuple[int, ...] = (16,)
    max_norm: float = 4.0
    redraws: int = 20
    options: Options = field(default_factory=dict)


@dataclass(frozen=True)
class EstimateVariance(Claim):
    """FM003: the variance of the single-pair estimate equals a closed form.

    ``variance(x, y, feature_map)`` returns :math:`\\mathrm{Var}[\\phi_q(x)^\\top\\phi_k(y)]`
    for ``x, y [pairs, d]`` (float64) and the built map (its ``num_features``). Checked
    against the sample variance over ``redraws`` draws with a bound from the
    standard error of a sample variance (fourth moments estimated from the data).
    """

    rule: ClassVar[str] = "FM003"
    summary: ClassVar[str] = "single-pair variance equals the closed form"
    variance: Callable[..., Any] | None = None
    dims: tuple[int, ...] = (16,)
    norm_range: tuple[float, float] = (0.2, 1.0)
    num_features: int = 4
    pairs: int = 6
    redraws: int = 20000
    options: Options = field(default_factory=dict)
    inputs: Callable[..., Any] | None = None


@dataclass(frozen=True)
class ErrorDecay(Claim):
    """FM004: kernel mean squared error falls as :math:`D^{\\text{slope}}` with the
    feature count ``D`` (slope :math:`-1` for Monte Carlo features); the fitted log-log
    slope must lie within ``tolerance`` of ``slope``."""

    rule: ClassVar[str] = "FM004"
    summary: ClassVar[str] = "kernel MSE falls as D^slope"
    slope: float = -1.0
    tolerance: float = 0.2
    budgets: tuple[int, ...] = (8, 32, 128, 512)
    dim: int = 16
    norm_range: tuple[float, float] = (0.2, 1.0)
    redraws: int = 200
    options: Options = field(default_factory=dict)


@dataclass(frozen=True)
class SymbolicExpectation(Claim):
    """FM005: the expectation of the single-feature estimator, computed symbolically,
    simplifies to the kernel.

    ``derive()`` returns ``(expectation, target, note)``: two SymPy expressions (the
    expectation computed symbolically from the estimator's form, and the kernel's
    closed form) and a line saying how the expectation was taken. The checker
    verifies that ``simplify(expectation - target) == 0``.

    A ``derive`` with a ``feature_map`` parameter receives the map built as the
    registered class builds it (``head_dim=dim``, ``num_features``, ``options``), so the
    derivation reads the runtime object (its weights, coefficients, sampling law)
    instead of restating the formula it checks.
    """

    rule: ClassVar[str] = "FM005"
    summary: ClassVar[str] = "symbolic expectation of the estimator equals the kernel"
    derive: Callable[..., tuple[Any, Any, str]] | None = None
    dim: int = 4
    num_features: int = 16
    options: Options = field(default_factory=dict)


# --------------------------------------------------------------------------- kernels
@dataclass(frozen=True)
class MaclaurinCoefficients(Claim):
    """KN001: ``coefficient(n)`` equals the Taylor coefficient of ``sympy_expr`` at 0,
    exactly (rationals), for :math:`n \\le` ``order``.

    ``coefficients`` (``n -> a_n``, optional) replaces the kernel's ``coefficient`` by a
    declared table, for a negative control such as a coefficient formula as a paper
    prints it (``label`` names it); ``None`` checks the runtime kernel."""

    rule: ClassVar[str] = "KN001"
    summary: ClassVar[str] = "Maclaurin coefficients equal SymPy's series exactly"
    order: int = 24
    options: Options = field(default_factory=dict)
    coefficients: Callable[[int], Any] | None = None
    label: str = ""


@dataclass(frozen=True)
class NonNegativeCoefficients(Claim):
    """KN002: :math:`a_n \\ge 0` for :math:`n \\le` ``order`` (Schoenberg: a positive-definite
    dot-product kernel on every sphere), and the coefficients the runtime uses agree with
    ``coefficient(n)``: a kernel with ``log_coefficients(n_max)`` (the log-space table
    random Maclaurin weights are built from, which cannot encode a sign) must give
    :math:`\\log a_n` to 12 digits, :math:`-\\infty` exactly where :math:`a_n = 0`."""

    rule: ClassVar[str] = "KN002"
    summary: ClassVar[str] = "Maclaurin coefficients are non-negative"
    order: int = 24
    options: Options = field(default_factory=dict)
    #: a declared table ``n -> a_n`` checked instead of the kernel's (negative controls;
    #: the runtime log-table comparison is then skipped: the table is not the runtime's)
    coefficients: Callable[[int], Any] | None = None
    label: str = ""


@dataclass(frozen=True)
class KernelMatchesExpression(Claim):
    """KN003: the torch kernel equals its SymPy expression evaluated at 30 digits
    (mpmath) on sample points, to ``digits`` significant digits in float64.

    ``expression`` (``t -> sympy.Expr``, optional) replaces ``sympy_expr`` by a declared
    function, for a negative control (``label`` names it); ``None`` checks the kernel's own."""

    rule: ClassVar[str] = "KN003"
    summary: ClassVar[str] = "torch kernel equals its symbolic expression"
    digits: int = 12
    options: Options = field(default_factory=dict)
    expression: Callable[[Any], Any] | None = None
    label: str = ""


@dataclass(frozen=True)
class KernelClosedForm(Claim):
    """KN004: the torch kernel :math:`K(x, y)` equals a closed form evaluated in mpmath
    at 30 digits, on ``points`` random pairs per dimension in ``dims``, to ``digits``
    significant digits (float64). For kernels that are not dot-product kernels
    (shift-invariant or general), the counterpart of KN003.

    ``expression(x, y)`` takes two lists of mpf and returns :math:`K(x, y)` as an mpf;
    it must be written from the paper's formula, independently of the torch code.
    ``inputs`` optionally replaces the default sampler (as in FM001).
    """

    rule: ClassVar[str] = "KN004"
    summary: ClassVar[str] = "torch kernel equals its closed form (mpmath, 30 digits)"
    expression: Callable[[list[Any], list[Any]], Any] | None = None
    dims: tuple[int, ...] = (1, 3)
    points: int = 6
    norm_range: tuple[float, float] = (0.2, 1.5)
    digits: int = 11
    options: Options = field(default_factory=dict)
    inputs: Callable[..., Any] | None = None


@dataclass(frozen=True)
class SpectralDensityIntegral(Claim):
    """KN005: a shift-invariant kernel equals the Fourier transform of its declared
    spectral density (Bochner): in one dimension

    .. math:: g(\\delta) = \\int_{-\\infty}^{\\infty} p(\\omega) \\cos(\\omega\\delta)\\, d\\omega
              = 2 \\int_0^\\infty p(\\omega) \\cos(\\omega\\delta)\\, d\\omega ,

    with :math:`p` the kernel's ``spectral_density_mp`` (the density the maps sample
    from) integrated by mpmath at ``dps`` digits, against the torch kernel on 1-D
    inputs at the offsets ``deltas``, to ``digits`` significant digits.

    ``density`` (``[omega] -> mpf``, optional) replaces ``spectral_density_mp`` by a
    declared density, for a negative control (``label`` names it).
    """

    rule: ClassVar[str] = "KN005"
    summary: ClassVar[str] = "kernel equals the Fourier transform of its spectral density"
    deltas: tuple[float, ...] = (0.0, 0.6, 1.7)
    dps: int = 20
    digits: int = 10
    options: Options = field(default_factory=dict)
    density: Callable[[list[Any]], Any] | None = None
    label: str = ""


@dataclass(frozen=True)
class PositiveDefinite(Claim):
    """KN006: the Gram matrix :math:`[K(x_i, x_j)]` on random point sets is symmetric
    and positive semi-definite: the smallest eigenvalue is above
    :math:`-10^{-10} \\lambda_{\\max}` (float64), on ``sets`` sets of ``size`` points per
    dimension in ``dims``, norms in ``norm_range`` (a dot-product kernel of finite
    radius :math:`R_f` uses norms up to :math:`0.9 \\sqrt{R_f}`).

    ``subject`` (``() -> Kernel``, optional) builds the kernel checked instead of the
    registered class with ``options``: a negative control's kernel that the class
    refuses to be (``label`` names it).
    """

    rule: ClassVar[str] = "KN006"
    summary: ClassVar[str] = "Gram matrices on random point sets are positive semi-definite"
    dims: tuple[int, ...] = (2, 8)
    size: int = 24
    sets: int = 4
    norm_range: tuple[float, float] = (0.1, 1.0)
    options: Options = field(default_factory=dict)
    subject: Callable[[], Any] | None = None
    label: str = ""


# --------------------------------------------------------------------------- sampling distributions
@dataclass(frozen=True)
class PmfSumsToOne(Claim):
    """SP001: a probability mass function used for sampling sums to one exactly.

    ``pmf(n)`` is a SymPy expression in the integer symbol ``n`` (free parameters,
    such as ``p``, stay symbolic with the declared ``assumptions``); the checker sums
    it over ``n >= start`` (and ``n <= stop`` when given) and simplifies the result.

    The declared ``pmf`` must be written independently of the runtime (its
    normaliser in closed form, never the symbolic sum that is checked). ``runtime()``
    returns ``(law, values)``: the object the class really samples from and the
    numeric values of the free symbols for it. ``law.pmf(n)`` must match the declared
    pmf at ``values`` to 12 digits for the first 40 support points and, when the law
    has ``sample(u)`` (inversion of uniforms), the frequencies of ``draws`` samples
    must pass a chi-square test against the pmf (false-failure rate 1e-6).
    """

    rule: ClassVar[str] = "SP001"
    summary: ClassVar[str] = "sampling pmf sums to one"
    pmf: Callable[[Any], Any] | None = None
    start: int = 0
    stop: int | None = None
    label: str = "pmf"
    runtime: Callable[[], tuple[Any, Mapping[str, float]]] | None = None
    draws: int = 200_000


# --------------------------------------------------------------------------- estimators
@dataclass(frozen=True)
class UnbiasedAttention(Claim):
    """AT001: the attention output is an unbiased estimate of exact softmax attention
    (randomized attention); Monte Carlo z-test in float64 over ``redraws`` draws.

    ``mode`` is the module mode the estimator runs in (``"train"`` or ``"eval"``):
    unbiasedness is a property of a mode, since an estimator may draw differently in
    evaluation (``ra`` drops its Gaussian noise there unless ``eval_noise=True``), and
    a class flagged ``unbiased`` lists the modes where it holds in ``unbiased_modes``
    (``("train", "eval")`` when absent).
    """

    rule: ClassVar[str] = "AT001"
    summary: ClassVar[str] = "attention output is unbiased for softmax attention"
    dim: int = 4
    seq_len: int = 6
    num_features: int = 1
    redraws: int = 4000
    logit_std: float = 0.5
    mode: str = "train"
    options: Options = field(default_factory=dict)


@dataclass(frozen=True)
class ConsistentAttention(Claim):
    """AT002: error against exact softmax attention (and the bias, when
    ``biased_at_finite_budget``) shrinks as ``num_features`` grows.

    Self-normalised estimators are biased at finite budget: the claim says so with
    ``biased_at_finite_budget=True``, and the verdict then also requires the bias at
    the smallest budget to be detectably non-zero (:math:`|z|` above the threshold);
    with ``biased_at_finite_budget=False`` it requires the bias *not* to be detected;
    ``None`` makes no statement on the bias at the smallest budget (reported only: for
    estimators whose bias is real but below what ``redraws`` draws resolve).
    """

    rule: ClassVar[str] = "AT002"
    summary: ClassVar[str] = "attention error and bias shrink as the budget grows"
    biased_at_finite_budget: bool | None = True
    budgets: tuple[int, ...] = (4, 64)
    dim: int = 8
    seq_len: int = 16
    redraws: int = 400
    logit_std: float = 0.5
    options: Options = field(default_factory=dict)


# --------------------------------------------------------------------------- high precision
@dataclass(frozen=True)
class QuadratureIdentity(Claim):
    """HP001: an identity without a SymPy closed form holds to ``digits`` digits.

    ``evaluate(dps)`` computes ``(value, target, note)`` as mpmath numbers at ``dps``
    decimal digits (typically by quadrature in one or two dimensions).
    """

    rule: ClassVar[str] = "HP001"
    summary: ClassVar[str] = "high-precision identity"
    evaluate: Callable[[int], tuple[Any, Any, str]] | None = None
    label: str = ""
    dps: int = 40
    digits: int = 25
