"""The plugin specification's version and its deprecation policy (``spec/plugins.rst``).

The core provides :data:`~kernelattn_core.hookspecs.SPEC_VERSION`; a plugin states the
version it was written against (``KERNELATTN_SPEC`` beside its hooks, ``"1.0"`` when
absent) and the registry loads it when the major versions agree and its minor version
is not newer.

**Deprecation policy.** A claim whose stated form became vacuous (it can no longer fail
on some classes) is not turned into an error: from the minor version that deprecates
it, it **warns** (:class:`ClaimDeprecationWarning`, and a ``deprecated`` entry in the
result's numbers) and is checked in its **meaningful form** for one minor version; only
the version after that may refuse it, and then with a result that says why, never a
crash. :data:`DEPRECATIONS` lists every such case.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..hookspecs import SPEC_VERSION

#: what each published version of the spec added or changed (newest last)
SPEC_HISTORY: dict[str, str] = {
    "1.0": "hooks, interface contracts IF001-IF044, claims FM001-FM005, KN001-KN003, SP001, AT001, AT002, HP001",
    "1.1": (
        "KN004-KN006; claims read the runtime object (SP001 runtime law, FM005 derive(feature_map)); "
        "expect='fail' negative controls; option grids; engine claims EN001-EN003 (implied for every "
        "estimator and feature map); RT001 runtime identities; AT002 as a rate (extrapolated limit and "
        "slope over >= 4 budgets); KERNELATTN_SPEC; FM002 on a log-space map deprecated"
    ),
}


class ClaimDeprecationWarning(DeprecationWarning):
    """A declared claim uses a deprecated form; it is checked in its meaningful form."""


def version_tuple(version: str) -> tuple[int, int]:
    """``"1.1"`` -> ``(1, 1)``."""
    major, minor = version.split(".")
    return int(major), int(minor)


@dataclass(frozen=True)
class Deprecation:
    """One deprecated claim form.

    Attributes
    ----------
    rule : str
        The rule ID.
    where : str
        On which classes the form is vacuous.
    since : str
        Spec version that deprecated it (it warns from there).
    removed_in : str
        First spec version that may refuse it.
    meaningful : str
        What is checked instead while it warns.
    applies : callable
        ``(entry, claim) -> bool``.
    """

    rule: str
    where: str
    since: str
    removed_in: str
    meaningful: str
    applies: Callable[[Any, Any], bool]

    def message(self, target: str) -> str:
        return (
            f"{self.rule} {self.where} is deprecated since plugin spec {self.since} ({target}): the claim as stated "
            f"cannot fail there; it is checked as '{self.meaningful}' and will be refused from spec "
            f"{self.removed_in}; remove it from the class's claims"
        )

    @property
    def removed(self) -> bool:
        """Whether the core's spec version refuses the form."""
        return version_tuple(SPEC_VERSION) >= version_tuple(self.removed_in)


def _fm002_on_log_space(entry: Any, claim: Any) -> bool:
    return getattr(claim, "rule", "") == "FM002" and bool(getattr(entry.cls, "log_space", False))


DEPRECATIONS: tuple[Deprecation, ...] = (
    Deprecation(
        rule="FM002",
        where="on a log-space map",
        since="1.1",
        removed_in="1.2",
        meaningful="every log-feature is finite over the declared range and draws",
        applies=_fm002_on_log_space,
    ),
)


def deprecation_of(entry: Any, claim: Any) -> Deprecation | None:
    """The deprecation that applies to ``claim`` on the class of ``entry``, if any."""
    return next((d for d in DEPRECATIONS if d.applies(entry, claim)), None)


def warn_deprecated(deprecation: Deprecation, target: str) -> None:
    """Emit the :class:`ClaimDeprecationWarning` of a deprecated claim on ``target``."""
    warnings.warn(deprecation.message(target), ClaimDeprecationWarning, stacklevel=3)


__all__ = [
    "DEPRECATIONS",
    "SPEC_HISTORY",
    "SPEC_VERSION",
    "ClaimDeprecationWarning",
    "Deprecation",
    "deprecation_of",
    "version_tuple",
    "warn_deprecated",
]
