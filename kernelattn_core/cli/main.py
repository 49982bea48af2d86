"""Entry point of the ``kernelattn`` console script."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..api import list_plugins
from .output import table, to_csv, to_json


def _cmd_plugins(args: argparse.Namespace) -> int:
    plugins = list_plugins()
    if args.format == "json":
        print(to_json(plugins))
        return 0
    rows = []
    for p in plugins:
        for c in p["classes"]:
            flags = {k: v for k, v in c.items() if k not in {"name", "kind", "class"}}
            rows.append(
                {
                    "plugin": p["plugin"],
                    "distribution": p["distribution"],
                    "version": p["version"],
                    "kind": c["kind"],
                    "name": c["name"],
                    "flags": flags,
                }
            )
        for err in p["errors"]:
            rows.append({"plugin": p["plugin"], "distribution": p["distribution"], "kind": "ERROR", "flags": err})
    print(table(rows, ("plugin", "distribution", "version", "kind", "name", "flags")))
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from .compare import COLUMNS, REGIMES, run_compare

    regimes = list(REGIMES) if args.regime == "all" else [args.regime]
    records = run_compare(
        args.estimators or None,
        args.budgets,
        seq_len=args.seq_len,
        causal=args.causal,
        seeds=args.seeds,
        regimes=regimes,
        progress=not args.no_progress,
        repeats=args.repeats,
    )
    if args.format == "json":
        print(to_json(records))
    elif args.format == "csv":
        print(to_csv(records, [*COLUMNS[:-1], "seq_len", "causal", "kernel", "error"]))
    else:
        print(table(records, COLUMNS))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kernelattn", description="Kernelized and random-feature attention.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list plugins, their classes and capability flags")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.set_defaults(func=_cmd_plugins)

    c = sub.add_parser("compare", help="compare every installed estimator on a synthetic workload")
    c.add_argument("--estimators", nargs="+", metavar="NAME", help="registry names (default: all)")
    c.add_argument("--budgets", nargs="+", type=int, default=[16, 64, 256, 1024], metavar="D")
    c.add_argument("--seq-len", type=int, default=256)
    c.add_argument("--causal", action="store_true")
    c.add_argument("--seeds", nargs="+", type=int, default=[0])
    c.add_argument("--regime", choices=("all", "unit", "gauss-0.5", "gauss-1.0"), default="all")
    c.add_argument("--repeats", type=int, default=3, help="timed repeats per configuration (median)")
    c.add_argument("--format", choices=("table", "csv", "json"), default="table")
    c.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    c.set_defaults(func=_cmd_compare)

    from . import verify_cmd

    verify_cmd.add_parser(sub)

    from . import convert_cmd

    convert_cmd.add_parser(sub)

    from ..registry import get_registry

    e = sub.add_parser("experiment", help="run a paper experiment contributed by a plugin")
    esub = e.add_subparsers(dest="experiment", required=True, metavar="NAME")
    for name, exp in sorted(get_registry().experiments().items()):
        ep = esub.add_parser(name, help=exp.help, description=exp.help)
        exp.add_arguments(ep)
        ep.set_defaults(func=exp.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # pragma: no cover
        return 130
    except Exception as exc:
        from ..errors import KernelAttnError

        if isinstance(exc, KernelAttnError):
            print(f"kernelattn: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
