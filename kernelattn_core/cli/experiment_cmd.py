"""``kernelattn experiment NAME``: the paper experiments plugins contribute.

Listing them needs the plugins (they are found through the registry), so unlike the
other subcommands this one imports them to build its parser. Every experiment takes the
shared ``--format {table,csv,json}``, ``--output FILE`` and ``--plot FILE`` flags
(:func:`kernelattn_core.cli.output.add_output_arguments`).
"""

from __future__ import annotations

from typing import Any


def add_parser(sub: Any) -> None:
    from ..registry import get_registry

    experiments = sorted(get_registry().experiments().items())
    e = sub.add_parser(
        "experiment",
        help="run a paper experiment contributed by a plugin",
        description="Paper experiments of the installed plugins. Each writes a table, CSV or JSON "
        "(--format, --output FILE) and its figure (--plot FILE).",
    )
    esub = e.add_subparsers(dest="experiment", required=True, metavar="NAME")
    for name, exp in experiments:
        ep = esub.add_parser(name, help=exp.help, description=exp.help)
        exp.add_arguments(ep)
        ep.set_defaults(func=exp.run)
