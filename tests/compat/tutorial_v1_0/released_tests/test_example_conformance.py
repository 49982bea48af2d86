"""The conformance kit on the tutorial plugin: one line gives the whole suite."""

from kernelattn_core.testing import conformance_tests

test_conformance = conformance_tests("example")
