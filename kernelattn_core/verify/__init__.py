"""Machine checks of the claims that registered classes declare.

* :mod:`.symbolic`: SymPy — exact Maclaurin coefficients, pmfs, symbolic expectations.
* :mod:`.precision`: mpmath — quadrature identities at 30+ digits.
* :mod:`.statistical`: Monte Carlo in float64 with fixed seeds and z-tests.

:func:`run_checks` runs every claim of the selected classes; ``kernelattn verify``
prints the results. Besides the claims a class lists, its capability data implies
some: every dot-product kernel is checked for exact, non-negative coefficients and
for agreement of ``f`` with its SymPy expression (KN001-KN003); a feature map
flagged ``positive`` gets FM002 and one flagged ``unbiased`` (random, with a target
kernel) gets FM001, unless it declares them itself with its own settings.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..claims import (
    Claim,
    ConsistentAttention,
    ErrorDecay,
    EstimateVariance,
    KernelMatchesExpression,
    MaclaurinCoefficients,
    NonNegativeCoefficients,
    PmfSumsToOne,
    PositiveFeatures,
    QuadratureIdentity,
    SymbolicExpectation,
    UnbiasedAttention,
    UnbiasedKernelEstimate,
)
from ..errors import UnknownNameError
from ..interfaces.kernel import DotProductKernel
from ..registry import Entry, Registry, get_registry
from .result import CheckResult

Checker = Callable[[Entry, Any, str, dict[str, str]], CheckResult]


def _kernel(entry: Entry, claim: Any) -> DotProductKernel:
    return entry.cls(**dict(getattr(claim, "options", {}) or {}))


def _checkers() -> dict[type, Checker]:
    from . import precision, statistical, symbolic

    return {
        MaclaurinCoefficients: lambda e, c, lvl, ids: symbolic.check_coefficients(_kernel(e, c), c, **ids),
        NonNegativeCoefficients: lambda e, c, lvl, ids: symbolic.check_nonnegative(_kernel(e, c), c, **ids),
        KernelMatchesExpression: lambda e, c, lvl, ids: precision.check_kernel_expression(_kernel(e, c), c, **ids),
        PmfSumsToOne: lambda e, c, lvl, ids: symbolic.check_pmf(c, **ids),
        SymbolicExpectation: lambda e, c, lvl, ids: symbolic.check_symbolic_expectation(c, **ids),
        QuadratureIdentity: lambda e, c, lvl, ids: precision.check_quadrature(c, **ids),
        UnbiasedKernelEstimate: lambda e, c, lvl, ids: statistical.check_unbiased(e.cls, c, lvl, **ids),
        PositiveFeatures: lambda e, c, lvl, ids: statistical.check_positive(e.cls, c, lvl, **ids),
        EstimateVariance: lambda e, c, lvl, ids: statistical.check_variance(e.cls, c, lvl, **ids),
        ErrorDecay: lambda e, c, lvl, ids: statistical.check_error_decay(e.cls, c, lvl, **ids),
        UnbiasedAttention: lambda e, c, lvl, ids: statistical.check_unbiased_attention(e.name, c, lvl, **ids),
        ConsistentAttention: lambda e, c, lvl, ids: statistical.check_consistent_attention(e.name, c, lvl, **ids),
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
    if entry.kind == "feature_map":
        if cls.positive and PositiveFeatures not in declared:
            claims.append(PositiveFeatures())
        if cls.unbiased and cls.random and cls.kernel is not None and UnbiasedKernelEstimate not in declared:
            claims.append(UnbiasedKernelEstimate())
    return claims


def select(names: Sequence[str], registry: Registry) -> list[Entry]:
    """Entries for plugin names and/or registered class names (all when empty)."""
    if not names:
        return registry.entries()
    plugins = {p.name: p for p in registry.plugins()}
    chosen: list[Entry] = []
    for name in names:
        if name in plugins:
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
