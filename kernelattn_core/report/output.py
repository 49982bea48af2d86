"""Rendering records as a table, CSV or JSON."""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Sequence
from typing import Any


def _cell(value: Any, spec: str | None = None) -> str:
    """``value`` as a table cell; ``spec`` (a format spec such as ``".3f"``) for a finite float."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if spec is not None and math.isfinite(value):
            return format(value, spec)
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


def table(records: Sequence[dict[str, Any]], columns: Sequence[str], formats: dict[str, str] | None = None) -> str:
    """A plain-text table with a header row; ``formats`` maps a column to the format spec of
    its floats (``{"accuracy": ".3f"}``; other columns: 4 significant digits)."""
    formats = formats or {}
    rows = [[_cell(r.get(c), formats.get(c)) for c in columns] for r in records]
    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def to_csv(records: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in records:
        writer.writerow({c: _csv_cell(r.get(c)) for c in columns})
    return buffer.getvalue().rstrip("\n")


def _csv_cell(value: Any) -> Any:
    """A CSV cell: empty for ``None``, JSON for a dict or a list (not Python's repr, which
    other tools cannot read), the value itself otherwise."""
    if value is None:
        return ""
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, default=str)
    return value


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


FORMATS = ("table", "csv", "json")


def add_output_arguments(parser: Any, *, plot: bool = True) -> None:
    """The flags every results-producing command shares: ``--format``, ``--output``, ``--plot``."""
    parser.add_argument("--format", choices=FORMATS, default="table", help="how results are written (default: table)")
    parser.add_argument(
        "--output",
        metavar="FILE",
        help="write the results to FILE (format from --format, or from a .csv/.json suffix); compare and tasks still "
        "show the table on stdout as rows finish",
    )
    if plot:
        parser.add_argument(
            "--plot",
            metavar="FILE",
            help="also draw the figure to FILE (.png, .svg or .pdf; needs pip install 'kernelattn-core[plot]')",
        )


def resolve_format(fmt: str, output: str | None) -> str:
    """``--format`` as given, except that a default ``table`` follows an ``--output`` suffix."""
    if output and fmt == "table":
        suffix = output.rsplit(".", 1)[-1].lower() if "." in output else ""
        if suffix in ("csv", "json"):
            return suffix
    return fmt


def render(records: Sequence[dict[str, Any]], columns: Sequence[str], fmt: str, *, meta: Any = None) -> str:
    """Records as ``fmt`` text; JSON is ``{"meta": ..., "records": [...]}`` when ``meta`` is given."""
    if fmt == "json":
        return (
            to_json(records)
            if meta is None
            else json.dumps({"meta": meta, "records": json.loads(to_json(records))}, indent=2)
        )
    if fmt == "csv":
        return to_csv(records, columns)
    if fmt == "table":
        return table(records, columns)
    raise ValueError(f"format: expected one of {', '.join(FORMATS)}, got {fmt!r}")


def check_output_path(flag: str, path: str | os.PathLike[str] | None, *, make_folders: bool = True) -> None:
    """Refuse, before any work, an output path that could not be written after it: a
    folder, or a path in an unwritable folder. With ``make_folders`` (what :func:`emit`
    and the figures do: missing folders are created) a path under a file is refused;
    without it (a writer that creates no folder) a folder that does not exist.
    ``flag`` names the argument in the error."""
    if path is None or str(path) == "":
        return
    from pathlib import Path

    from ..errors import InputError

    target = Path(path)
    if target.is_dir():
        raise InputError(f"{flag}: expected a file name, got the folder {str(path)!r}")
    folder = target.parent if str(target.parent) else Path(".")
    if not make_folders:
        if not folder.is_dir():
            raise InputError(f"{flag}: the folder {str(folder)!r} of {str(path)!r} does not exist (create it first)")
    else:
        while not folder.exists() and folder != folder.parent:  # the nearest folder that exists
            folder = folder.parent
        if not folder.is_dir():
            raise InputError(f"{flag}: expected a path in a folder, got {str(path)!r}, under the file {str(folder)!r}")
    if not os.access(folder, os.W_OK):
        raise InputError(f"{flag}: the folder {str(folder)!r} of {str(path)!r} is not writable")


def emit(
    records: Sequence[dict[str, Any]],
    columns: Sequence[str],
    fmt: str,
    output: str | None = None,
    *,
    title: str | None = None,
    meta: Any = None,
    stdout: Any = None,
) -> None:
    """Write records to ``output`` (a file) or to stdout; a table gets ``title`` above it."""
    import sys

    fmt = resolve_format(fmt, output)
    text = render(records, columns, fmt, meta=meta)
    if fmt == "table" and title:
        text = f"{title}\n{text}"
    if output:
        from pathlib import Path

        path = Path(output)
        if path.parent and not path.parent.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n", encoding="utf-8")
        print(f"results written to {path} ({fmt})", file=sys.stderr)
    else:
        print(text, file=stdout if stdout is not None else sys.stdout)


class RowStream:
    """A table printed row by row as results arrive (fixed column widths).

    ``widths`` maps a column to its width; values that do not fit are shown whole.
    ``formats`` maps a column to the format spec of its floats (as for :func:`table`).
    """

    def __init__(
        self,
        columns: Sequence[str],
        widths: dict[str, int] | None = None,
        stream: Any = None,
        formats: dict[str, str] | None = None,
    ) -> None:
        self.columns = list(columns)
        self.formats = dict(formats or {})
        self.widths = {c: max(len(c), (widths or {}).get(c, 10)) for c in self.columns}
        self._stream = stream  # None: sys.stdout at each row (a live progress bar may redirect it)
        self.started = False

    @property
    def stream(self) -> Any:
        import sys

        return self._stream if self._stream is not None else sys.stdout

    def _line(self, cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(self.widths[c]) for c, cell in zip(self.columns, cells)).rstrip()

    def header(self) -> None:
        if not self.started:
            self.started = True
            print(self._line(self.columns), file=self.stream)
            print(self._line(["-" * self.widths[c] for c in self.columns]), file=self.stream, flush=True)

    def row(self, record: dict[str, Any]) -> None:
        self.header()
        cells = [_cell(record.get(c), self.formats.get(c)) for c in self.columns]
        print(self._line(cells), file=self.stream, flush=True)
