"""The tables and the figure of docs/choosing.rst, from the shipped measurements.

``python docs/choosing_table.py docs/_static`` reads, under the folder given,

* ``tasks/seeds.json`` (``kernelattn tasks --preset seeds``: what a small model learns with
  each estimator, budget 64, seed 0; written by ``nox -s tasks``),
* ``choosing/minilm_compare.json`` (``kernelattn compare --workload minilm --budgets 64 128``:
  the attention-output error of each *unfitted* estimator against the real attention of
  all-MiniLM-L6-v2, layers 0-5, on the shipped English text; written by ``nox -s choosing``),
* ``tasks/zoology.json`` (``kernelattn tasks --preset zoology``: MQAR at budgets 16, 64 and
  256, two seeds) and
* ``convert/minilm_*.json`` (the ``kernelattn convert`` reports of docs/real_models.rst; those
  fitted on the default corpus, ``fit_texts == "fitting"``),

and writes ``choosing/picks.csv``, ``choosing/estimators.csv``, ``choosing/budgets.csv`` and
the figure ``choosing/learn_vs_approximate.png`` with :func:`kernelattn_core.tasks.choose.choose`
(the rules of the picks live there; ``kernelattn choose`` is the same for files of one's own).
A file that is missing leaves its columns and picks empty.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

from kernelattn_core.errors import InputError
from kernelattn_core.tasks.choose import choose, conversion_summary, figure, read_results

#: the figure beside the tables
FIGURE = "learn_vs_approximate.png"
#: the measured files under the folder given, relative to it, and the kind of their records
SOURCES = {"tasks/seeds.json": "tasks", "choosing/minilm_compare.json": "compare", "tasks/zoology.json": "tasks"}


def _records(path: Path, kind: str) -> list[dict[str, Any]]:
    """The records of ``path`` (checked to be of ``kind``), none when it does not exist."""
    return read_results(path, str(path), kind) if path.exists() else []


def _sources(static: Path) -> list[list[dict[str, Any]]]:
    """The records of each file of :data:`SOURCES` under ``static``, read once."""
    return [_records(static / name, kind) for name, kind in SOURCES.items()]


def conversions(static: Path) -> list[dict[str, Any]]:
    """The summaries of the MiniLM conversions shipped in ``convert/`` that were fitted on
    the default fitting corpus (``fit_texts == "fitting"``), each with its file name."""
    out = []
    for path in sorted((static / "convert").glob("minilm_*.json")):
        summary = conversion_summary(_records(path, "convert"), path.name)
        if summary.get("fit_texts") == "fitting":
            out.append(summary)
    return out


def tables(
    static: Path, sources: list[list[dict[str, Any]]] | None = None
) -> dict[str, tuple[list[str], list[list[str]]]]:
    """The three tables from the files under ``static`` (``docs/_static``, or a folder of your
    own laid out the same way; ``sources``: their records if already read), keyed by their
    file names."""
    seeds, compare, zoology = _sources(static) if sources is None else sources
    return {f"{name}.csv": table for name, table in choose(seeds, compare, zoology, conversions(static)).items()}


def write(path: Path, header: list[str], rows: list[list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(header)
        w.writerows(rows)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python docs/choosing_table.py DOCS_STATIC_DIR", file=sys.stderr)
        return 2
    static = Path(argv[0])
    missing = [name for name in SOURCES if not (static / name).exists()]
    if len(missing) == len(SOURCES):
        print(f"{static}: none of {', '.join(SOURCES)} is there", file=sys.stderr)
        return 2
    for name in missing:
        print(f"{static / name} is missing: its columns and picks stay empty", file=sys.stderr)
    sources = _sources(static)
    for name, (header, rows) in tables(static, sources).items():
        write(static / "choosing" / name, header, rows)
        print(f"wrote {static / 'choosing' / name} ({len(rows)} rows)")
    try:
        path = figure(sources[0], sources[1], static / "choosing" / FIGURE)
        print(f"wrote {path}")
    except InputError as err:  # matplotlib missing, or nothing to draw: the tables do not need it
        print(f"no figure: {err}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
