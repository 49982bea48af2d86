"""The README's Python blocks run as pasted (in order, one namespace per block)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_python_blocks():
    assert BLOCKS, "README.md: no ```python block found (the pattern or the README changed)"


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_block_runs_as_pasted(i, capsys):
    torch.manual_seed(0)
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(BLOCKS[i], f"README.md block {i}", "exec"), namespace)
    if "report" in namespace:  # the distillation block: one fitted layer per encoder layer, each better
        report = namespace["report"]
        assert capsys.readouterr().out.strip(), "the block prints its report"
        assert len(report.layers) == len(namespace["teacher"].layers)
        for layer in report.layers:
            assert layer.parameters > 0 and layer.loss_after < layer.loss_before, layer
        # the converted model runs and differs from the teacher by the estimator's error only
        x = namespace["batches"][0]
        with torch.no_grad():
            gap = (namespace["student"](x) - namespace["teacher"](x)).norm() / namespace["teacher"](x).norm()
        assert 0 < float(gap) < 0.5
