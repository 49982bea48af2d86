"""Hedgehog: a learned, softmax-mimicking feature map (Zhang et al., 2024)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from kernelattn_core.toolkit import FeatureMap, InputError, check_choice, check_positive_int

from .claims import HEDGEHOG_CLAIMS

#: seed of the fixed initial perturbation (construction is deterministic)
INIT_SEED = 0


class HedgehogFeatureMap(FeatureMap):
    """Hedgehog feature map: a learned per-head linear map followed by a positive,
    two-sided activation.

    For a head :math:`h` with weights :math:`W_h \\in \\mathbb{R}^{d \\times m}` and
    bias :math:`b_h \\in \\mathbb{R}^m`, let :math:`u = x W_h + b_h`. The features are

    .. math::
        \\phi(x) = e^{\\beta_h} \\, [\\, e^{u}, \\; e^{-u} \\,]
        \\quad (\\texttt{activation="exp"}), \\qquad
        \\phi(x) = e^{\\beta_h} \\, [\\, \\mathrm{softmax}(u), \\; \\mathrm{softmax}(-u) \\,]
        \\quad (\\texttt{activation="softmax"}),

    so :math:`D = 2m` features, all positive; the map works in log space
    (:math:`\\log\\phi = \\beta_h + [u, -u]` or :math:`\\beta_h + [\\log\\mathrm{softmax}(u),
    \\log\\mathrm{softmax}(-u)]`), so the engine's stabilisers apply. The learned
    log-scale :math:`\\beta_h` lets :math:`\\phi_q^\\top\\phi_k` match the magnitude of
    :math:`e^{q^\\top k}`, which matters when the map is combined with exact softmax
    terms in one normaliser (``sliding-window``); it cancels in pure feature-map
    attention.

    Queries and keys have separate weights unless ``tied=True`` (Hedgehog trains one
    map per side). Nothing is random: the weights start at a fixed, deterministic
    initialisation and are meant to be fitted (distillation of softmax attention rows),
    for example with ``kernelattn convert``:

    * ``init="identity"`` (Hedgehog): :math:`W = I_{d \\times m}` plus a small
      perturbation (``init_scale``) from a fixed seed, :math:`b = 0`, :math:`\\beta = 0`;
    * ``init="prf"``: :math:`W` one fixed Gaussian draw (seed 0, the same for queries
      and keys), :math:`\\beta = -\\tfrac12 \\log 2m`, and the norm term
      :math:`-\\lVert x \\rVert^2 / 2` added to every log-feature, so that before any
      fitting :math:`\\phi_q(q)^\\top\\phi_k(k) = \\frac{1}{2m}\\sum_{r}
      (e^{w_r^\\top (q + k)} + e^{-w_r^\\top (q + k)}) e^{-(\\lVert q\\rVert^2 +
      \\lVert k\\rVert^2)/2}`: antithetic positive random features, whose expectation
      over the draw is :math:`e^{q^\\top k}` (calibrated against the exact terms of
      ``sliding-window`` from the start). The norm term stays with this option.

    Parameters
    ----------
    head_dim : int, optional
        :math:`d`; otherwise set on first use.
    num_features : int
        The total feature dimension :math:`D = 2m` (even), so budgets compare honestly
        with other maps.
    num_heads : int, optional
        Number of heads :math:`H` with their own weights (``[H, d, m]``); the map then
        needs inputs ``[..., H, N, d]``. ``None`` shares one map across heads.
    activation : {"exp", "softmax"}
        See above.
    tied : bool
        Use the same weights for queries and keys.
    init_scale : float
        Standard deviation of the fixed initial perturbation of :math:`W` (identity init).
    init : {"identity", "prf"}
        See above.
    generator : torch.Generator, optional
        Unused (nothing is random); accepted for interface compatibility.

    Examples
    --------
    >>> import torch
    >>> fm = HedgehogFeatureMap(head_dim=4, num_features=8, num_heads=2)
    >>> fm.query(torch.zeros(1, 2, 3, 4)).shape
    torch.Size([1, 2, 3, 8])
    """

    name: ClassVar[str] = "hedgehog"
    kernel: ClassVar[str | None] = None
    unbiased: ClassVar[bool] = False
    positive: ClassVar[bool] = True
    learnable: ClassVar[bool] = True
    random: ClassVar[bool] = False
    log_space: ClassVar[bool] = True
    has_budget: ClassVar[bool] = True
    default_num_features: ClassVar[int] = 64
    # no PositiveFeatures claim: a log-space map is exp(.) by construction, so FM002 cannot fail (spec/claims.rst)
    #: structure (RT001) and the fitted map's outputs and gradients (EN001), in :mod:`kernelattn_hybrid.claims`
    claims: ClassVar[tuple[Any, ...]] = HEDGEHOG_CLAIMS

    def __init__(
        self,
        head_dim: int | None = None,
        num_features: int | None = None,
        *,
        num_heads: int | None = None,
        activation: str = "exp",
        tied: bool = False,
        init_scale: float = 0.05,
        init: str = "identity",
        generator: torch.Generator | None = None,
    ) -> None:
        d_total = self.default_num_features if num_features is None else num_features
        check_positive_int("num_features", d_total, minimum=2)
        if d_total % 2:
            raise InputError(f"num_features: expected an even total feature dimension D = 2m, got {d_total}")
        self.num_heads = None if num_heads is None else check_positive_int("num_heads", num_heads)
        self.activation = str(check_choice("activation", activation, ("exp", "softmax")))
        if not isinstance(tied, bool):
            raise InputError(f"tied: expected a bool, got {tied!r}")
        self.tied = tied
        if (
            not isinstance(init_scale, int | float)
            or isinstance(init_scale, bool)
            or not math.isfinite(init_scale)
            or init_scale < 0
        ):
            raise InputError(f"init_scale: expected a finite number >= 0, got {init_scale!r}")
        self.init_scale = float(init_scale)
        self.init = str(check_choice("init", init, ("identity", "prf")))
        super().__init__(head_dim, d_total, generator=generator)

    @property
    def half_features(self) -> int:
        """:math:`m = D / 2`, the width of the linear map."""
        return self.num_features // 2

    def _build(self, head_dim: int) -> None:
        h, m = self.num_heads or 1, self.half_features
        g = torch.Generator().manual_seed(INIT_SEED)
        if self.init == "prf":
            base = torch.randn(head_dim, m, generator=g, dtype=torch.float64)  # [d, m], shared by both sides
        else:
            base = torch.eye(head_dim, m, dtype=torch.float64)  # [d, m], identity-like

        jitter = self.init_scale if self.init == "identity" else 0.0  # prf: both sides the same draw

        def weight() -> nn.Parameter:
            w = base + jitter * torch.randn(h, head_dim, m, generator=g, dtype=torch.float64)
            return nn.Parameter(w.to(torch.get_default_dtype()))  # [H, d, m]

        self.weight_q = weight()
        self.bias_q = nn.Parameter(torch.zeros(h, m))  # [H, m]
        if self.tied:
            self.weight_k, self.bias_k = self.weight_q, self.bias_q
        else:
            self.weight_k = weight()
            self.bias_k = nn.Parameter(torch.zeros(h, m))
        beta0 = -0.5 * math.log(2 * m) if self.init == "prf" else 0.0
        self.log_scale = nn.Parameter(torch.full((h,), beta0))  # [H]: beta_h, on each side

    def _feature_dim(self) -> int:
        return self.num_features

    def _signed(self, is_query: bool, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[w, -w]`` ``[H, d, 2m]`` and the bias ``[b, -b] + beta`` ``[H, 1, 2m]`` of one side
        in the dtype of ``x``: both signs from one product (``[u, -u]``, ``u = w.x + b``), with
        the head's log-scale :math:`\\beta` folded into the bias.

        Without autograd the pair is kept until a weight changes (another tensor, its
        storage or an in-place update): a decoding step calls the map once per token and
        layer, and rebuilding the pair is four of its dozen tensor operations. Under
        autograd it is rebuilt every call (the graph runs through it)."""
        w, b = (self.weight_q, self.bias_q) if is_query else (self.weight_k, self.bias_k)
        beta = self.log_scale
        sources = (w, b, beta)
        keep = not torch.is_grad_enabled() and not torch.compiler.is_compiling()
        keep = keep and not any(t.is_inference() for t in sources)  # an inference tensor keeps no version
        if keep:
            key = (is_query, x.dtype, x.device)
            stamp = tuple((t.data_ptr(), t._version) for t in sources)
            hit = self.__dict__.setdefault("_signed_cache", {}).get(key)
            if hit is not None and all(a is b_ for a, b_ in zip(hit[0], sources)) and hit[1] == stamp:
                return hit[2]
        w, b, beta = (t.to(dtype=x.dtype, device=x.device) for t in sources)
        pair = torch.cat([w, -w], -1), (torch.cat([b, -b], -1) + beta[:, None])[:, None, :]
        if keep:
            self.__dict__["_signed_cache"][key] = (sources, stamp, pair)
        return pair

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        w2, bias = self._signed(is_query, x)  # [H, d, 2m], [H, 1, 2m]
        if self.num_heads is None:
            u2 = (x @ w2[0]).add_(bias[0, 0])  # [..., 2m] (in place on the fresh product: nothing saved)
        else:
            if x.dim() < 3 or x.shape[-3] != self.num_heads:
                raise InputError(
                    f"x: hedgehog has per-head weights for num_heads = {self.num_heads}; expected "
                    f"[..., {self.num_heads}, N, d], got shape {tuple(x.shape)}"
                )
            u2 = (x @ w2).add_(bias)  # [..., H, N, d] @ [H, d, 2m] -> [..., H, N, 2m]
        if self.activation == "softmax":  # log-softmax over each sign's m entries (beta cancels in it: added back)
            beta = self.log_scale.to(x.dtype)
            shift = beta[0] if self.num_heads is None else beta[:, None, None]
            u2 = u2.unflatten(-1, (2, -1)).log_softmax(-1).flatten(-2) + shift  # (log_softmax saves its output)
        if self.init == "prf":  # antithetic positive random features e^{+-(w.x + b) - |x|^2 / 2}
            u2 = u2.sub_(0.5 * x.square().sum(-1, keepdim=True))
        return u2  # [..., D] log-features

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, num_features={self.num_features}, num_heads={self.num_heads}, "
            f"activation={self.activation!r}, tied={self.tied}"
        )
