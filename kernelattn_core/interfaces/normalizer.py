"""The :class:`Normalizer` interface: what wraps a kernel estimate into attention."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from .state import add_family_marker


class Normalizer(nn.Module):
    """Pre-transform, row normalisation and post-transform of kernelized attention.

    Feature-map attention computes, for each query :math:`i`,

    .. math::
        \\mathrm{num}_i = \\sum_j \\hat K(q_i, k_j) v_j, \\qquad
        \\mathrm{den}_i = \\sum_j \\hat K(q_i, k_j),

    and returns ``post(normalize(num, den))`` computed on ``pre(q, k)``.

    The default row rule is :math:`\\mathrm{num}_i / \\mathrm{den}_i` with the
    stabiliser described in :meth:`normalize`. ``num`` and ``den`` may both carry the
    same unknown positive per-query factor (the engine's exact log-space
    stabilisers), so a normaliser must be invariant to it.

    Parameters
    ----------
    eps : float, optional
        Denominators with :math:`|\\mathrm{den}| <` ``eps`` are replaced by
        :math:`\\pm` ``eps`` (keeping their sign; ``+`` for zero). The default is the
        smallest normal number of the compute dtype, so the rule fires only for rows
        whose denominator underflowed. A query whose keys are all masked has
        ``num = den = 0`` exactly and gets a zero output (and zero gradient), not NaN.
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    learnable: ClassVar[bool] = False
    claims: ClassVar[tuple[Any, ...]] = ()
    #: whether :meth:`pre` takes the ``causal`` keyword, declared (spec 1.1's additions); ``None``: the
    #: engine reads it from the signature of ``pre`` (plugins written against 1.0/1.1)
    causal_aware: ClassVar[bool | None] = None

    def __init__(self, eps: float | None = None) -> None:
        super().__init__()
        self.eps = eps
        # the state dict names the normaliser, and another normaliser's checkpoint is refused
        add_family_marker(self)

    def state_family(self) -> str:
        """The family ``state_dict`` names (``load_state_dict`` refuses another family's
        checkpoint, naming both): the registry name."""
        return getattr(type(self), "name", type(self).__qualname__)

    def pre(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Transform ``q [B, H, N, d]`` and ``k [B, H, M, d]`` before the features.

        ``key_padding_mask [B, M]`` (``True`` = padded) is given so that statistics over
        keys can leave padding out. ``causal`` says the call is causal: statistics of the
        current sequence would carry later tokens into earlier outputs, so a normaliser
        that computes them must use causal (prefix) statistics or raise an
        :class:`~kernelattn_core.errors.InputError`. Feature-map attention passes
        ``causal`` only to normalisers whose ``pre`` declares it, so older third-party
        normalisers keep working.
        """
        return q, k

    def normalize(self, num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
        """Row normalisation ``num [B, H, N, dv] / den [B, H, N]``.

        A row with ``den == 0`` exactly (every key masked, so ``num == 0`` too) gives
        zeros with zero gradient; the division never sees a tiny denominator whose
        reciprocal would overflow in the backward pass.
        """
        eps = self.eps if self.eps is not None else torch.finfo(den.dtype).tiny
        zero = den == 0
        small = (den.abs() < eps) & ~zero
        sign = torch.where(den < 0, -1.0, 1.0).to(den.dtype)
        safe = torch.where(zero, torch.ones_like(den), torch.where(small, sign * eps, den))
        return num / safe.unsqueeze(-1)

    def post(self, out: torch.Tensor) -> torch.Tensor:
        """Transform the normalised output ``[B, H, N, dv]``."""
        return out

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


def takes_causal(normalizer: Normalizer) -> bool:
    """Whether ``normalizer.pre`` takes ``causal``: the declared ``causal_aware``, else (a
    normaliser written before spec 1.1's additions declared it) read from the signature of ``pre``."""
    declared = getattr(type(normalizer), "causal_aware", None)
    if declared is not None:
        return bool(declared)
    import inspect

    return "causal" in inspect.signature(normalizer.pre).parameters
