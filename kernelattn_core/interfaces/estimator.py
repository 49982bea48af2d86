"""The :class:`AttentionEstimator` interface: q, k, v to the attention output."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import InputError
from ..validation import check_key_padding_mask, check_qkv, check_scale
from .state import add_family_marker

#: why ``torch.jit.trace`` is refused (its trace would freeze the run-time decisions)
JIT_TRACE = (
    "torch.jit.trace: kernelized attention decides on its input at run time (the quarantine of non-finite "
    "values, the position groups, the chunking), which a trace would freeze for the traced input and "
    "silently apply to others; use torch.compile(model) or torch.export.export(model, args) instead "
    "(both trace the estimators as one graph without data-dependent branches)"
)


class AttentionEstimator(nn.Module, ABC):
    """Abstract attention estimator.

    Maps ``q [B, H, N, d]``, ``k [B, H, M, d]``, ``v [B, H, M, dv]`` to ``[B, H, N, dv]``.

    **Scaling convention.** Every estimator targets softmax attention with the usual
    :math:`1/\\sqrt{d}`, applied as :math:`d^{-1/4}` on each of q and k before the
    kernel or features are evaluated, so the target is

    .. math:: \\mathrm{Att}(q, K, V)_i = \\sum_j
              \\frac{K(d^{-1/4} q_i, d^{-1/4} k_j)}{\\sum_{j'} K(d^{-1/4} q_i, d^{-1/4} k_{j'})} v_j .

    ``scale`` overrides the product scale :math:`1/\\sqrt{d}` (each side gets
    :math:`\\sqrt{\\text{scale}}`).

    **Masks.** ``key_padding_mask [B, M]`` is boolean with ``True`` marking a padded
    key (the :class:`torch.nn.MultiheadAttention` convention). Padded keys leave both
    the numerator and the normaliser. A query whose keys are all masked gets zeros.
    ``causal=True`` needs ``N == M``: query ``i`` sees keys ``j <= i``. A value at a
    padded or future position never reaches an output, whatever it is (NaN and inf
    included): such positions are removed with ``where``/``masked_fill``, never
    multiplied by zero.

    **Empty shapes.** ``B = 0``, ``H = 0``, ``N = 0`` or ``M = 0`` give an output of
    shape ``[B, H, N, dv]`` without calling the estimator (zeros when ``M = 0``: a
    query with no key gets zeros), as :func:`torch.nn.functional.scaled_dot_product_attention`
    does; it stays connected to the autograd graph (zero gradients).

    The public :meth:`forward` validates and scales, then calls :meth:`_attend`
    (template method).

    Attributes
    ----------
    name : str
        Unique registry name.
    unbiased : bool
        Whether the output is an unbiased estimate of softmax attention (for example
        randomized attention). Self-normalised estimators are not.
    consistent : bool
        Whether error and bias vanish as the budget ``num_features`` grows.
    supports_causal : bool
        Whether ``causal=True`` is implemented.
    supports_noncausal : bool
        Whether ``causal=False`` is implemented (``False``: causal only).
    random : bool
        Whether the output depends on random draws.
    has_budget : bool
        Whether ``num_features`` is meaningful.
    linear : bool
        Whether time and memory are linear in the sequence length.
    supports_step : bool or None
        Whether the estimator decodes token by token with ``step`` (declared, spec 1.1's additions;
        ``None`` reads it from the presence of a ``step`` method, see :func:`supports_step`).
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    unbiased: ClassVar[bool] = False
    consistent: ClassVar[bool] = True
    supports_causal: ClassVar[bool] = True
    #: ``False`` for a causal-only estimator (a gated recurrence such as ``rfa-gate``):
    #: ``causal=False`` is refused, and the conformance kit and fuzz suite call it causally
    supports_noncausal: ClassVar[bool] = True
    random: ClassVar[bool] = False
    has_budget: ClassVar[bool] = False
    linear: ClassVar[bool] = False
    claims: ClassVar[tuple[Any, ...]] = ()
    #: whether the estimator has a decoding ``step`` (constant-size state), declared (spec
    #: 1.1 additions); ``None``: read as ``hasattr(estimator, "step")`` (plugins written before it)
    supports_step: ClassVar[bool | None] = None

    def __init__(self, *, scale: float | None = None) -> None:
        super().__init__()
        self.scale = check_scale(scale)
        #: name of the backend that ran the last forward call (for reporting)
        self.last_backend: str | None = None
        add_family_marker(self)  # another family's checkpoint is refused

    def state_family(self) -> str:
        """The family ``state_dict`` names (``load_state_dict`` refuses another family's
        checkpoint, naming both): the registry name by default."""
        return getattr(type(self), "name", type(self).__qualname__)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention output ``[B, H, N, dv]`` (see the class docstring)."""
        if torch.jit.is_tracing():
            raise InputError(JIT_TRACE)
        check_qkv(q, k, v)
        mask = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
        if not isinstance(causal, bool):
            raise InputError(f"causal: expected a bool, got {causal!r}")
        if not causal and not self.supports_noncausal:
            raise InputError(f"causal: estimator {self.name!r} is causal only; got causal=False")
        if causal:
            if not self.supports_causal:
                raise InputError(f"causal: estimator {self.name!r} is non-causal only; got causal=True")
            if q.shape[2] != k.shape[2]:
                raise InputError(
                    f"causal: expected as many queries as keys (N == M) for causal attention, "
                    f"got N = {q.shape[2]}, M = {k.shape[2]}"
                )
        if q.numel() == 0 or k.numel() == 0:
            return _empty_output(q, k, v)
        return self._attend_scaled(q, k, v, self._input_root(q.shape[-1]), causal, mask)

    def _attend_scaled(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        root: float,
        causal: bool,
        key_padding_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of validated inputs that still need the factor ``root``
        (:meth:`_input_root`). The default multiplies ``q`` and ``k`` and calls
        :meth:`_attend`; an estimator that can apply the factor on the way (without a
        scaled copy of the whole inputs) overrides this."""
        return self._attend(q * root, k * root, v, causal, key_padding_mask)

    def _input_root(self, d: int) -> float:
        """:math:`\\sqrt{s}`, the factor applied to ``q`` and to ``k`` before
        :meth:`_attend` (:math:`s` = ``scale``, :math:`1/\\sqrt{d}` by default), so that
        :math:`\\langle\\sqrt{s}\\,q, \\sqrt{s}\\,k\\rangle = s\\,\\langle q, k\\rangle`."""
        return math.sqrt(self.scale if self.scale is not None else 1.0 / math.sqrt(d))

    def _step_inputs(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Checked inputs of a decoding ``step``: ``q`` and ``k`` of the same ``T`` new
        positions, both multiplied by :meth:`_input_root` as :meth:`forward` does, and
        the checked ``key_padding_mask [B, T]``."""
        check_qkv(q, k, v)
        if q.shape[2] != k.shape[2]:
            raise InputError(f"k: expected as many new keys as new queries ({q.shape[2]}), got {k.shape[2]}")
        mask = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
        root = self._input_root(q.shape[-1])
        return q * root, k * root, mask

    def attention_rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        rows: torch.Tensor,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The estimator's attention weights of the query rows ``rows``: ``[B, H, R, M]``.

        Every estimator here is linear in the values, so its weights are its output for
        one-hot values, :math:`\\hat P = \\mathrm{est}(Q, K, I_M)`, and row :math:`i` of
        :math:`\\hat P` is what query :math:`i` gives key :math:`j` (rows of a
        normalised estimator sum to one). Every query enters the estimator (position-
        aware estimators need query ``i`` at position ``i``); only the rows ``rows`` are
        returned. Used by :func:`~kernelattn_core.convert.distill_attention` for the
        cross-entropy fit.

        The default forms :math:`\\mathrm{est}(Q, K, I_M)`: time and memory of a call with
        :math:`d_v = M`. Estimators that can form the rows directly override
        :meth:`_attention_rows` (``sliding-window``: :math:`O(R M (d + D))`).

        Parameters
        ----------
        q, k : Tensor ``[B, H, N, d]``, ``[B, H, M, d]``
        rows : Tensor of int ``[R]``
            Query positions, each in ``[0, N)``.
        causal, key_padding_mask
            As in :meth:`forward`.
        """
        check_qkv(q, k, k)
        mask = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
        if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype.is_floating_point:
            raise InputError(f"rows: expected a 1-D integer tensor of query positions, got {rows!r}")
        n = q.shape[2]
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
            raise InputError(f"rows: expected positions in [0, {n}), got {int(rows.min())}..{int(rows.max())}")
        if causal and not self.supports_causal:
            raise InputError(f"causal: estimator {self.name!r} is non-causal only; got causal=True")
        if q.numel() == 0 or k.numel() == 0:
            return q.new_zeros(q.shape[0], q.shape[1], rows.numel(), k.shape[2])
        root = self._input_root(q.shape[-1])
        return self._attention_rows(q * root, k * root, rows.to(q.device), causal, mask)

    def _attention_rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        rows: torch.Tensor,
        causal: bool,
        key_padding_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Weights of the rows ``rows`` on validated, already scaled inputs (default:
        one-hot values through :meth:`_attend`)."""
        b, h, m = k.shape[0], k.shape[1], k.shape[2]
        eye = torch.eye(m, dtype=k.dtype, device=k.device).expand(b, h, m, m)
        return self._attend(q, k, eye, causal, key_padding_mask)[:, :, rows]

    @abstractmethod
    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        key_padding_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention on validated, already scaled inputs."""

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


def _empty_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[B, H, N, dv]`` zeros for a call with no query or no key, joined to the graph.

    The anchor is a sum over an empty slice of each input: exactly 0 whatever the inputs
    hold (NaN included), and differentiable, so ``out.sum().backward()`` gives zero
    gradients as :func:`torch.nn.functional.scaled_dot_product_attention` does.
    """
    b, h, n = q.shape[:3]
    anchor = q.flatten()[:0].sum() + k.flatten()[:0].sum() + v.flatten()[:0].sum()
    return torch.zeros(b, h, n, v.shape[-1], dtype=v.dtype, device=v.device) + anchor.to(v.dtype)


def supports_step(estimator: AttentionEstimator) -> bool:
    """Whether ``estimator`` decodes with ``step``: its declared ``supports_step``, else
    (an estimator written before spec 1.1's additions declared it) whether it has a ``step`` method."""
    declared = getattr(type(estimator), "supports_step", None)
    if declared is not None:
        return bool(declared)
    return callable(getattr(estimator, "step", None))
