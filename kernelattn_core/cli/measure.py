"""Moved to :mod:`kernelattn_core.report.measure` (the report helpers sit at the base layer, below
the library code that uses them); this module re-exports it, private names included, so that
``kernelattn_core.cli.measure`` keeps working."""

from ..report.measure import (  # noqa: F401
    _PeakTensorMemory,
    benchmark_time,
    median_time,
    peak_memory,
)
