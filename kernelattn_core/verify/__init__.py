"""Machine checks of the claims that registered classes declare.

* :mod:`.symbolic`: SymPy — exact Maclaurin coefficients, pmfs, symbolic expectations.
* :mod:`.precision`: mpmath — quadrature identities at 30+ digits.
* :mod:`.statistical`: Monte Carlo in float64 with fixed seeds and z-tests.
* :mod:`.engine`: what an estimator computes (EN001-EN003), outputs and gradients,
  against the quadratic reference, under causality and under padding.

:func:`run_checks` runs every claim of the selected classes; ``kernelattn verify``
prints the results. Besides the claims a class lists, its capability data implies
some: every dot-product kernel is checked for exact, non-negative coefficients and
for agreement of ``f`` with its SymPy expression (KN001-KN003); every kernel for
positive definiteness on random point sets (KN006), and a shift-invariant kernel
that declares its spectral density (``spectral_density_mp``) for agreement with the
density's Fourier integral (KN005); a feature map flagged ``positive`` (and not
log-space, where positivity holds by construction) gets FM002 and one flagged
``unbiased`` with a target kernel, in either form
(:func:`~kernelattn_core.registry.target_kernel_name`: ``kernel = "name"`` or
``target_kernel_class``), gets FM001 (:func:`implied_kernel_estimate`): a random map the
Monte Carlo test, a deterministic one the exactness test (the estimate equals the
kernel within rounding), unless it declares them itself with its own settings. Every
estimator and every feature map gets the engine claims
(:func:`.engine.implied_engine_claims`): EN001 for feature-map attention (every feature
map, every subclass of :class:`~kernelattn_core.FeatureMapAttention` however it
overrides ``_attend``), EN002 where ``causal=True`` is supported, EN003 always.

A claim with an option ``grid`` is expanded by :func:`expand` into one claim per point
(quick level: the declared options and the first point; full level: every point). A
claim in a deprecated form (:data:`kernelattn_core.claims.spec.DEPRECATIONS`) warns and
is checked in its meaningful form.

A name given to :func:`select` that matches nothing, or a plugin that failed to
load, raises :class:`~kernelattn_core.errors.PluginError` naming the load error:
``kernelattn verify NAME`` never reports "0 passed" for a plugin that is not there.
The registry refuses a class whose ``claims`` holds anything but claim instances; a
class checked without it (an :class:`~kernelattn_core.registry.Entry` built by hand)
gets a failing row for such an entry, never a crash.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..claims import (
    Claim,
    ConsistentAttention,
    EngineReference,
    ErrorDecay,
    EstimateVariance,
    KernelClosedForm,
    KernelMatchesExpression,
    MaclaurinCoefficients,
    NonNegativeCoefficients,
    PaddingInvariance,
    PmfSumsToOne,
    PositiveDefinite,
    PositiveFeatures,
    PrefixInvariance,
    QuadratureIdentity,
    RuntimeIdentity,
    SpectralDensityIntegral,
    SymbolicExpectation,
    UnbiasedAttention,
    UnbiasedKernelEstimate,
)
from ..errors import InputError, PluginError, UnknownNameError
from ..interfaces.kernel import DotProductKernel, KernelFamily
from ..registry import Entry, Registry, get_registry, target_kernel_name
from .result import CheckResult

Checker = Callable[[Entry, Any, str, dict[str, str]], CheckResult]


def _kernel(entry: Entry, claim: Any) -> DotProductKernel:
    subject = getattr(claim, "subject", None)  # a negative control's declared kernel (KN006)
    if subject is not None:
        return subject()
    return entry.cls(**dict(getattr(claim, "options", {}) or {}))


def _checkers() -> dict[type, Checker]:
    from . import engine, kernels, precision, runtime, statistical, symbolic

    return {
        KernelClosedForm: lambda e, c, lvl, ids: kernels.check_closed_form(_kernel(e, c), c, **ids),
        SpectralDensityIntegral: lambda e, c, lvl, ids: kernels.check_spectral_integral(_kernel(e, c), c, **ids),
        PositiveDefinite: lambda e, c, lvl, ids: kernels.check_positive_definite(_kernel(e, c), c, **ids),
        MaclaurinCoefficients: lambda e, c, lvl, ids: symbolic.check_coefficients(_kernel(e, c), c, **ids),
        NonNegativeCoefficients: lambda e, c, lvl, ids: symbolic.check_nonnegative(_kernel(e, c), c, **ids),
        KernelMatchesExpression: lambda e, c, lvl, ids: precision.check_kernel_expression(_kernel(e, c), c, **ids),
        PmfSumsToOne: lambda e, c, lvl, ids: symbolic.check_pmf(c, **ids),
        SymbolicExpectation: lambda e, c, lvl, ids: symbolic.check_symbolic_expectation(c, feature_map=e.cls, **ids),
        QuadratureIdentity: lambda e, c, lvl, ids: precision.check_quadrature(c, **ids),
        UnbiasedKernelEstimate: lambda e, c, lvl, ids: statistical.check_unbiased(e.cls, c, lvl, **ids),
        PositiveFeatures: lambda e, c, lvl, ids: statistical.check_positive(e.cls, c, lvl, **ids),
        EstimateVariance: lambda e, c, lvl, ids: statistical.check_variance(e.cls, c, lvl, **ids),
        ErrorDecay: lambda e, c, lvl, ids: statistical.check_error_decay(e.cls, c, lvl, **ids),
        UnbiasedAttention: lambda e, c, lvl, ids: statistical.check_unbiased_attention(e, c, lvl, **ids),
        ConsistentAttention: lambda e, c, lvl, ids: statistical.check_consistent_attention(e, c, lvl, **ids),
        EngineReference: lambda e, c, lvl, ids: engine.check_engine_reference(e, c, lvl, **ids),
        PrefixInvariance: lambda e, c, lvl, ids: engine.check_prefix_invariance(e, c, lvl, **ids),
        PaddingInvariance: lambda e, c, lvl, ids: engine.check_padding_invariance(e, c, lvl, **ids),
        RuntimeIdentity: lambda e, c, lvl, ids: runtime.check_runtime_identity(e, c, lvl, **ids),
    }


def claims_of(entry: Entry) -> list[Claim]:
    """Declared claims of a class, plus those its capability data implies."""
    declared_claims = getattr(entry.cls, "claims", ()) or ()
    if isinstance(declared_claims, str | Claim):  # not a tuple: refused at registration, one bad row here
        declared_claims = (declared_claims,)
    claims = list(declared_claims)
    declared = {type(c) for c in claims}
    cls = entry.cls
    if entry.kind == "kernel" and issubclass(cls, DotProductKernel):
        for implied in (MaclaurinCoefficients, NonNegativeCoefficients, KernelMatchesExpression):
            if implied not in declared:
                claims.append(implied())
    if entry.kind == "kernel":
        if (
            cls.family == KernelFamily.SHIFT_INVARIANT
            and hasattr(cls, "spectral_density_mp")
            and SpectralDensityIntegral not in declared
        ):
            claims.append(SpectralDensityIntegral())
        if PositiveDefinite not in declared and not getattr(cls, "indefinite", False):
            claims.append(PositiveDefinite())
    if entry.kind == "estimator" and getattr(cls, "unbiased", False):
        # unbiasedness is per mode: a flagged class is checked in every mode it claims it for
        # (both by default since spec 1.1; a spec 1.0 plugin, which could not say, in train
        # mode only, as 1.0 checked it)
        default_modes = ("train", "eval") if _plugin_spec(entry) != "1.0" else ("train",)
        modes = tuple(getattr(cls, "unbiased_modes", default_modes))
        declared_modes = {c.mode for c in claims if isinstance(c, UnbiasedAttention) and c.expect == "pass"}
        base = next((c for c in claims if isinstance(c, UnbiasedAttention) and c.expect == "pass"), None)
        if base is not None:
            for mode in modes:
                if mode not in declared_modes:
                    claims.append(dataclasses.replace(base, mode=mode))
    if entry.kind == "feature_map":
        if cls.positive and not cls.log_space and PositiveFeatures not in declared:
            claims.append(PositiveFeatures())
        implied = implied_kernel_estimate(cls)
        if implied is not None and UnbiasedKernelEstimate not in declared:
            claims.append(implied)
    from .engine import implied_engine_claims

    claims.extend(implied_engine_claims(entry, declared))
    return claims


#: redraws of the FM001 implied for a deterministic map: a redraw changes nothing, so the
#: check compares the (one) estimate with the kernel; a few redraws show that it has no variance
EXACT_MAP_REDRAWS = 4


def implied_kernel_estimate(cls: type) -> UnbiasedKernelEstimate | None:
    """The FM001 claim a feature-map class's capability data imply, or ``None``.

    A map flagged ``unbiased`` that declares a target kernel, as a registry name
    (``kernel``) or as a class (``target_kernel_class``, read by
    :func:`~kernelattn_core.registry.target_kernel_name`), promises
    :math:`\\mathbb{E}[\\phi_q(x)^\\top \\phi_k(y)] = K(x, y)`: a random map is checked by
    Monte Carlo with the claim's defaults; a deterministic map (``random = False``), whose
    estimate has no variance, for exactness (the estimate equals the kernel within
    rounding, :data:`~kernelattn_core.verify.statistical.EXACT_RTOL`) with
    :data:`EXACT_MAP_REDRAWS` redraws.
    """
    if not getattr(cls, "unbiased", False) or target_kernel_name(cls) is None:
        return None
    if getattr(cls, "random", True):
        return UnbiasedKernelEstimate()
    return UnbiasedKernelEstimate(redraws=EXACT_MAP_REDRAWS)


def _rule(claim: Any) -> str:
    """The rule ID of a claims entry (``"?"`` for an entry that is not a claim instance)."""
    return (getattr(claim, "rule", "") or "?") if isinstance(claim, Claim) else "?"


def _plugin_spec(entry: Entry) -> str:
    """The spec version the plugin of ``entry`` was written against (the current one for a
    class no registered plugin owns: a test's unregistered mutant)."""
    from ..hookspecs import SPEC_VERSION

    info = {p.name: p for p in get_registry().plugins()}.get(entry.plugin)
    return SPEC_VERSION if info is None else info.spec


def expand(claim: Claim, level: str = "quick") -> list[Claim]:
    """The claims one declared claim stands for at ``level``: itself when it has no
    ``grid``; else one claim at ``options | point`` for the declared options and each
    grid point (quick level: the declared options and the first point only)."""
    grid = tuple(getattr(claim, "grid", ()) or ()) if isinstance(claim, Claim) else ()
    if not grid:
        return [claim]
    if not hasattr(claim, "options"):
        raise TypeError(f"{type(claim).__name__}: a grid needs an 'options' field to vary")
    points = grid if level == "full" else grid[:1]
    base = dict(claim.options or {})
    return [dataclasses.replace(claim, grid=())] + [
        dataclasses.replace(claim, options={**base, **dict(point)}, grid=(), point=i + 1)
        for i, point in enumerate(points)
    ]


def _option_text(value: Any) -> str:
    """A short rendering of an option value (tensors by shape, callables by name)."""
    try:
        import torch

        if isinstance(value, torch.Tensor):
            return f"tensor{list(value.shape)}" if value.dim() else f"{float(value):g}"
    except ImportError:  # pragma: no cover
        pass
    if callable(value):
        return getattr(value, "__name__", type(value).__name__)
    return repr(value) if isinstance(value, str) else str(value)


def load_errors(registry: Registry, names: Sequence[str] = ()) -> list[str]:
    """``"plugin: error"`` lines for the plugins (all, or those named) that failed to load."""
    wanted = set(names)
    return [
        f"{p.name}: {err}"
        for p in registry.plugins()
        if p.errors and (not wanted or p.name in wanted)
        for err in p.errors
    ]


def select(names: Sequence[str], registry: Registry) -> list[Entry]:
    """Entries for plugin names and/or registered class names (all when empty).

    Raises
    ------
    PluginError
        When a plugin to check failed to load (import error, bad hook): checking
        the rest would report success on a plugin that is not there.
    UnknownNameError
        When a name is neither a plugin nor a registered class, or a plugin
        registered nothing.
    """
    errors = load_errors(registry, names)
    if errors:
        raise PluginError(
            "verify: plugins failed to load, so their claims cannot be checked:\n  " + "\n  ".join(errors)
        )
    if not names:
        return registry.entries()
    plugins = {p.name: p for p in registry.plugins()}
    chosen: list[Entry] = []
    for name in names:
        if name in plugins:
            if not plugins[name].entries:
                raise UnknownNameError(f"verify: plugin {name!r} loaded but registered no class; nothing to check")
            chosen.extend(plugins[name].entries)
            continue
        try:
            chosen.append(registry.get(name))
        except UnknownNameError:
            raise UnknownNameError(
                f"verify: {name!r} is neither a plugin ({', '.join(plugins)}) nor a registered class "
                f"({', '.join(registry.names())})"
            ) from None
    seen: set[str] = set()
    return [e for e in chosen if not (e.name in seen or seen.add(e.name))]  # type: ignore[func-returns-value]


def check_claim(entry: Entry, claim: Claim, level: str = "quick") -> CheckResult:
    """Run one claim of one registered class; an exception becomes a failing result.

    A claim with a ``grid`` is checked at every point :func:`expand` gives at ``level``;
    the result is the first failing point's (or the last point's), with the number of
    points checked. A deprecated claim form warns
    (:class:`~kernelattn_core.claims.spec.ClaimDeprecationWarning`) and is checked in its
    meaningful form; its result says so under ``deprecated``. The global torch random
    state is restored afterwards.
    """
    from ..claims.spec import deprecation_of, warn_deprecated

    if not isinstance(claim, Claim):  # a rule ID, a claim class without (): refused at registration
        what = f"the claim class {claim.__name__}" if isinstance(claim, type) else repr(claim)
        return CheckResult(
            _rule(claim),
            claim=f"claims entry {what} of {entry.cls.__qualname__}",
            numbers={"error": f"{what} is not a claim instance (declare e.g. UnbiasedKernelEstimate(...))"},
            verdict="fail",
            plugin=entry.plugin,
            target=entry.name,
        )
    points = expand(claim, level)
    if len(points) > 1:
        results = [check_claim(entry, point, level) for point in points]
        failed = [r for r in results if not r.passed]
        result = failed[0] if failed else results[-1]
        result.numbers["grid_points_checked"] = len(results)
        if failed:
            result.numbers["grid_points_failed"] = len(failed)
        return result
    ids = {"plugin": entry.plugin, "target": entry.name}
    checker = _checkers().get(type(claim))
    if checker is None:
        return CheckResult(
            claim.rule or "?", claim=f"no checker for {type(claim).__name__}", numbers={}, verdict="fail", **ids
        )
    deprecation = deprecation_of(entry, claim)
    if deprecation is not None:
        if deprecation.removed:
            return CheckResult(
                claim.rule, claim=claim.summary, numbers={"refused": deprecation.message(entry.name)}, **ids
            )
        warn_deprecated(deprecation, entry.name)
    try:
        import torch

        with torch.random.fork_rng(devices=[]):
            result = checker(entry, claim, level, ids)
        options = dict(getattr(claim, "options", {}) or {})
        if options:
            result.claim += " [" + ", ".join(f"{k}={_option_text(v)}" for k, v in options.items()) + "]"
        if deprecation is not None:
            result.numbers["deprecated"] = deprecation.message(entry.name)
        if claim.expect == "fail":  # a declared negative control passes when the checker rejects it
            result.numbers["checker_verdict"] = result.verdict
            result.claim = f"negative control, must fail: {result.claim}"
            result.verdict = "pass" if result.verdict == "fail" else "fail"
        return result
    except Exception as exc:
        return CheckResult(
            claim.rule, claim=claim.summary, numbers={"error": f"{type(exc).__name__}: {exc}"}, verdict="fail", **ids
        )


def run_checks(
    names: Sequence[str] = (),
    level: str = "quick",
    registry: Registry | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[CheckResult]:
    """Every claim of the selected classes (all installed when ``names`` is empty)."""
    registry = registry or get_registry()
    results = []
    for entry, claim in plan(names, registry, level):
        if progress is not None:
            progress(f"{_rule(claim)} {entry.name}")
        results.append(check_claim(entry, claim, level))
    return results


def plan(
    names: Sequence[str] = (), registry: Registry | None = None, level: str | None = None
) -> Iterable[tuple[Entry, Claim]]:
    """The (class, claim) pairs :func:`run_checks` would run; with a ``level``, grids are
    expanded into their points (one pair each)."""
    registry = registry or get_registry()
    pairs = [(e, c) for e in select(names, registry) for c in claims_of(e)]
    if level is None:
        return pairs
    return [(e, point) for e, c in pairs for point in expand(c, level)]


def run_cli(args: argparse.Namespace) -> int:
    """``kernelattn verify``: print the results; exit 1 on any failure (2, raised as a
    :class:`~kernelattn_core.errors.KernelAttnError`, when a name or plugin is bad).
    Deprecation warnings are listed after the table (once per class and rule)."""
    import sys
    import time
    import warnings

    from ..claims.spec import ClaimDeprecationWarning
    from ..report.output import table, to_json
    from ..report.progress import Progress

    rules = set(getattr(args, "rule", None) or ())
    every = list(plan(args.names, level=args.level))
    known = {_rule(c) for _, c in every}
    if rules - known:  # a typo would run nothing and report "0 passed, 0 failed"
        raise InputError(
            f"--rule: {sorted(rules - known)} is not a rule of the selected classes; theirs are {sorted(known)}"
        )
    pairs = [(e, c) for e, c in every if not rules or _rule(c) in rules]
    results = []
    start = time.perf_counter()
    with (
        warnings.catch_warnings(record=True) as caught,
        Progress(
            len(pairs), "verify", enabled=args.format == "table" and not getattr(args, "no_progress", False)
        ) as bar,
    ):
        warnings.simplefilter("always", ClaimDeprecationWarning)
        for entry, claim in pairs:
            results.append(check_claim(entry, claim, args.level))
            bar.advance(f"{_rule(claim)} {entry.name}")
    elapsed = time.perf_counter() - start
    records = [r.as_record() for r in results]
    if args.format == "json":
        print(to_json(records))
    else:
        print(table(records, ("rule", "plugin", "target", "claim", "numbers", "verdict")))
        failed = sum(not r.passed for r in results)
        print(f"\n{len(results) - failed} passed, {failed} failed ({args.level} level, {elapsed:.0f} s)")
    for message in dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, ClaimDeprecationWarning)):
        print(f"kernelattn verify: deprecated: {message}", file=sys.stderr)
    return 1 if any(not r.passed for r in results) else 0


__all__ = [
    "CheckResult",
    "check_claim",
    "claims_of",
    "expand",
    "implied_kernel_estimate",
    "plan",
    "run_checks",
    "run_cli",
    "select",
]
