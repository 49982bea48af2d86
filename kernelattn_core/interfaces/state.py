"""Decoding states that know their owner.

A decoding ``step`` returns a state (the running sums of feature-map attention, the gated
sums of ``rfa-gate``, the key-value cache of :class:`~kernelattn_core.KernelAttention`)
that only the estimator which made it can continue. Each state records a
:class:`StateOwner` (the estimator's class, the options that shape the state, the batch
size, the number of heads and the widths), and ``step`` refuses any other state with an
:class:`~kernelattn_core.errors.InputError` naming ``state`` and saying what differs,
instead of broadcasting a batch-1 state over a batch of 2, continuing another map's sums
of the same width, or failing deep inside torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from ..errors import InputError
from ..validation import one_position


@dataclass(frozen=True)
class StateOwner:
    """Who made a decoding state, and what shapes it.

    Attributes
    ----------
    estimator : str
        The estimator's class (``"FeatureMapAttention"``, ``"RFAGateAttention"``, ...).
    options : tuple of (str, value)
        The options that give the state its meaning (the feature map, its budget, the
        normaliser, log-space features).
    batch, heads : int
        ``B`` and ``H`` of the inputs that made it.
    widths : tuple of (str, int)
        The state's other widths (feature count ``D``, value width ``d_v``, head
        dimension ``d``).
    """

    estimator: str
    options: tuple[tuple[str, Any], ...]
    batch: int
    heads: int
    widths: tuple[tuple[str, int], ...]

    def describe(self) -> str:
        """One line: the estimator, its options, ``B``, ``H`` and the widths."""
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options)
        widths = ", ".join(f"{k} = {v}" for k, v in self.widths)
        return f"{self.estimator}({opts}) with B = {self.batch}, H = {self.heads}, {widths}"


def check_state(state: object, kind: type, owner: StateOwner) -> None:
    """Refuse a ``state`` that ``owner`` cannot continue: not a ``kind``, or made by
    another estimator, other shaping options, another batch size, number of heads or
    width. A state without an owner (made by the engine's functions directly, or before
    states knew theirs) is checked by its caller's shape checks only."""
    if not isinstance(state, kind):
        raise InputError(
            f"state: expected None or the {kind.__name__} returned by the previous step of "
            f"{owner.describe()}, got {type(state).__name__}"
        )
    got = getattr(state, "owner", None)
    if got is None or got == owner:
        return
    if not isinstance(got, StateOwner):
        raise InputError(f"state: expected a state made by {owner.describe()}, got one whose owner is {got!r}")
    differ = [f.name for f in fields(StateOwner) if getattr(got, f.name) != getattr(owner, f.name)]
    raise InputError(
        f"state: expected the state of {owner.describe()}, got the state of {got.describe()} "
        f"(differs in {', '.join(differ)}); a state continues only the estimator and inputs that made it"
    )


def continues_state(state: object, owner: StateOwner) -> bool:
    """Whether ``state`` (any decoding state with an ``owner`` field) was stated by ``owner``:
    that object, or an equal one (a cache reorder for beam search restates it), as
    :func:`check_state` accepts. The decoding short paths' test (no exception, no text)."""
    got = getattr(state, "owner", None)
    return got is owner or got == owner


def continued_sums(
    plan: tuple[Any, ...] | None, state: object, state_type: type, q: object, k: object, v: object
) -> tuple[Any, ...] | None:
    """``plan`` when a decoding short path over running sums may continue ``state``, else
    ``None`` (the guarded step checks and reports): ``plan`` is ``(owner, q_shape,
    v_shape, kv_shape, dtype)`` as the estimator's last guarded ``step`` stated it, ``state``
    is of ``state_type`` (sums ``kv``, ``poisoned``, ``owner``), not poisoned, stated by the
    owner or an equal one (:func:`continues_state`), with sums of that shape and dtype, and
    ``q, k, v`` are the one position the plan is for
    (:func:`~kernelattn_core.validation.one_position`). The feature-map estimators' and
    ``rfa-gate``'s short steps share it."""
    if plan is None or type(state) is not state_type or getattr(state, "poisoned", None) is not None:
        return None
    owner, q_shape, v_shape, kv_shape, dtype = plan
    kv = getattr(state, "kv", None)
    if not continues_state(state, owner) or not isinstance(kv, torch.Tensor):
        return None
    if kv.shape != kv_shape or kv.dtype != dtype or not one_position(q, k, v, q_shape, v_shape, dtype):
        return None
    return plan


def check_state_tensor(
    name: str, t: object, shape: tuple[int, ...], device: torch.device, owner: StateOwner, what: str
) -> None:
    """Refuse a state field ``t`` that is not a tensor of ``shape`` on ``device`` (``what``
    says what the dimensions are), naming ``state``."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"state: expected {name} to be a tensor {what}, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise InputError(
            f"state: expected {name} of shape {list(shape)} {what} for {owner.describe()}, got {list(t.shape)}"
        )
    if t.device != device:
        raise InputError(f"state: expected {name} on {device} (the inputs' device), got {t.device}")


# ---------------------------------------------------------------------------- checkpoints
#: the ``state_dict`` key (under the module's prefix) that names the family of a module
FAMILY_KEY = "_family"


def family_marker(family: str) -> torch.Tensor:
    """The ``state_dict`` entry naming ``family``: its UTF-8 bytes as a uint8 tensor (a
    tensor, so that any tensor-only format, safetensors included, can save it)."""
    return torch.tensor(list(family.encode()), dtype=torch.uint8)


def add_family_marker(module: torch.nn.Module) -> None:
    """Make ``module``'s ``state_dict`` name its family (``module.state_family()``, a
    string such as the registry name) and its ``load_state_dict`` refuse another family's
    checkpoint with an :class:`~kernelattn_core.errors.InputError` naming both. A
    checkpoint without the entry (saved before modules named their family) loads as
    before. The hooks are module-level functions, so the module still pickles."""
    module.register_state_dict_post_hook(_put_family)
    module.register_load_state_dict_pre_hook(_check_family)


def _put_family(module: Any, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    state_dict[prefix + FAMILY_KEY] = family_marker(module.state_family())


def _check_family(module: Any, state_dict: dict, prefix: str, *args: Any) -> None:
    saved = state_dict.pop(prefix + FAMILY_KEY, None)  # load_state_dict works on a copy
    if saved is None:
        return
    mine = module.state_family()
    try:
        theirs = bytes(saved.to(torch.uint8).flatten().tolist()).decode()
    except (AttributeError, TypeError, ValueError, UnicodeDecodeError):
        theirs = repr(saved)
    if theirs != mine:
        where = f" (keys under {prefix!r})" if prefix else ""
        raise InputError(
            f"state_dict: a checkpoint of {theirs!r}{where} cannot be loaded into {mine!r}: another family's "
            f"draws and parameters would be read as this one's; load it into a {theirs!r} module, or drop "
            "those keys to keep this module's own state"
        )
