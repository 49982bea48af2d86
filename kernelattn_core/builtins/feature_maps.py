"""Feature maps built into the core."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from ..interfaces.feature_map import FeatureMap


class EluFeatureMap(FeatureMap):
    """The deterministic map of linear transformers (Katharopoulos et al., 2020):

    .. math:: \\phi(x) = \\mathrm{elu}(x) + 1 =
              \\begin{cases} x + 1 & x > 0 \\\\ e^{x} & x \\le 0 \\end{cases}

    applied elementwise, so :math:`D = d` and :math:`\\phi > 0`. It targets no
    kernel exactly (``kernel = None``), draws nothing, and ignores ``num_features``.
    This is the LinearElu baseline of "On Learning the Transformer Kernel"; that
    paper writes :math:`\\max(x + 1, e^x)`, which is wrong (it equals :math:`e^x` for
    every :math:`x`, since :math:`e^x \\ge 1 + x`); the package implements
    :math:`\\mathrm{elu}(x) + 1` and a regression test pins the difference.

    Examples
    --------
    >>> import torch
    >>> EluFeatureMap(head_dim=2).query(torch.tensor([[1.0, -1.0]]))
    tensor([[2.0000, 0.3679]])
    """

    name: ClassVar[str] = "elu"
    aliases: ClassVar[tuple[str, ...]] = ("linear-elu",)
    kernel: ClassVar[str | None] = None
    unbiased: ClassVar[bool] = False
    positive: ClassVar[bool] = True
    learnable: ClassVar[bool] = False
    random: ClassVar[bool] = False
    has_budget: ClassVar[bool] = False

    def _feature_dim(self) -> int:
        assert self.head_dim is not None
        return self.head_dim

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        return F.elu(x) + 1.0
