"""Random Maclaurin features (Kar & Karnick, 2012), as used by SchoenbAt / Macformer.

For a dot-product kernel :math:`f(t) = \\sum_n a_n t^n` with :math:`a_n \\ge 0`, each
random feature draws a degree :math:`N \\sim P` and :math:`N` projections
:math:`\\omega_1, \\dots, \\omega_N` with :math:`\\mathbb{E}[\\omega\\omega^\\top] = I`, and

.. math:: \\phi(x) = \\sqrt{\\frac{a_N}{P[N]}} \\prod_{j=1}^{N} \\langle \\omega_j, x \\rangle,
          \\qquad \\mathbb{E}[\\phi(x)\\phi(y)] = \\sum_n P[n] \\frac{a_n}{P[n]}
          \\langle x, y\\rangle^n = f(\\langle x, y \\rangle).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from kernelattn_core import FeatureMap
from kernelattn_core.toolkit import (
    DomainError,
    ErrorDecay,
    EstimateVariance,
    InputError,
    PmfSumsToOne,
    SymbolicExpectation,
    UnbiasedKernelEstimate,
)

from . import claims as _claims
from .fast import degree_products
from .kernels import MaclaurinKernel, resolve_kernel
from .sampling import DegreeDistribution
from .variance import max_pair_values, rmf_variance, warn_infinite_variance

MODES = ("paper", "released")
PROJECTIONS = ("rademacher", "gaussian")
RELEASED_MAX_DEGREE = 20


def degree_distribution(p: float, mode: str, max_degree: int | None) -> DegreeDistribution:
    """The degree law of a mode: paper :math:`\\{0, 1, \\dots\\}` (capped at ``max_degree`` when
    given), released :math:`\\{1, \\dots, \\text{max\\_degree}\\}` (20 by default)."""
    if mode == "paper":
        return DegreeDistribution(p, 0, max_degree)
    if mode == "released":
        return DegreeDistribution(p, 1, RELEASED_MAX_DEGREE if max_degree is None else max_degree)
    raise InputError(f"mode: expected one of {list(MODES)}, got {mode!r}")


def random_feature_count(mode: str, num_features: int) -> int:
    """Number of random features :math:`R`: ``D`` in paper mode, ``D - 1`` in released mode."""
    return num_features - 1 if mode == "released" else num_features


# --------------------------------------------------------------------------- claim callables
def _pmf_paper(n: Any) -> Any:
    import sympy

    q = sympy.Symbol("q", positive=True)  # p = 1 + q > 1
    return DegreeDistribution(2.0, 0, None).sympy_pmf(n, 1 + q)


def _pmf_released(n: Any) -> Any:
    import sympy

    q = sympy.Symbol("q", positive=True)
    return DegreeDistribution(2.0, 1, RELEASED_MAX_DEGREE).sympy_pmf(n, 1 + q)


def derive_expectation(kernel: str = "exp", d: int = 2) -> tuple[Any, Any, str]:
    """FM005: :math:`\\mathbb{E}[\\phi(x)\\phi(y)]` in closed form, and the kernel.

    The expectation over the projections is taken by exact enumeration of the
    :math:`2^d` Rademacher sign vectors with symbolic :math:`x, y \\in \\mathbb{R}^d`
    (one factor; the :math:`N` factors are independent, so degree :math:`n` gives its
    :math:`n`-th power), and the expectation over the degree is a symbolic sum over
    the pmf :math:`(p-1)p^{-(n+1)}` with symbolic :math:`p = 1 + q > 1`, weighted by
    :math:`a_n / P[n]`. Returns ``(expectation, f(<x, y>), note)``; for radius-one
    kernels the convergent branch :math:`|\\langle x, y\\rangle| < 1` of SymPy's
    piecewise sum is taken.
    """
    import itertools

    import sympy

    xs = sympy.symbols(f"x1:{d + 1}", real=True)
    ys = sympy.symbols(f"y1:{d + 1}", real=True)
    one = sympy.Integer(0)
    signs = list(itertools.product((-1, 1), repeat=d))
    for w in signs:  # E_w[<w,x><w,y>] by enumeration
        one += sum(wi * xi for wi, xi in zip(w, xs)) * sum(wi * yi for wi, yi in zip(w, ys))
    one = sympy.expand(one / len(signs))
    n = sympy.Symbol("n", integer=True, nonnegative=True)
    q = sympy.Symbol("q", positive=True)
    p = 1 + q
    pmf = DegreeDistribution(2.0, 0, None).sympy_pmf(n, p)
    a_n = _sympy_coefficient(kernel, n)
    s = sympy.Symbol("s")  # stands for E_w[<w,x><w,y>]
    summand = sympy.simplify(pmf * (a_n / pmf) * s**n)
    expectation = sympy.Sum(summand, (n, 0, sympy.oo)).doit()
    if kernel in ("logi", "sqrt"):  # a_0 handled apart: the closed forms below start at n = 1
        expectation = 1 + sympy.Sum(summand, (n, 1, sympy.oo)).doit()
    expectation = sympy.piecewise_fold(expectation)
    if isinstance(expectation, sympy.Piecewise):
        expectation = expectation.args[0][0]  # the convergent branch
    k = resolve_kernel(kernel)
    tsym = sympy.Symbol("t")
    target = k.sympy_expr(tsym).subs(tsym, one)
    note = (
        f"E over 2^{d} Rademacher sign vectors (exact) gives E[<w,x><w,y>] = {one}; "
        f"E over N ~ (p-1)/p^(n+1), p = 1 + q symbolic, of (a_N/P[N]) s^N summed symbolically"
    )
    return sympy.simplify(expectation.subs(s, one)), target, note


def _sympy_coefficient(kernel: str, n: Any) -> Any:
    import sympy

    if kernel in ("exp", "trigh"):
        return 1 / sympy.factorial(n)
    if kernel == "inv":
        return sympy.Integer(1)
    if kernel == "logi":
        return 1 / n  # n >= 1; a_0 = 1 added apart
    if kernel == "sqrt":
        return sympy.binomial(2 * n, n) / ((2 * n - 1) * 4**n)  # n >= 1; a_0 = 1 added apart
    raise InputError(f"kernel: no symbolic coefficient formula for {kernel!r}")


def variance_for_claim(x: torch.Tensor, y: torch.Tensor, feature_map: RandomMaclaurinFeatures) -> torch.Tensor:
    """FM003: the closed-form variance of the built map's single-pair estimate."""
    return feature_map.variance(x, y)


