"""Which target an attention row is measured against (spec ``IF001``, ``IF002``).

Every estimator's output is compared with **softmax attention** (the scaling
convention ``IF001``). An estimator built on another kernel (a Gaussian ``rff``, an
``inv`` random Maclaurin map, a learned spectral mixture) estimates attention with
*its own* kernel, :math:`\\sum_j K(q, k_j) v_j / \\sum_j K(q, k_j)`; its error against
softmax mixes estimation error with the kernel's own approximation error. Only its
error against its own kernel measures the estimator. :func:`measured_targets` says,
for a registered name and options, both targets so that a comparison table can show
rows like for like.

(Formerly ``kernelattn_core.claims.targets``, which still resolves to this module: building
an estimator from a name is the checkers' business, not the claims'.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Targets:
    """The targets of one comparison row.

    Attributes
    ----------
    softmax : str
        Always ``"softmax"``: the common reference of every row.
    own_kernel : str or None
        Registry name (or repr) of the kernel the estimator estimates attention with;
        ``None`` when unknown (a deterministic map, or an estimator that declares none).
    like_for_like : bool
        Whether the row's error against softmax measures the estimator alone (its
        own kernel is the softmax kernel).
    """

    softmax: str
    own_kernel: str | None
    like_for_like: bool

    def label(self) -> str:
        """A short column label: ``softmax`` or ``softmax | own: <kernel>``."""
        if self.like_for_like or self.own_kernel is None:
            return "softmax"
        return f"softmax | own: {self.own_kernel}"


_SOFTMAX_NAMES = {"softmax", "exp", "trigh", "spectral-prf"}  # e^{q.k} (trigh = sinh + cosh = exp)


def _kernel_name(kernel: Any) -> str:
    return str(getattr(kernel, "name", None) or getattr(kernel, "label", None) or type(kernel).__name__)


def measured_targets(name: str, **options: Any) -> Targets:
    """The targets a comparison row of estimator ``name`` (built with ``options``) is
    measured against.

    The own kernel is read from the built object: an estimator's ``kernel`` attribute
    (exact attention), or its feature map's ``target_kernel()`` (feature-map
    attention and the plugins' estimators that wrap a map). ``spectral-prf`` with its
    default parameters and ``exp``/``trigh`` are the softmax kernel. An estimator with
    neither (``ra``, ``lara``) samples softmax attention itself. A map without a
    declared target (``elu``) has no own kernel: its rows measure an approximation, not
    an estimator.

    Examples
    --------
    >>> measured_targets("softmax").label()
    'softmax'
    """
    from ..api import create  # same layer: verify/ sits beside the top-level API
    from ..registry import target_kernel_name

    est = create(name, **options)
    kernel = getattr(est, "kernel", None)
    fm = getattr(est, "feature_map", None)
    if (kernel is None or isinstance(kernel, str)) and fm is not None:
        try:
            kernel = fm.target_kernel()
        except Exception:
            kernel = target_kernel_name(fm)  # either form: kernel = "name" or target_kernel_class
    if kernel is None and fm is None:
        # no kernel and no feature map: a sampling estimator of softmax attention itself (IF001)
        return Targets("softmax", "softmax", True)
    if kernel is None:  # a map with no declared target (elu, RFA's normalised inputs)
        return Targets("softmax", None, False)
    own = kernel if isinstance(kernel, str) else _kernel_name(kernel)
    return Targets("softmax", own, own in _SOFTMAX_NAMES)


__all__ = ["Targets", "measured_targets"]
