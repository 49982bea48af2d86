"""Exception and warning types raised by kernelattn.

Every error raised on bad user input names the argument, what was expected and
what came, so that the message alone is enough to fix the call.
"""

from __future__ import annotations


class KernelAttnError(Exception):
    """Base class of every kernelattn error."""


class InputError(KernelAttnError, ValueError):
    """An argument has the wrong shape, dtype, device or value.

    Subclasses :class:`ValueError` so that generic ``except ValueError`` code
    keeps working.
    """


class DomainError(InputError):
    """An input lies outside the domain of a kernel (for example ``|t| >= 1``
    for a kernel whose Maclaurin series has radius of convergence 1)."""


class PluginError(KernelAttnError):
    """A plugin registered a class that breaks the plugin specification
    (duplicate registry name, missing interface, bad capability data)."""


class UnknownNameError(KernelAttnError, KeyError):
    """A registry name was not found; the message lists the available names."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep it readable
        return str(self.args[0]) if self.args else ""


class ReplayError(KernelAttnError, RuntimeError):
    """The recompute of an activation checkpoint cannot tell which forward call it replays
    while the pending calls of the same layer used different random draws (or data-adapted
    statistics), so any choice could give the gradient of other draws."""


class PluginWarning(UserWarning):
    """A plugin failed to load or registered a bad class; it was skipped and
    every other plugin keeps working."""
