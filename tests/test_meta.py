"""Meta-tests: every hook is tested and documented with its exact name, every claim
type has a checker, a rule ID in spec/ and a negative control."""

from __future__ import annotations

import inspect
from pathlib import Path

from kernelattn_core import claims, hookspecs
from kernelattn_core.verify import _checkers

ROOT = Path(__file__).resolve().parents[1]
HOOKS = [name for name, obj in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("kernelattn_")]
CLAIM_TYPES = [
    obj for _, obj in inspect.getmembers(claims, inspect.isclass) if issubclass(obj, claims.Claim) and obj.rule
]


def test_there_are_five_hooks() -> None:
    assert len(HOOKS) == 5


def test_every_hook_is_documented() -> None:
    reference = (ROOT / "docs" / "hooks.rst").read_text()
    spec = (ROOT / "spec" / "plugins.rst").read_text()
    for hook in HOOKS:
        assert f"kernelattn_core.hookspecs.{hook}" in reference, hook
        assert f"``{hook}``" in spec, hook
        assert getattr(hookspecs, hook).__doc__.strip(), hook


def test_every_hook_has_a_test() -> None:
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py") if p.name != "test_meta.py")
    for hook in HOOKS:
        assert hook in tests, f"no test mentions {hook}"


def test_every_claim_type_has_a_checker_a_spec_entry_and_a_negative_control() -> None:
    checkers = _checkers()
    spec = (ROOT / "spec" / "claims.rst").read_text()
    controls = (ROOT / "tests" / "test_verify.py").read_text()
    rules = [c.rule for c in CLAIM_TYPES]
    assert len(rules) == len(set(rules)), "rule IDs must be unique"
    for cls in CLAIM_TYPES:
        assert cls in checkers, cls.__name__
        assert cls.rule in spec and f"``{cls.__name__}``" in spec, cls.rule
        assert cls.rule.lower() in controls.lower(), f"no negative-control test for {cls.rule}"
