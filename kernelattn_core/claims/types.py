"""Claims: what a registered class promises, declared as data.

A class lists its claims in its ``claims`` class attribute; the checkers in
:mod:`kernelattn_core.verify` read them, and ``kernelattn verify`` and the
conformance kit run them. Each claim type has a stable rule ID documented in
``spec/claims.rst``. IDs are never reused: a retired rule keeps its number.

Rule families: ``FM`` feature maps, ``KN`` kernels, ``SP`` sampling
distributions, ``AT`` attention estimators, ``EN`` the engine (what an estimator computes
against the quadratic reference, causality, padding), ``RT`` runtime identities, ``HP``
high-precision identities.

**Option grids.** Every claim with ``options`` may also declare ``grid``, a tuple of
option mappings; the claim is then checked at ``options`` and at ``options | point`` for
each point. ``kernelattn verify --level quick`` (and the conformance kit by default) runs
``options`` and the first point only; ``--level full`` runs every point. A point is
reported as its own result, named by its options.
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
    #: option mappings merged over ``options``, one check each (quick level: the first
    #: point only); see the module docstring
    grid: tuple[Options, ...] = field(default=(), kw_only=True)
    #: which grid point this claim is (0: the declared options), set by
    #: :func:`kernelattn_core.verify.expand`; full level adds its large head dimension
    #: (FM001, FM002) at the declared options only
    point: int = field(default=0, kw_only=True)

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
    setup : callable, optional
        ``(feature_map, generator) -> None``, called on the built float64 map before the
        draws: data-adapted statistics (``fm.fit`` on anisotropic data), a non-symmetric
        matrix, trained parameters. A redraw does not undo it (redraws touch the random
        draws only).
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
    setup: Callable[..., Any] | None = None


@dataclass(frozen=True)
class PositiveFeatures(Claim):
    """FM002: every feature the map returns (:meth:`query` and :meth:`key`, the tensors
    attention uses) is :math:`> 0` and finite, on inputs of large norm and many draws.

    Implied by the ``positive`` flag for maps that compute features directly. On a
    log-space map (``log_space=True``) the claim as stated is vacuous (the engine only
    ever exponentiates the log-features, so :math:`e^{(\\cdot)} > 0` cannot fail); it is
    **deprecated** there since spec 1.1 (see ``spec/plugins.rst``, deprecation policy):
    declared on a log-space map it warns (:class:`~kernelattn_core.claims.spec.ClaimDeprecationWarning`)
    and is checked in its meaningful form, *every log-feature is finite* (no NaN, no
    :math:`\\pm\\infty`: a feature of exactly 0 or an infinite one) over the same inputs
    and draws. Spec 1.0 plugins that declare it keep passing."""

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
    #: ``(feature_map, generator) -> None`` on the built map before the draws (as FM001)
    setup: Callable[..., Any] | None = None


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
    """AT002: the estimator is consistent for softmax attention, at a rate: its bias
    vanishes as ``num_features`` grows, and its mean squared error falls.

    Checked as a **rate**, over at least four budgets :math:`D_1 < \\dots < D_I` (fewer
    declared, as in spec 1.0's ``(4, 64)``, are filled in geometrically), with ``redraws``
    independent estimators per budget on one fixed input (float64):

    * **slope.** The RMS bias :math:`b_D` (its square estimated without the variance of
      the mean, :math:`\\overline{(\\bar y_D - y^\\star)^2} - \\overline{\\mathrm{Var}}/R`,
      standard error by a delete-a-group jackknife) is fitted as
      :math:`\\log b_D = a + s \\log D` over the budgets where it is resolved; the claim
      fails when :math:`s` exceeds :math:`-\\text{order}` by more than the threshold times
      its standard error (a bias that does not fall at the declared rate). Where the bias
      is resolved at fewer than two budgets there is no slope to fit: the result says
      "bias slope not tested" (``slope_tested`` false) and the limit carries the claim.
    * **extrapolated limit.** Per output element, the mean output is fitted as
      :math:`\\bar y_D = L + c\\,D^{-\\text{order}}` (least squares weighted by the Monte
      Carlo variance of each budget's mean) and the limit bias :math:`L - y^\\star`
      (:math:`y^\\star` exact softmax attention) tested, element by element and as the
      mean over the elements, against a Bonferroni threshold (false-failure rate
      :math:`10^{-6}`). A bias that falls faster than :math:`D^{-\\text{order}}` is convex in
      the fit's variable and can only carry :math:`L` across zero, so only a limit on the
      side of the bias left at the largest budget fails: that is what an estimator that
      converges to another limit leaves, however small its variance. The smallest limit
      bias detected with probability 0.95 is printed (``min_detectable_limit_bias``: the
      same shift of every element, caught by the test of the mean or by that of the most
      sensitive element, whichever needs less; ``..._mean``: by the mean's test alone;
      ``..._any_element``: a shift of one element only, the least sensitive one).
    * **error.** The mean squared error falls: the slope of its logarithm in
      :math:`\\log D` is negative and the largest budget at least halves it.
    * **bias at the smallest budget** (``biased_at_finite_budget``): ``True`` says it is
      detectable (self-normalised estimators), ``False`` that it is not, ``None`` states
      nothing (reported only).

    Parameters
    ----------
    order : float
        The declared rate: the bias falls at least as :math:`D^{-\\text{order}}` (``1/2``
        by default; self-normalised ratio estimators have an :math:`O(1/D)` bias
        asymptotically, but PRF-like features are still near :math:`D^{-1/2}` at budgets
        of a few tens).
    independent_rows : bool
        The estimator draws independently for every batch row (per-row sampling such as
        ``ra`` or ``lara``): the ``redraws`` draws of a budget are then the rows of a few
        calls instead of one call per draw. Declare it only when true: draws shared by
        the rows would be counted as independent.
    """

    rule: ClassVar[str] = "AT002"
    summary: ClassVar[str] = "attention is consistent: the bias vanishes at a rate and the error falls"
    biased_at_finite_budget: bool | None = True
    budgets: tuple[int, ...] = (4, 8, 16, 32, 64)
    dim: int = 8
    seq_len: int = 16
    redraws: int = 400
    logit_std: float = 0.5
    options: Options = field(default_factory=dict)
    order: float = 0.5
    independent_rows: bool = False


# --------------------------------------------------------------------------- the engine
@dataclass(frozen=True)
class EngineReference(Claim):
    """EN001: the estimator's outputs **and gradients** (with respect to ``q``, ``k``,
    ``v`` and every trainable parameter of the map and the normaliser), causal and
    non-causal, with and without a key padding mask, equal the quadratic reference
    built from the same features.

    For feature-map attention (:class:`~kernelattn_core.FeatureMapAttention` and every
    subclass, however it overrides ``_attend``) the reference is implied:
    :math:`\\mathrm{post}(\\mathrm{normalize}(A V, A \\mathbf 1))` with
    :math:`A_{ij} = \\phi_q(q_i)^\\top\\phi_k(k_j)` on the allowed pairs
    (:func:`~kernelattn_core.engine.naive.feature_attention_naive`), the features taken
    from the estimator's own map after its ``pre`` and ``prepare``. Other estimators
    declare ``reference``. The engine is run with chunks of ``chunk_size`` positions and
    groups of one chunk (so chunk and group boundaries are crossed at ``seq_len``);
    ``--level full`` adds a longer sequence at the estimator's own chunk length.

    Parameters
    ----------
    reference : callable, optional
        ``(estimator, q, k, v, causal, key_padding_mask) -> out [B, H, N, dv]`` on the
        validated, already scaled ``q`` and ``k`` (what ``_attend`` receives), written
        as a plain quadratic form (the plugin's ``naive.py``).
    modes : tuple of bool
        The ``causal`` values checked (those the class supports).
    perturb : float
        Standard deviation of seeded noise added to every floating parameter before
        the check (trained-like values: a normaliser's :math:`\\gamma, \\beta` away from
        1, a learned map away from its initialisation).
    setup : callable, optional
        ``(estimator, generator) -> None`` before the check (data-adapted statistics).
    rtol : float
        Tolerance on :math:`\\max|a - b| / \\max|b|` per tensor (float64).
    """

    rule: ClassVar[str] = "EN001"
    summary: ClassVar[str] = "outputs and gradients equal the quadratic reference from the same features"
    reference: Callable[..., Any] | None = None
    modes: tuple[bool, ...] = (False, True)
    seq_len: int = 23
    dim: int = 8
    heads: int = 2
    num_features: int = 16
    chunk_size: int = 4
    perturb: float = 0.0
    setup: Callable[..., Any] | None = None
    rtol: float = 1e-8
    options: Options = field(default_factory=dict)


@dataclass(frozen=True)
class PrefixInvariance(Claim):
    """EN002: a causal output at position :math:`t` depends on positions :math:`\\le t`
    only, through the values and through every stabiliser, and so does its gradient.

    For each cut :math:`t`: the queries, keys and values at positions :math:`\\ge t` are
    replaced (by other values, by :math:`10^4`, by NaN); outputs before :math:`t` and the
    gradients of their sum (weighted) must be unchanged and finite, and the gradients
    reaching positions :math:`\\ge t` exactly zero. An estimator that is deterministic in
    eval mode must also give, before :math:`t`, its output on the prefix alone.
    Implied for every estimator (and feature map) that supports ``causal=True``.
    """

    rule: ClassVar[str] = "EN002"
    summary: ClassVar[str] = "causal outputs and gradients depend on earlier positions only"
    seq_len: int = 23
    cuts: tuple[int, ...] = (1, 17)
    dim: int = 8
    heads: int = 2
    num_features: int = 16
    chunk_size: int = 4
    perturb: float = 0.0
    setup: Callable[..., Any] | None = None
    options: Options = field(default_factory=dict)


@dataclass(frozen=True)
class PaddingInvariance(Claim):
    """EN003: padded keys leave the output and every gradient (``IF041``).

    With a key padding mask (padded keys inside and at the end of the sequence), the
    padded keys and values are replaced (by other values, by :math:`10^4`, by NaN):
    outputs and the gradients of the unpadded inputs must be unchanged and finite, and
    the padded positions must get exactly zero gradient. With ``removal`` (and an
    estimator deterministic in eval mode), the output must also equal the call without
    the padded tail keys at all. Checked non-causally and causally (as the class
    supports). Implied for every estimator (and feature map).
    """

    rule: ClassVar[str] = "EN003"
    summary: ClassVar[str] = "padded keys leave outputs and gradients"
    seq_len: int = 19
    dim: int = 8
    heads: int = 2
    num_features: int = 16
    chunk_size: int = 4
    removal: bool = True
    perturb: float = 0.0
    setup: Callable[..., Any] | None = None
    options: Options = field(default_factory=dict)


# --------------------------------------------------------------------------- runtime identities
@dataclass(frozen=True)
class RuntimeIdentity(Claim):
    """RT001: a quantity the runtime object computes equals a closed form written
    apart from it, in float64.

    ``evaluate(obj, generator)`` receives the registered class built with ``options``
    (a feature map built at head dimension ``dim`` with ``num_features``, a normaliser, a
    kernel, an estimator from :func:`~kernelattn_core.create`), in float64, its
    floating parameters perturbed by ``perturb`` (seeded: trained-like values), and
    returns ``(value, target, note)``: what the object computes and the closed form of
    the paper, computed from the object's parameters but not through its code. The check
    passes when :math:`\\max|v - t| \\le \\text{rtol}\\,\\max(|t|_{\\max}, 10^{-300})`.
    Structural promises (tied query and key maps, per-head independence, an
    initialisation equal to a stated estimator, a normaliser's post-transform at
    :math:`\\gamma, \\beta \\ne 1`) are claims of this kind.
    """

    rule: ClassVar[str] = "RT001"
    summary: ClassVar[str] = "the runtime object equals a closed form written apart from it"
    evaluate: Callable[..., Any] | None = None
    label: str = ""
    dim: int = 8
    num_features: int = 16
    perturb: float = 0.0
    rtol: float = 1e-10
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