def _small_inputs(d: int, pairs: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs with norms in [0.2, 0.55]: inside the domain and with finite variance at p = 2
    for the radius-one kernels (m <= 3 |x|^2 |y|^2 < 1/2)."""
    x = torch.randn(pairs, d, generator=generator, dtype=torch.float64)
    y = torch.randn(pairs, d, generator=generator, dtype=torch.float64)
    rx = 0.2 + 0.35 * torch.rand(pairs, 1, generator=generator, dtype=torch.float64)
    ry = 0.2 + 0.35 * torch.rand(pairs, 1, generator=generator, dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True) * rx, y / y.norm(dim=-1, keepdim=True) * ry


class RandomMaclaurinFeatures(FeatureMap):
    """Random Maclaurin features (RMF) for a dot-product kernel.

    .. math::
        \\Phi(x) = \\frac{1}{\\sqrt{R}} \\Big[ \\sqrt{\\tfrac{a_{N_i}}{P[N_i]}}
        \\prod_{j=1}^{N_i} \\langle \\omega_{ij}, x\\rangle \\Big]_{i=1}^{R},
        \\qquad P[N = n] = (p-1)\\,p^{-(n+1)},

    with independent degrees :math:`N_i` and projections :math:`\\omega_{ij}`
    (Rademacher :math:`\\{\\pm 1\\}^d` or standard Gaussian), the **same draws** for
    queries and keys, so :math:`\\mathbb{E}[\\Phi(x)^\\top\\Phi(y)] = f(\\langle x, y\\rangle)`
    wherever the series converges.

    Two modes:

    * ``"paper"`` (default): as in the papers, every one of the :math:`R = D` features
      samples its degree, degree 0 included (a constant feature
      :math:`\\sqrt{a_0 / P[0]}`); ``max_degree`` optionally caps (and renormalises)
      the law, which makes the estimate unbiased for the truncated series only.
    * ``"released"`` (the authors' code, from dp-rfs): feature 0 is the deterministic
      constant :math:`\\sqrt{a_0}`, the other :math:`R = D - 1` features draw degrees
      on :math:`\\{1, \\dots, 20\\}` (``max_degree``). Much lower variance (the sampled
      constant contributes about :math:`a_0^2 (p - 1)` to the per-feature variance of
      the paper form), unbiased for the degree-20 truncation.

    **Fast path** (:func:`~kernelattn_maclaurin.fast.degree_products`). Features are
    stored sorted by degree. One matrix product gives every projection, transposed
    (``[S, M]`` for ``M`` rows, :math:`S = \\sum_i N_i`), so each group of features of
    degree :math:`n` is one contiguous block ``[n, c_n, M]`` and its product over the
    :math:`n` factors a few contiguous passes; the backward pass is written by hand
    (co-products from prefix and suffix products). The Python loop runs over distinct
    degrees (about :math:`\\log_p D` of them), never over features.
    :func:`kernelattn_maclaurin.naive.rmf_features_naive` is the per-feature reference.

    **Checks.** :meth:`prepare` (called by attention) and :meth:`kernel_estimate`
    raise :class:`~kernelattn_core.errors.DomainError` when some
    :math:`|\\langle q, k\\rangle| \\ge R_f` (radius-one kernels) and emit
    :class:`~kernelattn_maclaurin.variance.InfiniteVarianceWarning` when the estimate
    has infinite variance (:math:`p\\,m(q, k) \\ge R_f^2`, uncapped law). Both use a
    Cauchy-Schwarz bound first and look at pairs only when the bound fails.

    Parameters
    ----------
    head_dim : int, optional
    num_features : int
        :math:`D` (128 by default, the papers' value). In released mode one of them
        is the constant feature (so :math:`D \\ge 2`).
    kernel : str or DotProductKernel
        ``exp`` (default), ``inv``, ``logi``, ``trigh``, ``sqrt``, ``polynomial``, any
        registered dot-product kernel, or a :class:`~kernelattn_maclaurin.kernels.UserKernel`.
    kernel_options : dict, optional
        Options of a named kernel (``{"c": 1, "degree": 3}`` for ``polynomial``).
    p : float
        Degree-law ratio :math:`p > 1` (2 in the papers).
    projection : {"rademacher", "gaussian"}
    mode : {"paper", "released"}
    max_degree : int, optional
        Degree cap (released mode: 20 when ``None``).
    check : bool
        Run the domain check and the infinite-variance warning.
    generator : torch.Generator, optional

    Attributes
    ----------
    degrees : Tensor ``[R]`` (long)
        Sorted degrees of the random features.
    omega : Tensor ``[S, d]``
        All projections, :math:`S = \\sum_i N_i`; the group of the :math:`c_n` features of
        degree :math:`n` occupies ``n * c_n`` consecutive rows laid out as ``[n, c_n]``.
    weights : Tensor ``[D]`` (float64, derived from ``degrees``)
        :math:`\\sqrt{a_N / P[N]} / \\sqrt{R}` per feature (and :math:`\\sqrt{a_0}` for the
        released constant, first).

    Notes
    -----
    Claims checked by the verification suite: FM001 unbiasedness (Monte Carlo), FM003
    the closed-form variance of :func:`~kernelattn_maclaurin.variance.rmf_variance`,
    FM004 :math:`1/D` error decay, FM005 unbiasedness proved symbolically
    (:func:`derive_expectation`), SP001 both degree laws sum to one for symbolic
    :math:`p`.

    References
    ----------
    Kar & Karnick, "Random feature maps for dot product kernels", AISTATS 2012.
    Guo et al., "Macformer: Transformer with random Maclaurin feature attention" and
    "SchoenbAt: Rethinking attention with polynomial basis".

    Examples
    --------
    >>> import torch
    >>> fm = RandomMaclaurinFeatures(head_dim=8, num_features=64, kernel="inv",
    ...                              generator=torch.Generator().manual_seed(0))
    >>> x = 0.3 * torch.nn.functional.normalize(torch.randn(5, 8), dim=-1)
    >>> fm.query(x).shape
    torch.Size([5, 64])
    """

    name: ClassVar[str] = "rmf"
    aliases: ClassVar[tuple[str, ...]] = ("random-maclaurin",)
    kernel: ClassVar[str | None] = "exp"  # the default target; an instance holds its own kernel's name
    unbiased: ClassVar[bool] = True
    positive: ClassVar[bool] = False
    learnable: ClassVar[bool] = False
    random: ClassVar[bool] = True
    log_space: ClassVar[bool] = False
    has_budget: ClassVar[bool] = True
    default_num_features: ClassVar[int] = 128
    claims: ClassVar[tuple[Any, ...]] = (
        UnbiasedKernelEstimate(dims=(8, 16), norm_range=(0.2, 1.0), num_features=16, options={"kernel": "exp"}),
        UnbiasedKernelEstimate(dims=(8,), num_features=16, options={"kernel": "inv"}, inputs=_small_inputs),
        UnbiasedKernelEstimate(dims=(8,), num_features=16, options={"kernel": "logi"}, inputs=_small_inputs),
        UnbiasedKernelEstimate(dims=(8,), num_features=16, options={"kernel": "sqrt"}, inputs=_small_inputs),
        UnbiasedKernelEstimate(
            dims=(8,), num_features=16, options={"kernel": "exp", "p": 3.0, "projection": "gaussian"}
        ),
        UnbiasedKernelEstimate(dims=(8,), num_features=16, options={"kernel": "exp", "mode": "released"}),
        EstimateVariance(variance=variance_for_claim, dims=(8,), options={"kernel": "exp"}),
        EstimateVariance(variance=variance_for_claim, dims=(8,), options={"kernel": "inv"}, inputs=_small_inputs),
        EstimateVariance(variance=variance_for_claim, dims=(8,), options={"kernel": "exp", "mode": "released"}),
        ErrorDecay(slope=-1.0, tolerance=0.25, options={"kernel": "exp"}),
        SymbolicExpectation(derive=_claims.derive_runtime_expectation, options={"kernel": "exp", "p": 3.0}),
        SymbolicExpectation(derive=_claims.derive_runtime_expectation, options={"kernel": "inv"}),
        PmfSumsToOne(
            pmf=_claims.pmf_paper_closed_form,
            start=0,
            label="degree law (p-1)/p^(n+1), p = 1 + q symbolic",
            runtime=_claims.runtime_law("paper", 3.0),
        ),
        PmfSumsToOne(
            pmf=_claims.pmf_truncated_closed_form(1, RELEASED_MAX_DEGREE),
            start=1,
            stop=RELEASED_MAX_DEGREE,
            label="released law on {1..20}",
            runtime=_claims.runtime_law("released", 2.0),
        ),
        # negative controls (expect="fail"): each checker seen rejecting a false claim
        UnbiasedKernelEstimate(dims=(8,), num_features=16, options={"kernel": "exp", "max_degree": 1}, expect="fail"),
        EstimateVariance(
            variance=_claims.variance_paper_form,
            dims=(8,),
            options={"kernel": "exp", "mode": "released"},
            expect="fail",
        ),
        ErrorDecay(options={"kernel": "exp", "max_degree": 1}, norm_range=(1.5, 2.0), expect="fail"),
        SymbolicExpectation(
            derive=_claims.derive_runtime_expectation, options={"kernel": "exp", "max_degree": 12}, expect="fail"
        ),
        PmfSumsToOne(pmf=_claims.pmf_as_printed, label="the papers' printed 1/p^(n+1)", expect="fail"),
    )

    def __init__(
        self,
        head_dim: int | None = None,
        num_features: int | None = None,
        *,
        kernel: Any = "exp",
        kernel_options: dict[str, Any] | None = None,
        p: float = 2.0,
        projection: str = "rademacher",
        mode: str = "paper",
        max_degree: int | None = None,
        check: bool = True,
        generator: torch.Generator | None = None,
    ) -> None:
        target = resolve_kernel(kernel, kernel_options)
        if projection not in PROJECTIONS:
            raise InputError(f"projection: expected one of {list(PROJECTIONS)}, got {projection!r}")
        self.target = target
        self.kernel = target.name if not hasattr(target, "label") else target.label
        self.projection = projection
        self.mode = mode
        self.distribution = degree_distribution(p, mode, max_degree)
        self.p = float(p)
        self.max_degree = self.distribution.stop
        if not isinstance(check, bool):  # never read "no" or 0 by its truth value
            raise InputError(f"check: expected True or False, got {check!r} ({type(check).__name__})")
        self.check = check
        self._groups_cache: list[tuple[int, int]] | None = None
        self._weights_cache: torch.Tensor | None = None
        #: the ``degrees`` tensor the caches above belong to: a replay that puts another
        #: call's buffers in the map (an activation checkpoint's recompute) invalidates them
        self._cache_key: torch.Tensor | None = None
        if num_features is not None and mode == "released" and num_features < 2:
            raise InputError(
                f"num_features: released mode needs D >= 2 (one constant + random features), got {num_features}"
            )
        super().__init__(head_dim, num_features, generator=generator)
        if mode == "released" and self.num_features < 2:
            raise InputError(f"num_features: released mode needs D >= 2, got {self.num_features}")
        self.register_load_state_dict_pre_hook(_resize_before_load)
        self.register_load_state_dict_post_hook(_forget_groups)

    # ------------------------------------------------------------------ lifecycle
    @property
    def num_random(self) -> int:
        """:math:`R`, the number of random features."""
        return random_feature_count(self.mode, self.num_features)

    def _build(self, head_dim: int) -> None:
        r = self.num_random
        self.register_buffer("degrees", torch.zeros(r, dtype=torch.long))
        self.register_buffer("omega", torch.empty(0, head_dim))

    def _redraw(self, generator: torch.Generator | None) -> None:
        # the draw's shape varies (omega has sum N_i rows), so the buffers are new tensors: made
        # outside inference mode, a redraw under torch.inference_mode() (a training-mode call)
        # leaves ordinary buffers that later training steps can save for backward and
        # load_state_dict can copy into (an inference tensor refuses both)
        with torch.inference_mode(False):
            r = self.num_random
            u = self._draw("uniform", (r,), torch.empty(0, dtype=torch.float64), generator)
            degrees = self.distribution.sample(u).sort().values  # [R], sorted: features are exchangeable
            total = int(degrees.sum())
            kind = "rademacher" if self.projection == "rademacher" else "normal"
            omega = self._draw(kind, (total, self.head_dim), self.omega, generator)  # [S, d]
            # new tensors, not in-place copies: a graph of an earlier call still holds the old ones
            self.degrees = degrees.to(self.degrees.device)
            self.omega = omega
        self._groups_cache = None
        self._weights_cache = None

    @property
    def weights(self) -> torch.Tensor:
        """``[D]`` float64 (CPU) feature weights, derived from :attr:`degrees` (exact to one
        rounding whatever the module's dtype; not stored in the state dict)."""
        self._check_cache()
        if self._weights_cache is None:
            with torch.inference_mode(False):  # a cache filled under inference mode serves training too
                self._weights_cache = self._weights(self.degrees.cpu())
        return self._weights_cache

    @weights.setter
    def weights(self, value: torch.Tensor) -> None:
        """Override the weights of the current draw (for experiments and negative controls)."""
        self._check_cache()
        self._weights_cache = value.detach().to(device="cpu", dtype=torch.float64)

    def _check_cache(self) -> None:
        """Drop the caches when ``degrees`` is no longer the tensor they were made from."""
        if getattr(self, "_cache_key", None) is not self.degrees:
            self._groups_cache = None
            self._weights_cache = None
            self._cache_key = self.degrees

    def _weights(self, degrees: torch.Tensor) -> torch.Tensor:
        """``[D]`` float64: :math:`\\sqrt{a_N/P[N]/R}` (and :math:`\\sqrt{a_0}` first in released mode)."""
        top = int(degrees.max()) if degrees.numel() else 0
        log_a = _log_coefficients(self.target, top)  # [top + 1]
        d = degrees.cpu()
        log_w = 0.5 * (log_a[d] - self.distribution.log_pmf(d) - math.log(self.num_random))
        w = log_w.exp()
        if self.mode == "released":
            a0 = float(self.target.coefficient(0))
            w = torch.cat([torch.tensor([math.sqrt(a0)], dtype=torch.float64), w])
        return w

    def groups(self) -> list[tuple[int, int]]:
        """``[(n, c_n), ...]``: the distinct degrees of the draw and their counts, ascending."""
        self._check_cache()
        if self._groups_cache is None:
            values, counts = torch.unique_consecutive(self.degrees.cpu(), return_counts=True)
            self._groups_cache = list(zip(values.tolist(), counts.tolist()))
        return self._groups_cache

    def projections(self) -> list[torch.Tensor]:
        """Per-feature projection matrices ``[N_i, d]`` in feature order (for readable references)."""
        out, offset = [], 0
        for n, c in self.groups():
            block = self.omega[offset : offset + n * c].view(n, c, self.omega.shape[-1])  # [n, c, d]
            out.extend(block[:, i] for i in range(c))
            offset += n * c
        return out

    def _feature_dim(self) -> int:
        return self.num_features

    # ------------------------------------------------------------------ features
    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        omega = self.omega.to(dtype=x.dtype, device=x.device)
        weights = self.weights.to(dtype=x.dtype, device=x.device)
        return degree_products(x, omega, weights, tuple(self.groups()), self.mode == "released")  # [..., D]

    # ------------------------------------------------------------------ checks and diagnostics
    def prepare(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> None:
        """Domain check and infinite-variance warning on the scaled ``q [B, H, N, d]`` and
        ``k [B, H, M, d]`` over the pairs that interact: padded keys (``key_padding_mask
        [B, M]``, ``True`` = padded) are left out and, with ``causal=True``, so are the
        pairs of a query with later keys (a later token never makes an in-range prefix
        fail). Nothing is learned from the data."""
        if self.check:
            if key_padding_mask is not None:
                k = k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
            self.check_inputs(q, k, stacklevel=4, causal=causal)

    def check_inputs(self, q: torch.Tensor, k: torch.Tensor, *, stacklevel: int = 3, causal: bool = False) -> None:
        """Raise :class:`DomainError` if some :math:`|\\langle q_i, k_j\\rangle| \\ge R_f`; warn
        (:class:`~kernelattn_maclaurin.variance.InfiniteVarianceWarning`) if the estimate's
        variance is infinite on some pair. ``q [..., N, d]``, ``k [..., M, d]``; with
        ``causal=True`` only the pairs :math:`j \\le i`. Rows holding NaN or inf are left
        out (attention quarantines them)."""
        radius = self.target.radius
        if math.isinf(radius) or q.numel() == 0 or k.numel() == 0:
            return
        with torch.no_grad():
            q, k = q.detach().double(), k.detach().double()
            # a non-finite row is out of no domain: attention quarantines it (the rows that see
            # it are NaN), so it must not refuse the whole call (a NaN or inf padded token)
            q = q.masked_fill(~torch.isfinite(q).all(-1, keepdim=True), 0.0)
            k = k.masked_fill(~torch.isfinite(k).all(-1, keepdim=True), 0.0)
            qn2 = float((q * q).sum(-1).max())
            kn2 = float((k * k).sum(-1).max())
            need_domain = math.sqrt(qn2 * kn2) >= radius
            need_variance = self.distribution.stop is None and self.p * 3.0 * qn2 * kn2 >= radius**2
            if not (need_domain or need_variance):
                return
            t_max, m_max = max_pair_values(q, k, self.projection, causal=causal)
        if t_max >= radius:
            raise DomainError(
                f"<q, k>: kernel {self.kernel!r} needs |<q, k>| < {radius} (radius of convergence), got max "
                f"|<q, k>| = {t_max:.6g} (after the d^(-1/4) scaling); normalise q and k (e.g. normalizer='ppsbn')"
            )
        if self.distribution.stop is None and self.p * m_max >= radius**2:
            warn_infinite_variance(self.kernel, self.p, m_max, radius, stacklevel=stacklevel)

    def kernel_estimate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """:math:`\\Phi(x_i)^\\top\\Phi(y_j)`, ``[..., N, M]``, after the domain and variance checks."""
        if self.check and x.dim() >= 2 and y.dim() >= 2 and x.shape[:-2] == y.shape[:-2]:
            self.check_inputs(x, y)
        return super().kernel_estimate(x, y)

    def variance(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Exact :math:`\\mathrm{Var}[\\Phi(x)^\\top\\Phi(y)]` for paired rows ``x, y [..., d]``
        (``[...]``, float64; ``inf`` where infinite). See :func:`~kernelattn_maclaurin.variance.rmf_variance`."""
        return rmf_variance(
            x,
            y,
            self.target,
            p=self.p,
            projection=self.projection,
            mode=self.mode,
            max_degree=self.max_degree,
            num_features=self.num_features,
        )

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, num_features={self.num_features}, kernel={self.kernel!r}, p={self.p}, "
            f"projection={self.projection!r}, mode={self.mode!r}, max_degree={self.max_degree}"
        )


def _log_coefficients(kernel: Any, n_max: int) -> torch.Tensor:
    if isinstance(kernel, MaclaurinKernel):
        return kernel.log_coefficients(n_max)
    vals = []
    for n in range(n_max + 1):
        a = float(kernel.coefficient(n))
        if a < 0:
            raise InputError(f"kernel: coefficient a_{n} = {a} is negative; random Maclaurin features need a_n >= 0")
        vals.append(math.log(a) if a > 0 else -math.inf)
    return torch.tensor(vals, dtype=torch.float64)


def _resize_before_load(module: RandomMaclaurinFeatures, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook: the draw's sizes (``sum N_i`` rows of ``omega``) vary, so
    take the incoming shapes before the copy."""
    if not module.built:
        return
    for name in ("degrees", "omega"):
        incoming = state_dict.get(prefix + name)
        current = getattr(module, name)
        if isinstance(incoming, torch.Tensor) and incoming.shape != current.shape:
            setattr(module, name, torch.empty(incoming.shape, dtype=current.dtype, device=current.device))
    module._groups_cache = None
    module._weights_cache = None


def _forget_groups(module: RandomMaclaurinFeatures, incompatible_keys: Any) -> None:
    module._groups_cache = None
    module._weights_cache = None
