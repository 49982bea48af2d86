"""``kernelattn choose``: which estimator for which need, from results one has measured."""

from __future__ import annotations

import argparse
import sys
from typing import Any

DESCRIPTION = """\
Pick estimators by need from results you have measured (docs/choosing.rst shows the
picks of the package's own measurements):

  kernelattn tasks --preset seeds --output seeds.json
  kernelattn compare --workload minilm --budgets 64 128 --output minilm.json
  kernelattn choose --tasks seeds.json --compare minilm.json

Each need has a stated rule (printed with its picks): recall from scratch (the best linear
estimators on mqar and induction, among those that beat the floor), classifying whole
sequences (those within one standard error of the best on listops), replacing a pretrained
model's attention (the --conversion report with the lowest worst-layer error), approximating
real attention unfitted (the lowest mean MiniLM error among those that beat the mean of V on
every layer) and what to avoid for recall (at the floor on mqar and selective-copy). A need
whose results are not given says "not measured". --table estimators shows every estimator
with what the registry declares it can do; --table budgets what more features buy (give
--zoology, a kernelattn tasks --preset zoology result)."""

TABLES = ("picks", "estimators", "budgets")


def add_parser(sub: Any) -> None:
    from ..report.output import add_output_arguments

    p = sub.add_parser(
        "choose",
        help="pick estimators by need from measured tasks, compare and convert results",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tasks", metavar="FILE", help="a kernelattn tasks --output json (one budget)")
    p.add_argument("--compare", metavar="FILE", help="a kernelattn compare --workload minilm --output json")
    p.add_argument("--zoology", metavar="FILE", help="a kernelattn tasks json over several budgets (--table budgets)")
    p.add_argument(
        "--conversion",
        metavar="FILE",
        action="append",
        default=[],
        help="a kernelattn convert --format json report (repeatable)",
    )
    p.add_argument("--table", choices=TABLES, default="picks", help="which table to write (default: picks)")
    add_output_arguments(p)
    p.set_defaults(func=run)


def _picks_text(header: list[str], rows: list[list[str]]) -> str:
    """The picks as a block per need (their rules and figures are sentences, not cells)."""
    lines = []
    for need, rule, picks, figures in rows:
        lines += [f"{need}:", f"  picks    {picks}", f"  rule     {rule}", f"  figures  {figures}", ""]
    return "\n".join(lines).rstrip()


def run(args: argparse.Namespace) -> int:
    from ..errors import InputError
    from ..report.output import check_output_path, emit, resolve_format
    from ..report.plot import check_plot_path
    from ..tasks.choose import choose, conversion_summary, figure, read_results

    if not (args.tasks or args.compare or args.zoology or args.conversion):
        raise InputError("choose: expected at least one of --tasks, --compare, --zoology, --conversion; got none")
    check_plot_path(args.plot)
    check_output_path("--output", args.output)
    tasks = read_results(args.tasks, "--tasks", "tasks") if args.tasks else []
    compare = read_results(args.compare, "--compare", "compare") if args.compare else []
    zoology = read_results(args.zoology, "--zoology", "tasks") if args.zoology else []
    fitted = [
        conversion_summary(read_results(f, "--conversion", "convert"), f, "--conversion") for f in args.conversion
    ]
    header, rows = choose(tasks, compare, zoology, fitted)[args.table]
    fmt = resolve_format(args.format, args.output)
    if fmt == "table" and args.table == "picks" and not args.output:
        print(_picks_text(header, rows))
    else:
        cells = (lambda row: [_typed(c) for c in row]) if fmt == "json" else list
        emit([dict(zip(header, cells(row))) for row in rows], header, fmt, args.output)
    if args.plot:
        print(f"figure written to {figure(tasks, compare, args.plot)}", file=sys.stderr)
    return 0


def _typed(cell: str) -> str | float | bool | None:
    """A table cell as JSON reads best: ``-`` null, ``yes``/``no`` booleans, numbers as numbers."""
    if cell == "-":
        return None
    if cell in ("yes", "no"):
        return cell == "yes"
    try:
        return float(cell)
    except ValueError:
        return cell
