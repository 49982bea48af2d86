"""The fuzz suite runs under the derandomised ``kernelattn-ci`` hypothesis profile
(fixed examples, no example database, no deadline) unless ``--hypothesis-profile``
chooses another; ``KERNELATTN_FUZZ_EXAMPLES`` sets the examples per property."""

from kernelattn_core.testing.fuzz import register_profile

register_profile()
