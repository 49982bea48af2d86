"""The core conformance kit on every class this plugin registers (claims at the quick level)."""

from kernelattn_core.toolkit import conformance_tests

test_conformance = conformance_tests("hybrid")
