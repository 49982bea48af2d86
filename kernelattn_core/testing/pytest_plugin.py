"""pytest plugin of kernelattn (registered through the ``pytest11`` entry point).

Adds the ``--kernelattn-level`` option read by the conformance kit.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kernelattn")
    group.addoption(
        "--kernelattn-level",
        choices=("quick", "full"),
        default="quick",
        help="level of the kernelattn claim checks run by the conformance kit (default: quick)",
    )
