"""``kernelattn verify``: run the claims of installed plugins (the verification framework)."""

from __future__ import annotations

import argparse
from typing import Any

DESCRIPTION = """\
Run the claims that registered classes declare (and those their capability data imply)
and print one row per check: rule, plugin, class, what was checked, the numbers, the
verdict. Rule families: FM feature maps, KN kernels, SP sampling laws, AT attention
estimators, EN the engine (every estimator and feature map: outputs and gradients against
the quadratic reference, causality, padding), RT runtime identities, HP high-precision
identities (spec/claims.rst).

levels:
  quick  (default; the tests and the conformance kit) the first declared head dimension,
         about half the declared redraws, and of a claim's option grid the declared options
         and the first point only. Takes a few minutes for every installed plugin.
  full   (nox -s formal) every declared dimension plus d = 128 (FM001, FM002), every
         redraw, every point of every option grid, and a longer sequence at the engine's own
         chunk length (EN001): about ten minutes for every installed plugin.

false failures:
  Monte Carlo checks (FM001, FM003, AT001, AT002) use fixed seeds and a Bonferroni
  threshold: each check, at each grid point, fails by chance with probability below 1e-6
  (a run of N such checks below N x 1e-6). FM004 compares a fitted slope with a declared
  tolerance. Symbolic, high-precision and engine checks (KN, SP, FM005, HP, EN, RT) are
  exact up to a stated tolerance (digits, or 1e-8 relative in float64): they have no
  false-failure rate. Seeds are fixed, so a run is reproducible bit for bit; each
  statistical row prints the smallest defect it detects with probability 0.95
  (min_detectable_...).

negative controls:
  a claim declared with expect="fail" passes only when its checker rejects it (shown as
  "negative control, must fail"); a crashing check never counts as a rejection.

deprecations:
  a claim in a deprecated form (FM002 on a log-space map since spec 1.1) is checked in its
  meaningful form and listed on stderr; it does not change the exit code.

exit codes:
  0  every check passed (negative controls rejected as declared)
  1  at least one check failed
  2  bad usage: a name that is neither a plugin nor a registered class, a plugin that failed
     to load (its import or hook error is printed), or a bad option
"""


def add_parser(sub: Any) -> None:
    v = sub.add_parser(
        "verify",
        help="run the declared claims of installed plugins",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    v.add_argument("names", nargs="*", metavar="NAME", help="plugin or registered class names (default: all)")
    v.add_argument(
        "--level",
        choices=("quick", "full"),
        default="quick",
        help="quick (default): first dimension, half the redraws, first grid point; full: everything (see above)",
    )
    v.add_argument(
        "--rule", action="append", metavar="RULE", help="only this rule ID (repeatable), e.g. --rule EN001 --rule AT002"
    )
    v.add_argument("--format", choices=("table", "json"), default="table")
    v.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    v.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..verify import run_cli

    return run_cli(args)
