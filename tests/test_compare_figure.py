"""The compare figure's legend shows each estimator in its own colour."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("matplotlib")


def _row(name: str, budget: int | None, err: float, beats: bool | None, time_ms: float = 1.0) -> dict[str, Any]:
    return {
        "estimator": name,
        "regime": "minilm-L0",
        "seq_len": 64,
        "budget": budget,
        "attn_rel_error": err,
        "attn_rel_error_q1": err,
        "attn_rel_error_q3": err,
        "beats_mean_v": beats,
        "time_ms": time_ms,
    }


def test_the_legend_draws_an_estimator_in_its_colour_not_its_first_panels_grey(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``prf`` loses to mean-v in the first panel (greyed there): the legend showed it grey
    while the time panel drew it in colour, so no line matched its entry."""
    from matplotlib.colors import to_rgba

    from kernelattn_core.report import plot

    records = [
        _row("baseline:mean-v", None, 0.5, None),
        _row("prf", 16, 0.9, False),
        _row("prf", 32, 0.8, False),
        _row("elu", None, 0.4, True),
    ]
    figures: list[Any] = []
    monkeypatch.setattr(plot, "_save_no_layout", lambda fig, path: figures.append(fig) or path)
    plot.compare_figure(records, tmp_path / "c.png")
    (fig,) = figures
    (legend,) = fig.legends
    by_label = {t.get_text(): h for t, h in zip(legend.get_texts(), legend.legend_handles)}
    colour = plot.line_styles(["baseline:mean-v", "prf", "elu"])["prf"]["color"]
    assert to_rgba(by_label["prf"].get_color()) == to_rgba(colour) != to_rgba("0.78")
    panel = fig.axes[0]
    assert any(to_rgba(line.get_color()) == to_rgba("0.78") for line in panel.get_lines())  # the panel still greys it
    assert "does not beat mean-v" in legend.get_title().get_text()
