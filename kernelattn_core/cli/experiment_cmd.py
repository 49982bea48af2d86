"""``kernelattn experiment NAME``: the paper experiments plugins contribute.

Experiments are found through the registry, which imports torch and every plugin, so
the parser built for ``kernelattn`` knows no experiment names: it takes ``NAME`` and
the words after it as they are, and the registry is loaded only when an experiment
runs, when ``--list`` asks for the names, or when ``NAME --help`` asks for one
experiment's options. ``kernelattn experiment --help`` therefore answers without
importing torch or any plugin (like ``kernelattn --help``). Every experiment takes the
shared ``--format {table,csv,json}``, ``--output FILE`` and ``--plot FILE`` flags
(:func:`kernelattn_core.report.output.add_output_arguments`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

DESCRIPTION = (
    "Paper experiments of the installed plugins. Each writes a table, CSV or JSON "
    "(--format, --output FILE) and its figure (--plot FILE)."
)
EPILOG = (
    "NAME is an experiment contributed by an installed plugin: 'kernelattn experiment --list' "
    "shows the names, 'kernelattn experiment NAME --help' the options of one."
)


def add_parser(sub: Any) -> None:
    e = sub.add_parser(
        "experiment",
        help="run a paper experiment contributed by a plugin",
        description=DESCRIPTION,
        epilog=EPILOG,
    )
    e.add_argument("--list", action="store_true", help="list the installed experiments (imports the plugins)")
    e.add_argument("experiment", nargs="?", metavar="NAME", help="the experiment to run")
    e.add_argument("options", nargs=argparse.REMAINDER, metavar="...", help="the experiment's options")
    e.set_defaults(func=lambda args: run(args, e))


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """List the experiments, or parse ``NAME``'s options with its own parser and run it."""
    from ..registry import get_registry

    experiments = get_registry().experiments()
    if args.list:
        if args.experiment is not None:
            parser.error("--list takes no NAME")
        width = max((len(name) for name in experiments), default=0)
        for name, exp in sorted(experiments.items()):
            print(f"{name:<{width}}  {exp.help}")
        if not experiments:
            print("no experiments: no installed plugin contributes one", file=sys.stderr)
        return 0
    if args.experiment is None:
        parser.error("the following arguments are required: NAME ('kernelattn experiment --list' shows the names)")
    exp = experiments.get(args.experiment)
    if exp is None:
        known = ", ".join(repr(name) for name in sorted(experiments)) or "none installed"
        parser.error(f"argument NAME: invalid choice: {args.experiment!r} (choose from {known})")
    ep = argparse.ArgumentParser(prog=f"{parser.prog} {exp.name}", description=exp.help)
    exp.add_arguments(ep)
    options = ep.parse_args(args.options)
    options.command, options.experiment = args.command, exp.name
    return int(exp.run(options) or 0)
