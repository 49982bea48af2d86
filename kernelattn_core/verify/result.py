"""The record every check returns: numbers and a verdict, never a bare boolean."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any


@dataclass
class CheckResult:
    """Outcome of one claim check.

    Attributes
    ----------
    rule : str
        Stable rule ID (``FM001`` ...).
    plugin : str
        Plugin that registered the class.
    target : str
        Registry name of the class checked.
    claim : str
        One line saying what was checked.
    numbers : dict
        Named values: estimates, targets, standard errors, z-scores, digits agreed.
    verdict : str
        ``"pass"`` or ``"fail"``.
    """

    rule: str
    plugin: str
    target: str
    claim: str
    numbers: dict[str, Any] = field(default_factory=dict)
    verdict: str = "fail"

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def as_record(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "plugin": self.plugin,
            "target": self.target,
            "claim": self.claim,
            "numbers": self.numbers,
            "verdict": self.verdict,
        }


#: family-wise false-failure rate of every statistical check
FALSE_FAILURE_RATE = 1e-6


def z_threshold(tests: int, rate: float = FALSE_FAILURE_RATE) -> float:
    """Two-sided z threshold so that ``tests`` independent-or-not z-tests together
    fail by chance with probability below ``rate`` (Bonferroni)."""
    return NormalDist().inv_cdf(1 - rate / (2 * max(tests, 1)))


def digits_agreed(value: float, target: float) -> float:
    """Number of significant decimal digits on which ``value`` agrees with ``target``."""
    if value == target:
        return math.inf
    scale = abs(target) if target != 0 else 1.0
    return -math.log10(abs(value - target) / scale)


def verdict(ok: bool) -> str:
    return "pass" if ok else "fail"
