"""A test-only plugin: a small positive random feature map and deliberately wrong
variants used as negative controls by the verification tests."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from kernelattn_core import FeatureMap, hookimpl


class ToyPRF(FeatureMap):
    """Positive random features :math:`\\exp(\\omega^\\top x - |x|^2/2)/\\sqrt{m}` for
    :math:`\\exp(\\langle x, y\\rangle)`, log space. Kept tiny and independent of the prf
    plugin so the core's tests exercise random, log-space maps on their own."""

    name: ClassVar[str] = "toy-prf"
    kernel: ClassVar[str | None] = "softmax"
    unbiased: ClassVar[bool] = True
    positive: ClassVar[bool] = True
    log_space: ClassVar[bool] = True
    default_num_features: ClassVar[int] = 32

    def _build(self, head_dim: int) -> None:
        self.register_buffer("omega", torch.empty(self.num_features, head_dim))

    def _redraw(self, generator: torch.Generator | None) -> None:
        self.omega.copy_(self._draw("normal", tuple(self.omega.shape), self.omega, generator))

    def _feature_dim(self) -> int:
        return self.num_features

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        w = self.omega.to(x.dtype)
        return x @ w.T - 0.5 * (x * x).sum(-1, keepdim=True) - 0.5 * math.log(self.num_features)


class ToyTrig(FeatureMap):
    """Signed trigonometric features (not log space) for the non-log engine path."""

    name: ClassVar[str] = "toy-trig"
    kernel: ClassVar[str | None] = "softmax"
    unbiased: ClassVar[bool] = True
    positive: ClassVar[bool] = False
    default_num_features: ClassVar[int] = 16

    def _build(self, head_dim: int) -> None:
        self.register_buffer("omega", torch.empty(self.num_features, head_dim))

    def _redraw(self, generator: torch.Generator | None) -> None:
        self.omega.copy_(self._draw("normal", tuple(self.omega.shape), self.omega, generator))

    def _feature_dim(self) -> int:
        return 2 * self.num_features

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        u = x @ self.omega.to(x.dtype).T
        scale = (0.5 * (x * x).sum(-1, keepdim=True)).exp() / math.sqrt(self.num_features)
        return torch.cat([u.cos(), u.sin()], -1) * scale


@hookimpl
def kernelattn_feature_maps():  # type: ignore[no-untyped-def]
    return [ToyPRF, ToyTrig]
