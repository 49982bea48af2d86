"""FastFood-RKS and FastFood-PRF: structured frequencies :math:`V = S H G \\Pi H B / (\\sigma\\sqrt d)`
applied with the fast Walsh–Hadamard transform in :math:`O(d \\log d)` per block."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from kernelattn_core.toolkit import FeatureMap, InputError, UnbiasedKernelEstimate

from ._base import check_positive_float, prf_log_features, rks_features
from .hadamard import fwht, is_power_of_two

#: learn option -> which of the diagonals (s, G, B) are trainable parameters
LEARN_VARIANTS: dict[str, tuple[str, ...]] = {"sgb": ("s", "G", "B"), "s": ("s",), "none": ()}


class _FastFoodFeatureMap(FeatureMap):
    """Common part of the FastFood maps: the structured projection :math:`Vx`."""

    unbiased: ClassVar[bool] = False  # True for learn="none" only (see the FM001 claim)
    random: ClassVar[bool] = True
    learnable: ClassVar[bool] = True
    default_num_features: ClassVar[int] = 256

    def __init__(
        self,
        head_dim: int | None = None,
        num_features: int | None = None,
        *,
        bandwidth: float = 1.0,
        learn: str = "sgb",
        generator: torch.Generator | None = None,
    ) -> None:
        self.bandwidth = check_positive_float("bandwidth", bandwidth)
        if not isinstance(learn, str) or learn not in LEARN_VARIANTS:  # a list or dict: not hashable
            raise InputError(f"learn: expected one of {sorted(LEARN_VARIANTS)}, got {learn!r}")
        self.learn = learn
        super().__init__(head_dim, num_features, generator=generator)

    @property
    def blocks(self) -> int:
        """Number of stacked :math:`d \\times d` blocks, ``num_features / d``."""
        assert self.head_dim is not None
        return self.num_features // self.head_dim

    def _build(self, head_dim: int) -> None:
        if not is_power_of_two(head_dim):
            raise InputError(
                f"head_dim: FastFood needs a power of two (the Walsh–Hadamard transform), got d = {head_dim}"
            )
        if self.num_features % head_dim:
            raise InputError(
                f"num_features: FastFood stacks d x d blocks, so it needs a multiple of d = {head_dim} "
                f"(d | M; the paper's 'M | d' is a typo), got {self.num_features}"
            )
        nb = self.num_features // head_dim
        learned = LEARN_VARIANTS[self.learn]
        for name in ("s", "G", "B"):
            t = torch.empty(nb, head_dim)  # [blocks, d]; filled by _redraw
            if name in learned:
                setattr(self, name, nn.Parameter(t))
            else:
                self.register_buffer(name, t)
        self.register_buffer("perm", torch.empty(nb, head_dim, dtype=torch.long))  # Pi, [blocks, d]
        self.register_buffer("block_index", torch.arange(nb).unsqueeze(-1), persistent=False)  # [blocks, 1]
        self.register_buffer("params_initialised", torch.tensor(False))

    def _redraw(self, generator: torch.Generator | None) -> None:
        learned = LEARN_VARIANTS[self.learn]
        first = not bool(self.params_initialised)
        d = self.head_dim
        assert d is not None
        # fixed diagonals are redrawn every time; learned ones only initialised once
        if first or "B" not in learned:
            self.B.copy_(self._draw("rademacher", tuple(self.B.shape), self.B, generator))
        if first or "G" not in learned:
            self.G.copy_(self._draw("normal", tuple(self.G.shape), self.G, generator))
        if first or "s" not in learned:
            chi = self._draw("normal", (*self.s.shape, d), self.s, generator).pow(2).sum(-1).sqrt()  # chi_d
            self.s.copy_(chi)
        keys = self._draw("uniform", tuple(self.perm.shape), self.B, generator)
        self.perm.copy_(keys.argsort(dim=-1))
        self.params_initialised.fill_(True)

    def scaling(self) -> torch.Tensor:
        """The diagonal :math:`S = s / \\|G\\|_2` per block, ``[blocks, d]``, so that row ``i`` of
        :math:`V` has norm :math:`|s_i|/\\sigma` (standard FastFood: :math:`s_i \\sim \\chi_d`)."""
        return self.s / self.G.norm(dim=-1, keepdim=True)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """:math:`V x` for ``x [..., d]``, giving ``[..., M]`` (blocks concatenated):

        .. math:: V_b x = \\frac{1}{\\sigma\\sqrt d}\\, S_b \\odot H\\big(G_b \\odot \\Pi_b H (B_b \\odot x)\\big).

        The structured product costs :math:`O(M \\log d)` per vector, but in eager PyTorch
        each of its :math:`2 \\log_2 d` butterfly stages and the permutation is a full pass
        over ``[..., M]`` (at ``d = 64``, ``M = 256``, N = 4096 this made fastfood-prf slower
        than exact SDPA). For more than ``d`` vectors :math:`V^\\top` is therefore
        materialised once by the structured product (:math:`O(M d \\log d)`, differentiable in
        the learned diagonals) and applied as one matrix product: the same linear map, so
        the same values (up to rounding) and the same gradients.
        """
        d = x.shape[-1]
        if x.numel() > d * d:
            eye = torch.eye(d, dtype=x.dtype, device=x.device)
            return x @ self._structured(eye)  # [d, M]: row j is V e_j
        return self._structured(x)

    def _structured(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`project` by the structured product itself, ``[..., d]`` to ``[..., M]``."""
        d = x.shape[-1]
        dt = x.dtype
        y = x.unsqueeze(-2) * self.B.to(dt)  # [..., blocks, d]
        y = fwht(y)
        y = y[..., self.block_index, self.perm]  # (Pi z)_i = z_{perm_i}: [..., blocks, d]
        y = fwht(y * self.G.to(dt))
        y = y * (self.scaling().to(dt) / (self.bandwidth * math.sqrt(d)))
        return y.flatten(-2)  # [..., M]

    def matrix(self) -> torch.Tensor:
        """The materialised frequencies :math:`V`, ``[M, d]`` (rows :math:`\\omega_m^\\top`), for tests."""
        assert self.head_dim is not None
        eye = torch.eye(self.head_dim, dtype=self.G.dtype, device=self.G.device)
        return self.project(eye).transpose(0, 1)  # column j of V is V e_j

    def _feature_dim(self) -> int:
        return self.num_features * (1 if self.log_space else 2)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bandwidth={self.bandwidth}, learn={self.learn!r}"


