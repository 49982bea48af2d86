"""Testing support shipped with the core: the conformance kit for plugin authors."""

from .conformance import Case, conformance_cases, conformance_tests, fuzz_tests

__all__ = ["Case", "conformance_cases", "conformance_tests", "fuzz_tests"]
