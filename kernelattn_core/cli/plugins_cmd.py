"""``kernelattn plugins``: every plugin, its classes (with aliases) and capability flags."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plugins", help="list plugins, their classes, aliases and capability flags")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")
    p.add_argument("--output", metavar="FILE", help="write to FILE instead of stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..api import list_plugins
    from ..report.output import emit, resolve_format, to_json

    plugins = list_plugins()
    if resolve_format(args.format, args.output) == "json":
        if args.output:
            from pathlib import Path

            Path(args.output).write_text(to_json(plugins) + "\n", encoding="utf-8")
        else:
            print(to_json(plugins))
        return 0
    rows = []
    for p in plugins:
        for c in p["classes"]:
            flags = {k: v for k, v in c.items() if k not in {"name", "kind", "class", "aliases"}}
            rows.append(
                {
                    "plugin": p["plugin"],
                    "distribution": p["distribution"],
                    "version": p["version"],
                    "kind": c["kind"],
                    "name": c["name"],
                    "aliases": ", ".join(c.get("aliases", ())),
                    "flags": flags,
                }
            )
        for err in p["errors"]:
            rows.append({"plugin": p["plugin"], "distribution": p["distribution"], "kind": "ERROR", "flags": err})
    emit(rows, ("plugin", "distribution", "version", "kind", "name", "aliases", "flags"), args.format, args.output)
    return 0
