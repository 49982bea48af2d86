"""Tables of docs/tasks.rst from the JSON that ``nox -s tasks`` writes.

``python docs/tasks_tables.py docs/_static/tasks`` reads ``seeds.json`` and ``zoology.json``
there (whichever exist) and writes the CSV files that the page includes with
``.. csv-table::``: ``seeds_table.csv`` (the papers' Table 2 layout), ``seeds_rows.csv`` and
``zoology_rows.csv`` (one row per task, estimator and budget).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path


def _fmt(value: object, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def seeds_table(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Accuracy (%) per task and time per step relative to exact, one row per estimator."""
    tasks = list(dict.fromkeys(r["task"] for r in records))
    header = ["estimator", *(f"{t} acc" for t in tasks), "avg acc", *(f"{t} time" for t in tasks)]
    rows: dict[str, dict] = {}
    for r in records:
        row = rows.setdefault(r["estimator"], {})
        row[r["task"]] = r
    out = []
    for name, by_task in rows.items():
        accs = [by_task.get(t, {}).get("accuracy") for t in tasks]
        cells = [name]
        for t, a in zip(tasks, accs):
            err = by_task.get(t, {}).get("error")
            cells.append("n/a" if err else _fmt(None if a is None else 100 * a))
        done = [a for a in accs if a is not None]
        cells.append(_fmt(100 * sum(done) / len(done)) if len(done) == len(tasks) else "-")
        cells += [_fmt(by_task.get(t, {}).get("time_vs_exact"), 2) for t in tasks]
        out.append(cells)
    return header, out


ROW_COLUMNS = (
    "task",
    "estimator",
    "budget",
    "accuracy",
    "accuracy_std",
    "learned",
    "steps_to_90",
    "time_per_step_ms",
    "time_vs_exact",
    "peak_mem_mb",
    "train_s",
    "error",
)


def rows_table(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    out = []
    for r in records:
        cells = []
        for c in ROW_COLUMNS:
            v = r.get(c)
            if c in ("accuracy", "accuracy_std") and isinstance(v, float):
                cells.append(f"{v:.3f}")
            elif c == "error" and v:
                cells.append(str(v).split(":")[0])
            else:
                cells.append(_fmt(v, 1 if c != "time_vs_exact" else 2))
        out.append(cells)
    return list(ROW_COLUMNS), out


def write(path: Path, header: list[str], rows: list[list[str]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    print(f"wrote {path}")


def main(argv: list[str]) -> int:
    folder = Path(argv[0] if argv else "docs/_static/tasks")
    for preset in ("seeds", "zoology"):
        src = folder / f"{preset}.json"
        if not src.exists():
            continue
        records = json.loads(src.read_text(encoding="utf-8"))
        if preset == "seeds":
            write(folder / "seeds_table.csv", *seeds_table(records))
        write(folder / f"{preset}_rows.csv", *rows_table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
