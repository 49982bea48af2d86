"""The conformance kit on the tutorial plugin: one line gives the whole suite."""

from kernelattn_core.toolkit import conformance_tests

test_conformance = conformance_tests("example")

# the reliability fuzz suite (masks with non-finite padding, causality, dtypes, empty
# shapes, replicas, bad inputs), exactly as the core fuzzes its own classes
from kernelattn_core.toolkit import fuzz_tests  # noqa: E402

test_fuzz = fuzz_tests("example")
