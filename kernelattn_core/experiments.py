"""Experiments that plugins contribute to ``kernelattn experiment NAME``.

An experiment reproduces a table or figure of a paper at CPU scale and prints a
table. Plugins return :class:`Experiment` records from the
``kernelattn_experiments`` hook.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Experiment:
    """One runnable experiment.

    Attributes
    ----------
    name : str
        Unique name (lower case, digits, ``-``), e.g. ``"cexp-mse"``.
    help : str
        One line shown by ``kernelattn experiment --help``.
    add_arguments : callable
        ``(parser) -> None``: adds the experiment's options.
    run : callable
        ``(args) -> int``: runs it, prints its table to stdout, returns an exit code.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
