"""Reliability fuzzing of every registered name (built from the registry at collection
time, so a newly installed plugin is covered): see :mod:`kernelattn_core.testing.fuzz`
for the properties. A failure names the class and the property."""

from __future__ import annotations

from kernelattn_core.testing.fuzz import fuzz_tests

test_fuzz = fuzz_tests()
