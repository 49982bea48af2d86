"""Moved to :mod:`kernelattn_core.report.plot` (the report helpers sit at the base layer, below
the library code that uses them); this module re-exports it, private names included, so that
``kernelattn_core.cli.plot`` keeps working."""

from ..report.plot import (  # noqa: F401
    SUFFIXES,
    _finite,
    _lines,
    _plain_ticks,
    _save_no_layout,
    boxplots,
    check_plot_path,
    compare_figure,
    grouped_bars,
    line_panels,
    line_styles,
    pyplot,
    save,
)
