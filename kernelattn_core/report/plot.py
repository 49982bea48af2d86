"""Figures of ``kernelattn compare`` and of the paper experiments (``--plot FILE``).

matplotlib is an optional extra (``pip install 'kernelattn-core[plot]'``), imported only
when a figure is drawn, with the non-interactive ``Agg`` backend. The file type follows the
suffix: ``.png``, ``.svg`` or ``.pdf``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import InputError

SUFFIXES = (".png", ".svg", ".pdf")


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or a clear error naming the extra."""
    try:
        import matplotlib
    except ImportError as err:
        raise InputError(
            "--plot: drawing figures needs matplotlib; install it with pip install 'kernelattn-core[plot]'"
        ) from err
    matplotlib.use("Agg", force=True)
    matplotlib.rcParams["svg.fonttype"] = "none"  # SVG text stays text: searchable, and checkable in tests
    import matplotlib.pyplot as plt

    return plt


def check_plot_path(path: str | Path | None) -> Path | None:
    """The ``--plot`` path, checked before any work is done (suffix, a writable place:
    :func:`~kernelattn_core.report.output.check_output_path`, and matplotlib)."""
    if path is None:
        return None
    from .output import check_output_path

    p = Path(path)
    if p.suffix.lower() not in SUFFIXES:
        raise InputError(f"--plot: expected a file ending in {', '.join(SUFFIXES)}, got {str(path)!r}")
    check_output_path("--plot", p)
    pyplot()
    return p


