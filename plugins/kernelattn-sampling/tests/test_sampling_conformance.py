"""The core's conformance kit on every class of the plugin (claims included)."""

from kernelattn_core.toolkit import conformance_tests

test_conformance = conformance_tests("sampling")
