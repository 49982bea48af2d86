"""scripts/fit_generalisation.py (the overfitting experiment of docs/real_models.rst): its
variant syntax and the L2-SP term the fit adds with ``anchor``. The experiment itself loads
MiniLM and runs minutes: not in CI."""

from __future__ import annotations

import pytest
import torch


def test_variants_change_one_setting_each_and_refuse_unknown_ones(script_module) -> None:  # type: ignore[no-untyped-def]
    script = script_module("fit_generalisation")
    assert script.parse_variant("steps=600") == {"steps": 600, "rows": 96, "lr": 0.02, "passages": 0, "anchor": 0.0}
    v = script.parse_variant("steps=1200:anchor=1e-4")
    assert v["steps"] == 1200 and v["anchor"] == pytest.approx(1e-4) and v["rows"] == 96
    with pytest.raises(SystemExit, match="unknown setting 'epochs'"):
        script.parse_variant("epochs=3")


def test_anchor_penalty_is_the_squared_distance_to_the_start() -> None:
    from kernelattn_core.convert.distill import anchor_penalty

    p, p0 = torch.tensor([1.0, 3.0]), torch.tensor([0.0, 1.0])
    q, q0 = torch.tensor([[2.0]]), torch.tensor([[-1.0]])
    assert float(anchor_penalty([p, q], [p0, q0])) == pytest.approx(1.0 + 4.0 + 9.0)
    with pytest.raises(ValueError):  # a parameter without its start is an error, not dropped
        anchor_penalty([p, q], [p0])
