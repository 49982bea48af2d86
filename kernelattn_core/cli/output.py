"""Rendering records as a table, CSV or JSON."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from typing import Any


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value == 0 or 1e-3 <= abs(value) < 1e5:
            return f"{value:.4g}"
        return f"{value:.3e}"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_short(_cell(v))}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return ",".join(_cell(v) for v in value)
    return str(value)


def _short(text: str, limit: int = 48) -> str:
    """Long values (symbolic expressions) are cut in tables; JSON keeps them whole."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def table(records: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A plain-text table with a header row."""
    rows = [[_cell(r.get(c)) for c in columns] for r in records]
    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def to_csv(records: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in records:
        writer.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in columns})
    return buffer.getvalue().rstrip("\n")


def to_json(records: Sequence[dict[str, Any]]) -> str:
    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    return json.dumps([clean(r) for r in records], indent=2)
