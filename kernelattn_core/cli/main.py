"""Entry point of the ``kernelattn`` console script.

Subcommands are listed in :data:`SUBCOMMANDS` (name -> module, one-line help) and
imported only when they run, so ``kernelattn --help`` and ``kernelattn NAME --help``
answer without importing torch or any plugin. A subcommand module defines

* ``add_parser(sub) -> None``: adds its parser to the ``argparse`` subparsers ``sub``
  and sets ``func`` (``(args) -> int``) as a default; keep heavy imports inside ``func``.

Registering a new subcommand is one line in :data:`SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import import_module

#: subcommand -> (module defining ``add_parser(sub)``, one-line help for ``kernelattn --help``)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plugins": ("kernelattn_core.cli.plugins_cmd", "list plugins, their classes, aliases and capability flags"),
    "compare": ("kernelattn_core.cli.compare_cmd", "compare estimators on a synthetic or a real (MiniLM) workload"),
    "verify": ("kernelattn_core.cli.verify_cmd", "run the declared claims of installed plugins"),
    "experiment": ("kernelattn_core.cli.experiment_cmd", "run a paper experiment contributed by a plugin"),
    "tasks": (
        "kernelattn_core.cli.tasks_cmd",
        "train a small model with each estimator on generated tasks (MQAR, ListOps, ...)",
    ),
    "choose": (
        "kernelattn_core.cli.choose_cmd",
        "pick estimators by need from measured tasks, compare and convert results",
    ),
    "convert": (
        "kernelattn_core.cli.convert_cmd",
        "convert a pretrained model's attention, fit it to the original, report per-layer error",
    ),
}


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is not an option)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the subcommand named in ``argv`` is imported (every one when ``None``)."""
    parser = argparse.ArgumentParser(prog="kernelattn", description="Kernelized and random-feature attention.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = None if argv is None else _command(argv)
    for name, (module, help_line) in SUBCOMMANDS.items():
        if argv is None or name == wanted:
            import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=help_line)  # a stub: shows in --help, never parses
    return parser


def _version() -> str:
    """The installed distribution's version (importlib.metadata: nothing heavy imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kernelattn-core")
    except PackageNotFoundError:  # pragma: no cover - a source tree that was never installed
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # pragma: no cover
        return 130
    except BrokenPipeError:  # pragma: no cover - `kernelattn plugins | head`
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except Exception as exc:
        from ..errors import KernelAttnError

        if isinstance(exc, KernelAttnError):
            print(f"kernelattn: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
