"""Normalizers built into the core."""

from __future__ import annotations

from typing import ClassVar

from ..interfaces.normalizer import Normalizer


class RowNormalizer(Normalizer):
    """Plain row normalisation :math:`\\mathrm{num}_i / \\mathrm{den}_i` (the default);
    see :class:`~kernelattn_core.interfaces.Normalizer` for the stabiliser."""

    name: ClassVar[str] = "row"
