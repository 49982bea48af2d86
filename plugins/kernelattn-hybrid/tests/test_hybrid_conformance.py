"""The core conformance kit on every class this plugin registers (claims at the quick level)."""

from kernelattn_core.testing import conformance_tests

test_conformance = conformance_tests("hybrid")
