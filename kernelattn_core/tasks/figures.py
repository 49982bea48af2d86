"""Figures of ``kernelattn tasks --plot``: accuracy against budget per task, and accuracy
against time per training step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..report.plot import _plain_ticks, _save_no_layout, check_plot_path, line_styles, pyplot, save
from .model import NO_MIXING

EXACT = "exact"


def check_output_paths(plot: str | Path | None, output: str | Path | None) -> None:
    """Refuse a bad ``--plot`` path (suffix, matplotlib missing, not writable) or
    ``--output`` path (a folder, under a file) before any training."""
    from ..report.output import check_output_path

    check_output_path("--output", output)
    check_plot_path(plot)


def _ok(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def tasks_figure(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """One panel per task: held-out accuracy against the budget (one line per budgeted
    estimator, error bars = std over seeds), the ceiling (exact, black dashes) and floor (no
    mixing, grey dots), estimators without a budget as thin dashed lines in their colour;
    rows that do not beat the floor are drawn in light grey. A last panel: accuracy against
    time per training step, one marker shape per task, the estimator's colour."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    plt = pyplot()
    tasks = list(dict.fromkeys(r["task"] for r in records))
    names = [r["estimator"] for r in records if r["estimator"] not in (EXACT, NO_MIXING)]
    styles = line_styles(names)
    grey = "0.8"
    cols = len(tasks) + 1
    fig, axes = plt.subplots(1, cols, figsize=(4.6 * cols, 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rows = [r for r in records if r["task"] == task and _ok(r.get("accuracy"))]
        budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
        for name in dict.fromkeys(r["estimator"] for r in rows if r["budget"] is not None):
            pts = sorted(
                (r["budget"], r["accuracy"], r["accuracy_std"] or 0.0, r.get("learned"))
                for r in rows
                if r["estimator"] == name and r["budget"] is not None
            )
            xs, ys, es, learned = zip(*pts)
            style = dict(styles[name])
            if not any(learned):
                style["color"] = grey
            ax.errorbar(xs, ys, yerr=es, ms=4, capsize=2, **style)
        for r in rows:
            if r["estimator"] == EXACT:
                ax.axhline(r["accuracy"], color="black", ls="--", lw=1.3)
            elif r["estimator"] == NO_MIXING:
                ax.axhline(r["accuracy"], color="0.45", ls=":", lw=1.3)
            elif r["budget"] is None:
                color = styles[r["estimator"]]["color"] if r.get("learned") else grey
                ax.axhline(r["accuracy"], color=color, ls=(0, (4, 3)), lw=1)
        if len(budgets) > 1:
            ax.set_xscale("log")
            _plain_ticks(ax, budgets)
        elif budgets:
            ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set(xlabel="budget per query", ylabel="held-out accuracy", title=task, ylim=(-0.02, 1.02))
        ax.grid(True, which="both", alpha=0.3)
    ax = axes[0][-1]
    markers = ("o", "s", "^", "D", "v", "P")
    for i, task in enumerate(tasks):
        rows = [r for r in records if r["task"] == task and _ok(r.get("accuracy")) and _ok(r.get("time_per_step_ms"))]
        for r in rows:
            name = r["estimator"]
            color = "black" if name == EXACT else "0.45" if name == NO_MIXING else styles[name]["color"]
            ax.scatter(r["time_per_step_ms"], r["accuracy"], marker=markers[i % len(markers)], color=color, s=24)
        ax.scatter([], [], marker=markers[i % len(markers)], color="0.3", label=task)
    ax.set(xscale="log", xlabel="time per training step (ms)", ylabel="held-out accuracy", ylim=(-0.02, 1.02))
    ax.set_title("accuracy against time")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, title="task", title_fontsize=7)
    handles = [
        Line2D([], [], color="black", ls="--", label="exact (ceiling)"),
        Line2D([], [], color="0.45", ls=":", label="no mixing (floor)"),
    ]
    handles += [Line2D([], [], ms=4, label=name, **styles[name]) for name in styles]
    handles.append(Line2D([], [], color=grey, label="light grey: does not beat the floor"))
    fig.legend(handles=handles, loc="center right", fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    return _save_no_layout(fig, path)


__all__ = ["check_output_paths", "save", "tasks_figure"]
