"""Fixtures of the kernelattn-fourier tests."""

from __future__ import annotations

import pytest
import torch

_empty = torch.empty


def _poisoned_empty(*args, **kwargs):  # type: ignore[no-untyped-def]
    """``torch.empty`` filled with NaN, so a buffer that is never written fails loudly."""
    out = _empty(*args, **kwargs)
    if out.is_floating_point():
        out.fill_(float("nan"))
    return out


@pytest.fixture(autouse=True)
def poison_uninitialised_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "empty", _poisoned_empty)
