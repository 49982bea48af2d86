"""Machine checks of the claims that registered classes declare.

* :mod:`.symbolic`: SymPy — exact Maclaurin coefficients, pmfs, symbolic expectations.
* :mod:`.precision`: mpmath — quadrature identities at 30+ digits.
* :mod:`.statistical`: Monte Carlo in float64 with fixed seeds and z-tests.

:func:`run_checks` runs every claim of the selected classes; ``kernelattn verify``
prints the results. Besides the claims a class lists, its capability data implies
some: every dot-product kernel is checked for exact, non-negative coefficients and
for agreement of ``f`` with its SymPy expression (KN001-KN003); every kernel for
positive definiteness on random point sets (KN006), and a shift-invariant kernel
that declares its spectral density (``spectral_density_mp``) for agreement with the
density's Fourier integral (KN005); a feature map flagged ``positive`` (and not
log-space, where positivity holds by construction) gets FM002 and one flagged
``unbiased`` (random, with a target kernel) gets FM001, unless it declares them
itself with its own settings.

A name given to :func:`select` that matches nothing, or a plugin that failed to
load, raises :class:`~kernelattn_core.errors.PluginError` naming the load error:
``kernelattn verify NAME`` never reports "0 passed" for a plugin that is not there.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..claims import (
    Claim,
    ConsistentAttention,
    ErrorDecay,
    EstimateVariance,
    KernelClosedForm,
    KernelMatchesExpression,
    MaclaurinCoefficients,
    NonNegativeCoefficients,
    PmfSumsToOne,
    PositiveDefinite,
    PositiveFeatures,
    QuadratureIdentity,
    SpectralDensityIntegral,
    SymbolicExpectation,
    UnbiasedAttention,
    UnbiasedKernelEstimate,
)
from ..errors import PluginError, UnknownNameError
from ..interfaces.kernel import DotProductKernel, KernelFamily
from ..registry import Entry, Registry, get_registry
from .result import CheckResult

Checker = Callable[[Entry, Any, str, dict[str, str]], CheckResult]


def _kernel(entry: Entry, claim: Any) -> DotProductKernel:
    subject = getattr(claim, "subject", None)  # a negative control's declared kernel (KN006)
    if subject is not None:
        return subject()
    return entry.cls(**dict(getattr(claim, "options", {}) or {}))


def _checkers() -> dict[type, Checker]:
    from . import kernels, precision, statistical, symbolic

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
    }


def claims_of(entry: Entry) -> list[Claim]:
    """Declared claims of a class, plus those its capability data implies."""
    claims = list(getattr(entry.cls, "claims", ()) or ())
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
        modes = tuple(getattr(cls, "unbiased_modes", ("train", "eval")))
        declared_modes = {c.mode for c in claims if isinstance(c, UnbiasedAttention) and c.expect == "pass"}
        base = next((c for c in claims if isinstance(c, UnbiasedAttention) and c.expect == "pass"), None)
        if base is not None:
            for mode in modes:
                if mode not in declared_modes:
                    claims.append(dataclasses.replace(base, mode=mode))
    if entry.kind == "feature_map":
        if cls.positive and not cls.log_space and PositiveFeatures not in declared:
            claims.append(PositiveFeatures())
        if cls.unbiased and cls.random and cls.kernel is not None and UnbiasedKernelEstimate not in declared:
            claims.append(UnbiasedKernelEstimate())
    return claims


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
    """Run one claim of one registered class; an exception becomes a failing result."""
    ids = {"plugin": entry.plugin, "target": entry.name}
    checker = _checkers().get(type(claim))
    if checker is None:
        return CheckResult(
            claim.rule or "?", claim=f"no checker for {type(claim).__name__}", numbers={}, verdict="fail", **ids
        )
    try:
        result = checker(entry, claim, level, ids)
        options = dict(getattr(claim, "options", {}) or {})
        if options:
            result.claim += " [" + ", ".join(f"{k}={v}" for k, v in options.items()) + "]"
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
    for entry in select(names, registry):
        for claim in claims_of(entry):
            if progress is not None:
                progress(f"{claim.rule} {entry.name}")
            results.append(check_claim(entry, claim, level))
    return results


def plan(names: Sequence[str] = (), registry: Registry | None = None) -> Iterable[tuple[Entry, Claim]]:
    """The (class, claim) pairs :func:`run_checks` would run."""
    registry = registry or get_registry()
    return [(e, c) for e in select(names, registry) for c in claims_of(e)]


def run_cli(args: argparse.Namespace) -> int:
    """``kernelattn verify``: print the results; exit 1 on any failure."""
    from ..cli.output import table, to_json
    from ..cli.progress import Progress

    pairs = plan(args.names)
    results = []
    with Progress(
        len(pairs), "verify", enabled=args.format == "table" and not getattr(args, "no_progress", False)
    ) as bar:
        for entry, claim in pairs:
            results.append(check_claim(entry, claim, args.level))
            bar.advance(f"{claim.rule} {entry.name}")
    records = [r.as_record() for r in results]
    if args.format == "json":
        print(to_json(records))
    else:
        print(table(records, ("rule", "plugin", "target", "claim", "numbers", "verdict")))
        failed = sum(not r.passed for r in results)
        print(f"\n{len(results) - failed} passed, {failed} failed")
    return 1 if any(not r.passed for r in results) else 0


__all__ = ["CheckResult", "check_claim", "claims_of", "plan", "run_checks", "run_cli", "select"]
