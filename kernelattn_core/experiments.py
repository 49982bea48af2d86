"""Experiments that plugins contribute to ``kernelattn experiment NAME``.

An experiment reproduces a table or figure of a paper at CPU scale, prints a table
(or writes CSV / JSON, ``--format``, ``--output``) and draws its figure (``--plot``).
Plugins return :class:`Experiment` records from the ``kernelattn_experiments`` hook and
use :func:`add_output_arguments`, :func:`check_plot` and :func:`write_results` so that
every experiment takes the same flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Experiment:
    """One runnable experiment.

    Attributes
    ----------
    name : str
        Unique name (lower case, digits, ``-``), e.g. ``"cexp-mse"``.
    help : str
        One line shown by ``kernelattn experiment --list`` and atop ``kernelattn experiment NAME --help``.
    add_arguments : callable
        ``(parser) -> None``: adds the experiment's options.
    run : callable
        ``(args) -> int``: runs it, writes its results (:func:`write_results`), returns an exit code.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every experiment takes: ``--format {table,csv,json}``, ``--output FILE``, ``--plot FILE``."""
    from .report.output import add_output_arguments as add

    add(parser)


def check_plot(args: argparse.Namespace) -> None:
    """Fail early (before the experiment runs) on a bad ``--plot`` path or missing matplotlib."""
    from .report.plot import check_plot_path

    check_plot_path(getattr(args, "plot", None))


def write_results(
    args: argparse.Namespace,
    records: Sequence[dict[str, Any]],
    columns: Sequence[str],
    *,
    title: str | None = None,
    json_payload: Any = None,
    figure: Callable[[Sequence[dict[str, Any]], Path], Any] | None = None,
) -> None:
    """Write an experiment's results as ``args`` ask (``--format``, ``--output``, ``--plot``).

    Parameters
    ----------
    records, columns
        The rows and the columns of the table / CSV.
    title : str, optional
        A line above the table.
    json_payload : optional
        What ``--format json`` writes (default: the list of records).
    figure : callable, optional
        ``(records, path) -> None`` draws the experiment's figure to ``path``.
    """
    import json
    import sys

    from .report.output import emit, resolve_format

    output = getattr(args, "output", None)
    fmt = resolve_format(getattr(args, "format", "table"), output)
    if fmt == "json" and json_payload is not None:
        text = json.dumps(json_payload, indent=2)
        if output:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
            Path(output).write_text(text + "\n", encoding="utf-8")
            print(f"results written to {output} (json)", file=sys.stderr)
        else:
            print(text)
    else:
        emit(records, columns, fmt, output, title=title)
    plot = getattr(args, "plot", None)
    if plot:
        if figure is None:
            raise ValueError("--plot: this experiment has no figure")
        figure(records, Path(plot))
        print(f"figure written to {plot}", file=sys.stderr)
