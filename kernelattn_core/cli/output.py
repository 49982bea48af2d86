"""Moved to :mod:`kernelattn_core.report.output` (the report helpers sit at the base layer, below
the library code that uses them); this module re-exports it, private names included, so that
``kernelattn_core.cli.output`` keeps working."""

from ..report.output import (  # noqa: F401
    FORMATS,
    RowStream,
    _cell,
    _short,
    add_output_arguments,
    emit,
    render,
    resolve_format,
    table,
    to_csv,
    to_json,
)
