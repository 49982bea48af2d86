"""Progress shows on a terminal only (CI logs stay clean), with rich or a plain line."""

from __future__ import annotations

import io
import sys

import pytest

from kernelattn_core.cli.progress import Progress, progress_wanted


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal_unless_forced(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("KERNELATTN_PROGRESS", raising=False)
    assert not progress_wanted(io.StringIO()) and progress_wanted(Terminal())
    assert not progress_wanted(Terminal(), enabled=False)  # --no-progress
    monkeypatch.setenv("KERNELATTN_PROGRESS", "0")
    assert not progress_wanted(Terminal())
    monkeypatch.setenv("KERNELATTN_PROGRESS", "1")
    assert progress_wanted(io.StringIO()) and not progress_wanted(io.StringIO(), enabled=False)


def test_no_output_at_all_in_a_log(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("KERNELATTN_PROGRESS", raising=False)
    log = io.StringIO()
    with Progress(3, "compare", stream=log) as bar:
        for _ in range(3):
            bar.advance("x")
    assert log.getvalue() == ""


def test_plain_line_without_rich(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("KERNELATTN_PROGRESS", raising=False)
    monkeypatch.setitem(sys.modules, "rich.console", None)  # as if rich were not installed
    term = Terminal()
    with Progress(2, "compare", stream=term) as bar:
        bar.advance("first")
        assert "compare [###############...............] 1/2" in term.getvalue() and "first" in term.getvalue()
        bar.advance("second")
    assert "2/2" in term.getvalue()
    term = Terminal()
    with Progress(800, "tasks", stream=term) as bar:
        bar.advance("a whole run", steps=500)  # one move of many steps, one redraw
        assert bar.done == 500 and term.getvalue().count("500/800") == 1 and "499/800" not in term.getvalue()


def test_rich_bar_on_a_terminal(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("rich")
    monkeypatch.delenv("KERNELATTN_PROGRESS", raising=False)
    term = Terminal()
    with Progress(3, "compare", stream=term) as bar:
        for i in range(3):
            bar.advance(f"row{i}")
    assert "compare" in term.getvalue() and "3/3" in term.getvalue()
