"""scripts/fit_generalisation.py (the overfitting experiment of docs/real_models.rst): its
variant syntax and the L2-SP pull it adds to the fit's loss. The experiment itself loads
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


def test_anchor_adds_the_pull_towards_the_start(script_module) -> None:  # type: ignore[no-untyped-def]
    script = script_module("fit_generalisation")
    p, p0 = torch.tensor([1.0, 3.0]), torch.tensor([0.0, 1.0])
    value = script._anchored(2, 5, base=lambda a, b: torch.tensor(float(a * b)), pull=0.5, pairs=((p, p0),))
    assert float(value) == pytest.approx(10.0 + 0.5 * (1.0 + 4.0))
