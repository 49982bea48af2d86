"""Which target a comparison row is measured against (for ``compare``)."""

from __future__ import annotations

import pytest

from kernelattn_core.claims.targets import measured_targets


@pytest.mark.parametrize(
    ("name", "options", "own", "like"),
    [
        ("softmax", {}, "softmax", True),
        ("prf", {}, "softmax", True),
        ("rff", {}, "gaussian", False),
        ("rmfa", {"kernel": "inv"}, "inv", False),
        ("rmfa", {}, "exp", True),
        ("ra", {}, "softmax", True),
        ("elu", {}, None, False),
    ],
)
def test_measured_targets(name: str, options: dict, own: str | None, like: bool) -> None:  # type: ignore[type-arg]
    t = measured_targets(name, **options)
    assert (t.softmax, t.own_kernel, t.like_for_like) == ("softmax", own, like)
    assert t.label() == ("softmax" if like or own is None else f"softmax | own: {own}")