def save(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` (folders created) and close it."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(p, dpi=120)
    pyplot().close(fig)
    return p


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def _lines(
    ax: Any,
    records: Sequence[dict[str, Any]],
    *,
    group: str,
    x: str,
    y: str,
    band: tuple[str, str] | None = None,
    keep: Callable[[dict[str, Any]], bool] = lambda r: True,
    styles: dict[Any, dict[str, str]] | None = None,
) -> int:
    """One line per value of ``group``: ``y`` against ``x``, skipping missing values; ``band``
    names the columns of a lower and upper value drawn as asymmetric error bars (quartiles)."""
    drawn = 0
    names = list(dict.fromkeys(r[group] for r in records if keep(r)))
    styles = styles if styles is not None else line_styles(names)
    for name in names:
        pts = sorted(
            (
                r[x],
                r[y],
                r[y] - r[band[0]] if band and _finite(r.get(band[0])) else 0.0,
                r[band[1]] - r[y] if band and _finite(r.get(band[1])) else 0.0,
            )
            for r in records
            if r[group] == name and keep(r) and _finite(r.get(x)) and _finite(r.get(y))
        )
        if not pts:
            continue
        xs, ys, lo, hi = zip(*pts)
        ax.errorbar(xs, ys, yerr=(lo, hi) if band else None, ms=4, capsize=2, label=str(name), **styles[name])
        drawn += 1
    return drawn


def line_styles(names: Sequence[Any]) -> dict[Any, dict[str, str]]:
    """A distinct (colour, line style, marker) per name, the same in every panel."""
    dashes, markers = ("-", "--", ":", "-."), ("o", "s", "^", "D", "v", "P")
    return {
        name: {
            "color": f"C{i % 10}",
            "ls": dashes[(i // 10) % len(dashes)],
            "marker": markers[(i // 10) % len(markers)],
        }
        for i, name in enumerate(dict.fromkeys(names))
    }


def _plain_ticks(ax: Any, values: Sequence[float]) -> None:
    """Log x axis labelled at the values run (16, 64, 256 rather than 2 x 10^1)."""
    from matplotlib.ticker import NullFormatter

    ticks = sorted({v for v in values if _finite(v)})
    if ticks:
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())


def compare_figure(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """``compare``: output error against budget (log-log, one panel per regime or layer, IQR bars)
    and forward time against sequence length (against budget when one length was run)."""
    plt = pyplot()
    regimes = list(dict.fromkeys(r["regime"] for r in records))
    lengths = sorted({r["seq_len"] for r in records})
    shown = regimes[:6]
    styles = line_styles([r["estimator"] for r in records])
    fig, axes = plt.subplots(1, len(shown) + 1, figsize=(5.2 * (len(shown) + 1), 4.4), squeeze=False)
    for ax, regime in zip(axes[0], shown):
        n_max = max(r["seq_len"] for r in records if r["regime"] == regime)
        sel = [r for r in records if r["regime"] == regime and r["seq_len"] == n_max and r["budget"] is not None]
        # an estimator that never beats the mean-of-values baseline in this panel is greyed
        losers = {r["estimator"] for r in sel} - {r["estimator"] for r in sel if r.get("beats_mean_v") is not False}
        panel_styles = {name: ({**st, "color": "0.78"} if name in losers else st) for name, st in styles.items()}
        band = ("attn_rel_error_q1", "attn_rel_error_q3")
        _lines(ax, sel, group="estimator", x="budget", y="attn_rel_error", band=band, styles=panel_styles)
        for r in records:  # estimators without a budget (exact attention aside): a horizontal line
            if (
                r["regime"] == regime
                and r["seq_len"] == n_max
                and r["budget"] is None
                and r["estimator"] != "exact"
                and _finite(r["attn_rel_error"])
            ):
                is_base = r["estimator"] == "baseline:mean-v"
                color = "black" if is_base else ("0.78" if r.get("beats_mean_v") is False else "grey")
                ax.axhline(r["attn_rel_error"], ls=":" if is_base else "--", lw=1.4 if is_base else 1, color=color)
                label = "baseline: mean of V (grey: does not beat it)" if is_base else r["estimator"]
                ax.annotate(label, (0.01, r["attn_rel_error"]), xycoords=("axes fraction", "data"), fontsize=7)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="budget per query (feature dimension / samples)",
            ylabel="relative output error",
        )
        _plain_ticks(ax, [r["budget"] for r in sel])
        ax.set_title(f"{regime}, N = {n_max} (median, quartiles over seeds)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    ax = axes[0][-1]
    if len(lengths) > 1:
        b_max = max((r["budget"] for r in records if r["budget"] is not None), default=None)
        keep = lambda r: r["regime"] == regimes[0] and r["budget"] in (None, b_max)  # noqa: E731
        _lines(ax, records, group="estimator", x="seq_len", y="time_ms", keep=keep, styles=styles)
        ax.set(xlabel="sequence length N", title=f"forward time ({regimes[0]}, budget {b_max})")
    else:
        keep = lambda r: r["regime"] == regimes[0] and r["budget"] is not None  # noqa: E731
        _lines(ax, records, group="estimator", x="budget", y="time_ms", keep=keep, styles=styles)
        for r in records:
            if r["regime"] == regimes[0] and r["estimator"] == "exact" and _finite(r["time_ms"]):
                ax.axhline(r["time_ms"], ls="--", color="black", lw=1, label="exact")
        ax.set(xlabel="budget", title=f"forward time ({regimes[0]}, N = {lengths[0]})")
    ax.set(xscale="log", yscale="log", ylabel="ms")
    _plain_ticks(ax, [r["seq_len"] if len(lengths) > 1 else r["budget"] for r in records])
    ax.grid(True, which="both", alpha=0.3)
    from matplotlib.lines import Line2D

    legend: dict[str, Any] = {}
    for a in axes[0]:
        for handle, label in zip(*a.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    # an estimator's own style, not the first panel's (there it may be greyed as a loser)
    for label in legend:
        if label in styles:
            legend[label] = Line2D([], [], ms=4, **styles[label])
    handles, labels = list(legend.values()), list(legend)
    if handles:
        fig.legend(
            handles,
            labels,
            loc="center right",
            fontsize=7,
            frameon=False,
            title="light grey in a panel:\ndoes not beat mean-v there",
            title_fontsize=7,
        )
        fig.subplots_adjust(right=0.82)
    fig.tight_layout(rect=(0, 0, 0.84, 1))
    return _save_no_layout(fig, path)


def _save_no_layout(fig: Any, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=120)
    pyplot().close(fig)
    return p


def line_panels(
    records: Sequence[dict[str, Any]],
    path: str | Path,
    *,
    panel: str,
    group: str,
    x: str,
    y: str,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
    logy: bool = False,
) -> Path:
    """One panel per value of ``panel``, one line per value of ``group`` (``y`` against ``x``)."""
    plt = pyplot()
    panels = list(dict.fromkeys(r[panel] for r in records))
    cols = min(len(panels), 3)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)
    for ax, value in zip(axes.flat, panels):
        _lines(ax, [r for r in records if r[panel] == value], group=group, x=x, y=y)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=f"{panel} = {value}")
        if logx:
            ax.set_xscale("log")
        if logy:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, title=group, title_fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    return save(fig, path)


def boxplots(
    groups: dict[str, dict[str, list[float]]], metrics: Sequence[tuple[str, str]], path: str | Path, title: str
) -> Path:
    """One panel per ``(metric, label)``, one box per group (log scale), as in CEXP's Fig. 1."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.8 * len(metrics), 4), squeeze=False)
    names = list(groups)
    for ax, (metric, label) in zip(axes[0], metrics):
        ax.boxplot([groups[n][metric] for n in names], tick_labels=names)
        ax.set(yscale="log", ylabel=label)
        ax.grid(True, axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(title)
    return save(fig, path)


def grouped_bars(
    records: Sequence[dict[str, Any]],
    path: str | Path,
    *,
    x: str,
    group: str,
    values: Sequence[tuple[str, str]],
    title: str,
) -> Path:
    """Grouped bars: one panel per ``(value, label)``, bars of each ``group`` at each ``x``."""
    plt = pyplot()
    xs = list(dict.fromkeys(r[x] for r in records))
    gs = list(dict.fromkeys(r[group] for r in records))
    fig, axes = plt.subplots(1, len(values), figsize=(5.5 * len(values), 4), squeeze=False)
    width = 0.8 / max(len(gs), 1)
    for ax, (value, label) in zip(axes[0], values):
        for j, g in enumerate(gs):
            ys = [next((r[value] for r in records if r[x] == xv and r[group] == g), 0.0) or 0.0 for xv in xs]
            ax.bar([i + j * width for i in range(len(xs))], ys, width, label=str(g))
        ax.set_xticks([i + width * (len(gs) - 1) / 2 for i in range(len(xs))], [str(v) for v in xs])
        ax.set(xlabel=x, ylabel=label)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return save(fig, path)
