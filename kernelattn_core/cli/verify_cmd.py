"""``kernelattn verify`` (filled in by the verification framework)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    v = sub.add_parser("verify", help="run the declared claims of installed plugins")
    v.add_argument("names", nargs="*", metavar="NAME", help="plugin or registered class names (default: all)")
    v.add_argument("--level", choices=("quick", "full"), default="quick")
    v.add_argument("--format", choices=("table", "json"), default="table")
    v.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    v.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..verify import run_cli

    return run_cli(args)
