"""Moved to :mod:`kernelattn_core.report.progress` (the report helpers sit at the base layer, below
the library code that uses them); this module re-exports it, private names included, so that
``kernelattn_core.cli.progress`` keeps working."""

from ..report.progress import (  # noqa: F401
    Progress,
    progress_wanted,
)
