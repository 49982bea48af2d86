"""Progress of long commands on stderr.

Shown only when stderr is a terminal (CI logs and pipes stay clean), unless
``KERNELATTN_PROGRESS=1`` forces it; ``KERNELATTN_PROGRESS=0`` or ``enabled=False``
turns it off. With :mod:`rich` installed (``pip install 'kernelattn-core[cli]'``) it is a
rich progress bar with elapsed and remaining time; without it, one line redrawn in place.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO


def progress_wanted(stream: TextIO, enabled: bool = True) -> bool:
    """Whether to draw progress on ``stream``: enabled, and a terminal or forced by the environment."""
    if not enabled:
        return False
    forced = os.environ.get("KERNELATTN_PROGRESS", "").strip().lower()
    if forced in {"0", "false", "no", "off"}:
        return False
    if forced in {"1", "true", "yes", "on"}:
        return True
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """``with Progress(total, label) as bar: ... bar.advance(note)``.

    Parameters
    ----------
    total : int
        Number of steps.
    label : str
        Shown before the bar.
    enabled : bool
        ``False`` draws nothing (``--no-progress``).
    stream : file, optional
        Where to draw (default ``sys.stderr``).
    """

    def __init__(self, total: int, label: str, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total, self.label = max(total, 1), label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = progress_wanted(self.stream, enabled)
        self.done = 0
        self.start = time.perf_counter()
        self._rich: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if self.enabled:
            try:
                from rich.console import Console
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )
                from rich.progress import Progress as RichProgress
            except ImportError:
                self._draw("")
            else:
                self._rich = RichProgress(
                    TextColumn("[bold]{task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    TimeRemainingColumn(),
                    TextColumn("{task.fields[note]}"),
                    console=Console(file=self.stream),
                    transient=True,
                    # rows printed to a terminal go above the bar; stdout sent to a file stays there
                    redirect_stdout=bool(getattr(sys.stdout, "isatty", lambda: False)()),
                    redirect_stderr=False,
                )
                self._rich.start()
                self._task = self._rich.add_task(self.label, total=self.total, note="")
        return self

    def advance(self, note: str = "", steps: int = 1) -> None:
        """``steps`` more steps done (a finished job of many steps moves the bar once)."""
        self.done += steps
        if self._rich is not None:
            self._rich.update(self._task, advance=steps, note=note)
        else:
            self._draw(note)

    def _draw(self, note: str) -> None:
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / self.total)
        elapsed = time.perf_counter() - self.start
        bar = "#" * filled + "." * (width - filled)
        line = f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {note}"
        self.stream.write(line[:120].ljust(120))
        self.stream.flush()

    def __exit__(self, *exc: object) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif self.enabled:
            self.stream.write("\r" + " " * 120 + "\r")
            self.stream.flush()
