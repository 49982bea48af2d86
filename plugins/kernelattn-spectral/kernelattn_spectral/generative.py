"""Generative-RKS and Generative-PRF: frequencies from a generator network applied to Gaussian noise."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kernelattn_core.toolkit import FeatureMap, InputError

from ._base import check_int, check_positive_float, prf_log_features, rks_features
from .claims import GENERATIVE_CLAIMS

#: default number of Linear + BatchNorm + LeakyReLU blocks (the paper: four)
DEFAULT_BLOCKS = 4
#: default hidden width, as a multiple of the head dimension
DEFAULT_WIDTH_FACTOR = 2


class _GenerativeFeatureMap(FeatureMap):
    """Common part of the generative maps: the generator :math:`g` and the noise."""

    unbiased: ClassVar[bool] = False  # the kernel is implicit (no closed form)
    random: ClassVar[bool] = True
    learnable: ClassVar[bool] = True
    kernel: ClassVar[str | None] = None
    default_num_features: ClassVar[int] = 256

    def __init__(
        self,
        head_dim: int | None = None,
        num_features: int | None = None,
        *,
        noise_dim: int | None = None,
        hidden_dims: Sequence[int] | None = None,
        negative_slope: float = 0.2,
        output_scale: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> None:
        self.noise_dim = None if noise_dim is None else check_int("noise_dim", noise_dim)
        if hidden_dims is not None:
            if isinstance(hidden_dims, (str, bytes)) or not isinstance(hidden_dims, Sequence):
                raise InputError(f"hidden_dims: expected a sequence of positive ints, got {hidden_dims!r}")
            hidden_dims = tuple(check_int("hidden_dims", h) for h in hidden_dims)
        self.hidden_dims = hidden_dims
        self.negative_slope = check_positive_float("negative_slope", negative_slope, allow_zero=True)
        self.output_scale = check_positive_float("output_scale", output_scale)
        if isinstance(num_features, int) and not isinstance(num_features, bool) and num_features == 1:
            raise InputError("num_features: expected >= 2 (batch normalisation over the noise samples), got 1")
        super().__init__(head_dim, num_features, generator=generator)

    def _widths(self, head_dim: int) -> tuple[int, ...]:
        """The generator's widths: noise, hidden layers (without the output ``d``)."""
        noise_dim = self.noise_dim or head_dim
        hidden = self.hidden_dims or (DEFAULT_WIDTH_FACTOR * head_dim,) * DEFAULT_BLOCKS
        return (noise_dim, *hidden)

    def _build_budget(self, head_dim: int) -> list[tuple[str, int, int, str]]:
        """The noise ``[M, d_noise]`` and each weight of the generator, named by the option
        that sets its size (``noise_dim`` or ``hidden_dims`` when given, else ``head_dim``),
        held to the draw budget before anything is allocated."""
        widths = self._widths(head_dim)
        names = ["noise_dim" if self.noise_dim else "head_dim"]
        names += ["hidden_dims" if self.hidden_dims else "head_dim"] * (len(widths) - 1) + ["head_dim"]
        sizes = [*zip(widths, names), (head_dim, "head_dim")]
        out = []
        if self.noise_dim:
            out.append(("noise_dim", self.noise_dim, self.num_features, "num_features (the noise [M, d_noise])"))
        for (i, name_in), (o, name_out) in itertools.pairwise(sizes):
            given = [(w, n) for w, n in ((i, name_in), (o, name_out)) if n != "head_dim"]
            value, name = max(given) if given else (head_dim, "head_dim")
            what = f"(the generator's [{o:,}, {i:,}] weight) / {name}"
            out.append((name, value, o * i // value, what))
        return out

    def _build(self, head_dim: int) -> None:
        widths = self._widths(head_dim)
        self.weights = nn.ParameterList([nn.Parameter(torch.empty(o, i)) for i, o in itertools.pairwise(widths)])
        self.biases = nn.ParameterList([nn.Parameter(torch.zeros(o)) for o in widths[1:]])
        self.bn_weights = nn.ParameterList([nn.Parameter(torch.ones(o)) for o in widths[1:]])
        self.bn_biases = nn.ParameterList([nn.Parameter(torch.zeros(o)) for o in widths[1:]])
        self.out_weight = nn.Parameter(torch.empty(head_dim, widths[-1]))
        self.out_bias = nn.Parameter(torch.zeros(head_dim))
        self.register_buffer("noise", torch.empty(self.num_features, widths[0]))  # [M, d_noise]
        self.register_buffer("params_initialised", torch.tensor(False))

    def _redraw(self, generator: torch.Generator | None) -> None:
        if not bool(self.params_initialised):
            for w in [*self.weights, self.out_weight]:  # Xavier-uniform, from the draw's generator
                bound = math.sqrt(6.0 / (w.shape[0] + w.shape[1]))
                w.copy_((2 * self._draw("uniform", tuple(w.shape), w, generator) - 1) * bound)
            self.params_initialised.fill_(True)
        self.noise.copy_(self._draw("normal", tuple(self.noise.shape), self.noise, generator))

    def generate(self, noise: torch.Tensor) -> torch.Tensor:
        """:math:`g(n)` for ``noise [M, d_noise]``, giving frequencies ``[M, d]``.

        .. math:: h_0 = n,\\quad h_{l} = \\mathrm{LeakyReLU}(\\mathrm{BN}(W_l h_{l-1} + b_l)),\\quad
                  g(n) = \\tau \\tanh(W_o h_L + b_o)

        Batch normalisation always uses the statistics of the ``M`` noise samples (no
        running averages), so a given draw gives the same frequencies in training and
        evaluation.
        """
        h = noise
        for w, b, gw, gb in zip(self.weights, self.biases, self.bn_weights, self.bn_biases):
            h = F.linear(h, w, b)  # [M, width]
            h = F.batch_norm(h, None, None, gw, gb, training=True, eps=1e-5)
            h = F.leaky_relu(h, self.negative_slope)
        return self.output_scale * torch.tanh(F.linear(h, self.out_weight, self.out_bias))  # [M, d]

    def frequencies(self) -> torch.Tensor:
        """The current frequencies :math:`\\omega_m = g(n_m)`, ``[M, d]``."""
        if not self.built:
            raise InputError(f"{self.name!r}: frequencies() needs the head dimension; call build(head_dim) first")
        return self.generate(self.noise)

    def _projections(self, x: torch.Tensor) -> torch.Tensor:
        w = self.frequencies().to(device=x.device, dtype=x.dtype)  # [M, d]
        return x @ w.transpose(0, 1)  # [..., M]

    def _feature_dim(self) -> int:
        return self.num_features * (1 if self.log_space else 2)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, noise_dim={self.noise_dim}, hidden_dims={self.hidden_dims}, "
            f"negative_slope={self.negative_slope}, output_scale={self.output_scale}"
        )


class GenerativeRKSFeatureMap(_GenerativeFeatureMap):
    """Generative-RKS: trigonometric features of frequencies produced by a generator network,

    .. math::
        \\omega_m = g(n_m), \\quad n_m \\sim \\mathcal N(0, I_{d_n}), \\qquad
        \\phi(x) = \\frac{1}{\\sqrt M}[\\cos(\\omega_m^\\top x), \\sin(\\omega_m^\\top x)]_m \\in \\mathbb{R}^{2M},

    estimating the implicit shift-invariant kernel :math:`\\mathbb{E}_n[\\cos(g(n)^\\top \\delta)]`
    (no closed form, so ``kernel = None``).

    Parameters
    ----------
    head_dim : int, optional
    num_features : int
        :math:`M \\ge 2` noise samples; the feature dimension is ``2M``.
    noise_dim : int, optional
        :math:`d_n`; the head dimension by default.
    hidden_dims : sequence of int, optional
        Widths of the Linear + BatchNorm + LeakyReLU blocks; by default four blocks of
        width ``2 * head_dim`` (the paper: four blocks, widths unspecified).
    negative_slope : float
        LeakyReLU slope. Default 0.2.
    output_scale : float
        :math:`\\tau` multiplying the final tanh (default 1, as the paper: frequencies in
        :math:`(-1, 1)^d`).

    Attributes
    ----------
    weights, biases, bn_weights, bn_biases : ParameterList
        The blocks (Xavier-uniform weights drawn once, from the first draw's generator).
    out_weight : Parameter ``[d, width]``
    out_bias : Parameter ``[d]``
    noise : buffer ``[M, d_n]``
        Redrawn by the redraw policy; frozen in eval mode.
    """

    # trigonometric estimates can be negative: bounded division when denominators near zero
    default_normalizer: ClassVar[str] = "signed-row"
    name: ClassVar[str] = "generative-rks"
    positive: ClassVar[bool] = False
    log_space: ClassVar[bool] = False
    claims: ClassVar[tuple[Any, ...]] = GENERATIVE_CLAIMS

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        return rks_features(self._projections(x))  # [..., 2M]


class GenerativePRFFeatureMap(_GenerativeFeatureMap):
    """Generative-PRF: positive features :math:`\\phi(x) = \\frac{e^{-\\|x\\|^2/2}}{\\sqrt M}[e^{g(n_m)^\\top x}]_m`
    (log space), estimating :math:`\\mathbb{E}_n[e^{g(n)^\\top (q+k)}]\\,e^{-\\|q\\|^2/2 - \\|k\\|^2/2}`.

    With the default ``output_scale = 1`` the frequencies lie in :math:`(-1, 1)^d`, so the
    softmax kernel (:math:`\\omega \\sim \\mathcal N(0, I)`) cannot be represented exactly.

    Parameters
    ----------
    head_dim, num_features, noise_dim, hidden_dims, negative_slope, output_scale
        As :class:`GenerativeRKSFeatureMap`; the feature dimension is ``M``.
    """

    name: ClassVar[str] = "generative-prf"
    positive: ClassVar[bool] = True
    log_space: ClassVar[bool] = True
    claims: ClassVar[tuple[Any, ...]] = GENERATIVE_CLAIMS

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        return prf_log_features(self._projections(x), x)  # [..., M] (log)
