"""Figures of ``kernelattn tasks --plot``: accuracy against budget per task, and accuracy
against time per training step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..cli.plot import _plain_ticks, check_plot_path, line_styles, pyplot, save
from .model import NO_MIXING

EXACT = "exact"


def check_output_paths(plot: str | Path | None, output: str | Path | None) -> None:
    """Refuse a bad ``--plot`` path (suffix, matplotlib missing) before any training."""
    check_plot_path(plot)


def _ok(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def tasks_figure(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """One panel per task: held-out accuracy against the budget (one line per budgeted
    estimator, error bars = std over seeds), the ceiling (exact) and floor (no mixing) as
    horizontal lines, estimators without a budget as short marks at the right; rows that do
    not beat the floor are drawn in grey. A last panel: accuracy against time per step."""
    plt = pyplot()
    tasks = list(dict.fromkeys(r["task"] for r in records))
    styles = line_styles([r["estimator"] for r in records if r["estimator"] not in (EXACT, NO_MIXING)])
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
                style["color"] = "0.75"
            ax.errorbar(xs, ys, yerr=es, ms=4, capsize=2, label=name, **style)
        for r in rows:
            if r["estimator"] == EXACT:
                ax.axhline(r["accuracy"], color="black", ls="--", lw=1.2, label="exact (ceiling)")
            elif r["estimator"] == NO_MIXING:
                ax.axhline(r["accuracy"], color="0.5", ls=":", lw=1.2, label="no mixing (floor)")
            elif r["budget"] is None:
                color = styles[r["estimator"]]["color"] if r.get("learned") else "0.75"
                ax.plot(
                    [1.0],
                    [r["accuracy"]],
                    marker="_",
                    ms=14,
                    mew=2,
                    color=color,
                    transform=ax.get_yaxis_transform(),
                    clip_on=False,
                    label=r["estimator"],
                )
        if budgets:
            ax.set_xscale("log")
            _plain_ticks(ax, budgets)
        ax.set(xlabel="budget per query", ylabel="held-out accuracy", title=task, ylim=(-0.02, 1.02))
        ax.grid(True, which="both", alpha=0.3)
    ax = axes[0][-1]
    markers = ("o", "s", "^", "D", "v", "P")
    for i, task in enumerate(tasks):
        rows = [r for r in records if r["task"] == task and _ok(r.get("accuracy")) and _ok(r.get("time_per_step_ms"))]
        for r in rows:
            color = "black" if r["estimator"] == EXACT else styles.get(r["estimator"], {"color": "0.5"})["color"]
            ax.scatter(r["time_per_step_ms"], r["accuracy"], marker=markers[i % len(markers)], color=color, s=22)
        ax.scatter([], [], marker=markers[i % len(markers)], color="0.3", label=task)
    ax.set(
        xscale="log",
        xlabel="time per training step (ms)",
        ylabel="held-out accuracy",
        title="accuracy against time",
        ylim=(-0.02, 1.02),
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, title="task", title_fontsize=7)
    legend: dict[str, Any] = {}
    for a in axes[0][:-1]:
        for handle, label in zip(*a.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    if legend:
        fig.legend(list(legend.values()), list(legend), loc="center right", fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    return save_no_layout(fig, path)


def save_no_layout(fig: Any, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=120)
    pyplot().close(fig)
    return p


__all__ = ["check_output_paths", "save", "tasks_figure"]