class FastFoodRKSFeatureMap(_FastFoodFeatureMap):
    """FastFood-RKS: trigonometric features of structured frequencies

    .. math::
        V = \\frac{1}{\\sigma\\sqrt d}\\, S H G \\Pi H B \\in \\mathbb{R}^{d \\times d} \\text{ per block}, \\qquad
        \\phi(x) = \\frac{1}{\\sqrt M}[\\cos(Vx), \\sin(Vx)] \\in \\mathbb{R}^{2M},

    with :math:`H` the (unnormalised) Walsh–Hadamard matrix, :math:`\\Pi` a permutation,
    :math:`B` a :math:`\\pm 1` diagonal, :math:`G` a Gaussian diagonal and
    :math:`S = \\mathrm{diag}(s)/\\|G\\|_2`, :math:`s_i \\sim \\chi_d`. Blocks are stacked for
    :math:`M > d` (:math:`d \\mid M`; :math:`d` a power of two). :math:`Vx` costs
    :math:`O(M \\log d)`, and only the diagonals are stored.

    At initialisation (and always with ``learn="none"``) every row of :math:`V` is exactly
    :math:`\\mathcal N(0, \\sigma^{-2} I)` (the rows of :math:`HG\\Pi HB` are Gaussian vectors of norm
    :math:`\\sqrt d\\,\\|G\\|_2` with uniform direction; :math:`S` replaces the norm by
    :math:`\\chi_d`), so the estimate is unbiased for the RBF kernel
    :math:`e^{-\\|x - y\\|^2/(2\\sigma^2)}` (``spectral-gmm`` with no parameters).

    Parameters
    ----------
    head_dim : int, optional
        A power of two.
    num_features : int
        :math:`M`, a multiple of ``head_dim``; the feature dimension is ``2M``.
    bandwidth : float
        :math:`\\sigma`. Default 1.
    learn : {"sgb", "s", "none"}
        Which diagonals are trained: S, G and B (FastFood-SGB, the paper's main variant, the
        default); S only (FastFood-S); none (plain FastFood). Fixed diagonals are redrawn
        with :math:`\\Pi` by the redraw policy; learned ones are drawn once, at initialisation.

    Attributes
    ----------
    s, G, B : Parameter or buffer ``[blocks, d]``
    perm : buffer ``[blocks, d]`` of int64
        :math:`\\Pi`, always random (redrawn).
    """

    # trigonometric estimates can be negative: bounded division when denominators near zero
    default_normalizer: ClassVar[str] = "signed-row"
    name: ClassVar[str] = "fastfood-rks"
    kernel: ClassVar[str | None] = "spectral-gmm"
    positive: ClassVar[bool] = False
    log_space: ClassVar[bool] = False
    claims: ClassVar[tuple[Any, ...]] = (UnbiasedKernelEstimate(num_features=64, options={"learn": "none"}),)

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        return rks_features(self.project(x))  # [..., 2M]


class FastFoodPRFFeatureMap(_FastFoodFeatureMap):
    """FastFood-PRF: positive features of the FastFood frequencies,

    .. math:: \\phi(x) = \\frac{e^{-\\|x\\|^2/2}}{\\sqrt M}\\, e^{Vx} \\in \\mathbb{R}_{>0}^{M},

    computed in log space. With ``learn="none"`` (and at initialisation) the rows of
    :math:`V` are :math:`\\mathcal N(0, \\sigma^{-2} I)`, so the estimate is unbiased for
    :math:`\\exp(\\|q+k\\|^2/(2\\sigma^2) - \\|q\\|^2/2 - \\|k\\|^2/2)` (``spectral-prf``), the softmax
    kernel :math:`e^{q^\\top k}` at :math:`\\sigma = 1`.

    Parameters
    ----------
    head_dim, num_features, bandwidth, learn
        As :class:`FastFoodRKSFeatureMap`; the feature dimension is ``M``.
    """

    name: ClassVar[str] = "fastfood-prf"
    kernel: ClassVar[str | None] = "spectral-prf"
    positive: ClassVar[bool] = True
    log_space: ClassVar[bool] = True
    claims: ClassVar[tuple[Any, ...]] = (UnbiasedKernelEstimate(num_features=64, options={"learn": "none"}),)

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        return prf_log_features(self.project(x), x)  # [..., M] (log)
