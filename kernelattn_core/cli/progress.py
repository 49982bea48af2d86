"""A minimal progress bar on stderr (silent when stderr is not a terminal unless forced)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``with Progress(total, label) as bar: ... bar.advance(note)``."""

    def __init__(self, total: int, label: str, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total, self.label, self.enabled = max(total, 1), label, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.start = time.perf_counter()

    def __enter__(self) -> Progress:
        self._draw("")
        return self

    def advance(self, note: str = "") -> None:
        self.done += 1
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
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
