"""What a backend raises and reads when its kernels cannot run a call.

Kept apart from :mod:`kernelattn_core.engine.backends` (which loads the backends) so that
a backend implementation imports these without importing the module that loads it:
no import circle between the backend records and the implementations.
"""

from __future__ import annotations

import contextvars

from ..errors import InputError


class BackendLaunchError(InputError):
    """A backend's kernels could not be launched for a call (out of resources, a compile
    error); the message names the shape. Under automatic selection the engine runs the
    torch backend instead, with a :class:`BackendWarning`."""


class BackendWarning(UserWarning):
    """The chosen backend could not run a call and another one ran it."""


#: whether the backend running now was chosen automatically (it may fall back to torch)
_FALLBACK: contextvars.ContextVar[bool] = contextvars.ContextVar("fallback", default=False)


def fallback_allowed() -> bool:
    """Whether the call being computed may fall back to torch (the backend was chosen
    automatically); a backend reads it in its forward pass, for its backward pass."""
    return _FALLBACK.get()


__all__ = ["BackendLaunchError", "BackendWarning", "fallback_allowed"]
