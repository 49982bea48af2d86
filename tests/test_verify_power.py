"""AT002's power at full level on every shipped configuration (issue 26: AT002 fails on a
limit bias >= 0.02 at full level).

For every AT002 claim a shipped plugin declares (every grid point), the same estimator
with ``+0.02`` added to every output element (an estimator converging to softmax attention
plus 0.02) must fail the claim's limit test at full level, and the claim must print a
``min_detectable_limit_bias`` of at most 0.02. The claims themselves pass in
``kernelattn verify --level full``; this is their negative control at the size the issue
names. A claim listed in :data:`SHORT` falls short of 0.02 for a stated reason: it must
still fall short (else the list and the docs are out of date) and must catch the limit
bias it is listed with. Marked ``formal``: about two minutes of CPU, run by ``nox -s formal``
(``pytest -m formal tests/test_verify_power.py``), not by the default test run.
"""

from __future__ import annotations

from typing import Any

import pytest

import kernelattn_core as ka
from kernelattn_core.registry import Entry
from kernelattn_core.verify import check_claim, plan
from kernelattn_core.verify.inventory import SHIPPED

pytestmark = pytest.mark.formal

LIMIT_BIAS = 0.02


def _at002() -> list[tuple[Entry, Any]]:
    registry = ka.Registry(autoload=True)
    names = [p.name for p in registry.plugins() if p.name in SHIPPED and p.entries]
    return [(e, c) for e, c in plan(names, registry, "full") if c.rule == "AT002" and c.expect == "pass"]


def _offset(entry: Entry, offset: float) -> Entry:
    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        return entry.cls._attend(self, q, k, v, causal, key_padding_mask) + offset

    cls = type(f"Offset{entry.cls.__name__}", (entry.cls,), {"_attend": _attend})
    return Entry(f"{entry.name}[+{offset}]", entry.kind, cls, entry.plugin)


#: claims whose power at full level falls short of 0.02, why (docs/spec/claims.rst), and
#: the limit bias they do catch
SHORT: dict[str, tuple[str, float]] = {
    "lara": (
        "LARA's proposals are capped at N: its claim runs 2 to 16 proposals at N = 16 with 400 rows each "
        "(power 0.037); more power rejects the honest estimator, whose bias is no power law over these "
        "budgets on every element: 1600 rows at N = 16 (power 0.019) give limit z 7.1 > 5.8 at order 0.4 "
        "and 0.3, N = 64 with 4 or 8 to 64 proposals (power 0.010) limit z 7.7 at order 0.4, 9.1 at 0.5",
        0.05,
    ),
}

CASES = [pytest.param((e, c), id=f"{e.name}-{getattr(c, 'point', 0)}") for e, c in _at002()]


def test_every_shipped_plugin_with_a_consistency_claim_is_covered() -> None:
    assert {e.name for e, _ in _at002()} >= {"rfa-snis", "lara", "sliding-window", "rmfa"}


@pytest.mark.parametrize("case", CASES)
def test_at002_full_level_fails_a_limit_bias_of_0_02(case: tuple[Entry, Any]) -> None:
    entry, claim = case
    good = check_claim(entry, claim, "full")
    sensitivity = {k: v for k, v in good.numbers.items() if k.startswith("min_detectable") or k.startswith("limit")}
    print(f"{entry.name} {dict(claim.options)}: {sensitivity}")  # the figures of docs/spec/claims.rst (pytest -s)
    assert good.verdict == "pass", good
    offset = LIMIT_BIAS
    if entry.name in SHORT:  # documented shortfall: it must still be one (else update SHORT and the docs)
        why, offset = SHORT[entry.name]
        assert LIMIT_BIAS < good.numbers["min_detectable_limit_bias"] <= offset, (why, good.numbers)
    else:
        assert good.numbers["min_detectable_limit_bias"] <= LIMIT_BIAS, good.numbers
    bad = check_claim(_offset(entry, offset), claim, "full")
    assert bad.verdict == "fail" and "limit" in bad.numbers.get("failed", []), bad.numbers
