"""Positive random features (Performer FAVOR+), their hyperbolic variant, and CEXP / HCEXP.

All four maps are log-space maps: :meth:`_features` returns :math:`\\log\\phi` and the
engine applies exact, causal-safe stabilisers. They share the random vectors
:math:`\\omega_1..\\omega_m` between the query and the key map.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from kernelattn_core import FeatureMap, InputError
from kernelattn_core.toolkit import (
    ErrorDecay,
    EstimateVariance,
    FusedFeatureSpec,
    PendingDraws,
    SymbolicExpectation,
    UnbiasedKernelEstimate,
    after_backward,
    checkpoint_token,
    finite_rows,
    recomputing,
    same_draws,
)

from . import adaptation
from .sampling import block_orthogonal_rows, chi_norms, num_blocks
from .theory import (
    CEXP_OPTION_CLAIMS,
    derive_cexp_1d,
    derive_hcexp_1d,
    derive_prf_1d,
    derive_prf_hyperbolic_1d,
    estimate_variance,
)

NORMS = ("chi", "fixed")


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{name}: expected a bool, got {value!r} ({type(value).__name__})")
    return value


class PositiveRandomFeatures(FeatureMap):
    """Positive random features of Performer (FAVOR+) for the softmax kernel.

    .. math:: \\phi(x) = \\frac{1}{\\sqrt m}\\Big(e^{\\omega_i^\\top x - \\|x\\|^2/2}\\Big)_{i=1}^{m},
              \\qquad \\mathbb{E}_\\omega\\big[\\phi(x)^\\top\\phi(y)\\big] = e^{x^\\top y},

    with :math:`\\omega_i \\sim N(0, I_d)` iid, or block-orthogonal (``orthogonal=True``):
    the rows of each :math:`d\\times d` block are the rows of a Haar orthogonal matrix
    (QR of a Gaussian matrix with the sign correction :math:`Q\\,\\mathrm{diag}(\\mathrm{sign}\\,R_{ii})`),
    scaled by chi-distributed norms (``norm="chi"``: each row is marginally
    :math:`N(0, I_d)`, so the estimate stays unbiased) or by :math:`\\sqrt d`
    (``norm="fixed"``: slightly biased, lower variance).

    Computed in log space: ``_features`` returns
    :math:`\\omega_i^\\top x - \\|x\\|^2/2 - \\tfrac12\\log D`.

    Parameters
    ----------
    head_dim : int, optional
        :math:`d`; the map is built on first use when omitted.
    num_features : int, optional
        :math:`m`, the number of random vectors (256 by default).
    orthogonal : bool
        Block-orthogonal rows instead of iid Gaussian rows.
    norm : {"chi", "fixed"}
        Row norms of orthogonal features.
    generator : torch.Generator, optional
        Source of the first draw.

    Attributes
    ----------
    omega : Tensor ``[m, d]``
        The random vectors (a buffer: saved in ``state_dict``).

    Notes
    -----
    Claims (checked by ``kernelattn verify prf`` and by the plugin's tests):
    unbiased for :math:`e^{x^\\top y}` (FM001, iid and orthogonal-chi; symbolic in 1-D,
    FM005), positive (FM002), single-pair variance
    :math:`\\frac1m \\mathrm{SM}^2 (e^{\\|x+y\\|^2} - 1)` for iid rows (FM003), and MSE
    falling as :math:`1/m` (FM004).

    References
    ----------
    Choromanski et al., "Rethinking Attention with Performers", ICLR 2021.

    Examples
    --------
    >>> import torch
    >>> fm = PositiveRandomFeatures(head_dim=4, num_features=8, generator=torch.Generator().manual_seed(0))
    >>> fm.query(torch.zeros(2, 4)).shape
    torch.Size([2, 8])
    """

    name: ClassVar[str] = "prf"
    aliases: ClassVar[tuple[str, ...]] = ("favor+", "performer")
    kernel: ClassVar[str | None] = "softmax"
    unbiased: ClassVar[bool] = True
    positive: ClassVar[bool] = True
    learnable: ClassVar[bool] = False
    random: ClassVar[bool] = True
    log_space: ClassVar[bool] = True
    has_budget: ClassVar[bool] = True
    default_num_features: ClassVar[int] = 256
    #: whether the map uses both signs of each omega (2m features)
    two_sided: ClassVar[bool] = False
    claims: ClassVar[tuple[Any, ...]] = (
        UnbiasedKernelEstimate(dims=(16, 64)),
        UnbiasedKernelEstimate(dims=(16, 64), options={"orthogonal": True}),
        EstimateVariance(variance=estimate_variance),
        ErrorDecay(),
        SymbolicExpectation(derive=derive_prf_1d),
    )

    def __init__(
        self,
        head_dim: int | None = None,
        num_features: int | None = None,
        *,
        orthogonal: bool = False,
        norm: str = "chi",
        generator: torch.Generator | None = None,
    ) -> None:
        self.orthogonal = _check_bool("orthogonal", orthogonal)
        if norm not in NORMS:
            raise InputError(f"norm: expected one of {list(NORMS)}, got {norm!r}")
        self.norm = norm
        super().__init__(head_dim, num_features, generator=generator)

    # ------------------------------------------------------------------ lifecycle
    def _build(self, head_dim: int) -> None:
        self.register_buffer("omega", torch.empty(self.num_features, head_dim))

    def _redraw(self, generator: torch.Generator | None) -> None:
        m, d = self.omega.shape
        if not self.orthogonal:
            self.omega.copy_(self._draw("normal", (m, d), like=self.omega, generator=generator))
            return
        nb = num_blocks(m, d)
        g = self._draw("normal", (nb, d, d), like=self.omega, generator=generator)  # [nb, d, d]
        if self.norm == "chi":
            norms: torch.Tensor | float = chi_norms(
                self._draw("normal", (nb, d, d), like=self.omega, generator=generator)
            )  # [nb, d]
        else:
            norms = math.sqrt(d)
        self.omega.copy_(block_orthogonal_rows(g, m, norms))

    def _feature_dim(self) -> int:
        return 2 * self.num_features if self.two_sided else self.num_features

    # ------------------------------------------------------------------ features
    def transform(self, x: torch.Tensor, *, query: bool) -> torch.Tensor:
        """The input the exponential sees: ``x`` itself for PRF (``A x`` / ``A^{-T} y`` for CEXP)."""
        return x

    def _features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        x = self.transform(x, query=is_query)
        w = self.omega.to(dtype=x.dtype, device=x.device)
        proj = x @ w.mT  # [..., m]
        if self.two_sided:
            proj = torch.cat([proj, -proj], dim=-1)  # [..., 2m]
        neg_row = (x * x).sum(-1, keepdim=True).mul_(-0.5).sub_(0.5 * math.log(proj.shape[-1]))  # [..., 1]
        # in place on the fresh product (its backward needs x and w, not the product): one
        # pass over [..., D] instead of two allocating ones; added rather than subtracted so
        # the backward reduces the gradient for the row term without negating all of it
        return proj.add_(neg_row)

    def fused_spec(self) -> FusedFeatureSpec:
        """The ``"exp"`` family: :math:`\\log\\phi = x'\\omega^\\top - \\|x'\\|^2/2 - \\tfrac12\\log D`
        with :math:`x'` = :meth:`transform` (``A x`` / ``A^{-T} y`` for CEXP) and
        :math:`\\pm\\omega` stacked for the two-sided maps."""
        omega = torch.cat([self.omega, -self.omega]) if self.two_sided else self.omega  # [D, d]
        log_d = 0.5 * math.log(omega.shape[0])

        def row(x: torch.Tensor, query: bool) -> torch.Tensor:
            return -0.5 * (x * x).sum(-1) - log_d  # [...]

        return FusedFeatureSpec("exp", omega, lambda x, query: self.transform(x, query=query), row)

    def extra_repr(self) -> str:
        extra = f", orthogonal=True, norm={self.norm!r}" if self.orthogonal else ""
        return super().extra_repr() + extra


class HyperbolicPositiveRandomFeatures(PositiveRandomFeatures):
    """Two-sided (hyperbolic, antithetic) positive random features, :math:`2m` features.

    .. math:: \\phi(x) = \\frac{e^{-\\|x\\|^2/2}}{\\sqrt{2m}}
              \\big(e^{\\omega_1^\\top x},..,e^{\\omega_m^\\top x},
              e^{-\\omega_1^\\top x},..,e^{-\\omega_m^\\top x}\\big),

    .. math:: \\phi(x)^\\top\\phi(y) = \\frac{e^{-(\\|x\\|^2+\\|y\\|^2)/2}}{m}
              \\sum_i \\cosh(\\omega_i^\\top(x+y)).

    ``num_features`` is :math:`m`, the number of random vectors; ``feature_dim`` is
    :math:`2m`. Options as :class:`PositiveRandomFeatures`.

    Notes
    -----
    Claims: unbiased (FM001, FM005), positive (FM002), single-pair variance
    :math:`\\frac{1}{2m}\\mathrm{SM}^2 (2\\sinh(\\|x+y\\|^2/2))^2` (FM003, iid rows), which
    is :math:`1 - e^{-\\|x+y\\|^2} < 1` times the variance of plain PRF with the
    same number :math:`2m` of features.
    """

    name: ClassVar[str] = "prf-hyperbolic"
    aliases: ClassVar[tuple[str, ...]] = ("favor+-hyperbolic",)
    two_sided: ClassVar[bool] = True
    claims: ClassVar[tuple[Any, ...]] = (
        UnbiasedKernelEstimate(dims=(16, 64)),
        UnbiasedKernelEstimate(dims=(16, 64), options={"orthogonal": True}),
        EstimateVariance(variance=estimate_variance),
        ErrorDecay(),
        SymbolicExpectation(derive=derive_prf_hyperbolic_1d),
    )


def _group_size() -> int:
    """Ranks of the initialised default process group (1 without one)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


def _synced_moments(x: torch.Tensor, *, full: bool, padding: torch.Tensor | None = None) -> adaptation.Moments:
    """:func:`~kernelattn_prf.adaptation.moments` of the rows of every rank of the default
    process group: the count, the sum and the sum of products of the finite, unpadded rows
    are all-reduced (one collective of :math:`1 + d + d` or :math:`1 + d + d^2` float64
    numbers), so every rank gets the moments of the pooled batch, as SyncBatchNorm does."""
    if padding is not None and x.dim() == 4:
        x = x[~padding[:, None, :].expand(x.shape[:3])]  # [n_valid, d]
    flat = x.detach().reshape(-1, x.shape[-1]).double()  # [n, d]
    flat = flat[finite_rows(flat)]
    d = flat.shape[-1]
    products = flat.T @ flat if full else (flat * flat).sum(0)  # [d, d] or [d]
    packed = torch.cat([flat.new_tensor([float(flat.shape[0])]), flat.sum(0), products.flatten()])
    if dist.get_backend() == "nccl":
        packed = packed.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    packed = packed.to(flat.device)
    n = round(float(packed[0]))
    if n == 0:
        zeros, ones = flat.new_zeros(d), flat.new_ones(d)
        return adaptation.Moments(zeros, ones, torch.eye(d, dtype=flat.dtype, device=flat.device) if full else None, 0)
    ddof = 1 if n > 1 else 0
    mean = packed[1 : 1 + d] / n
    if full:
        scatter = packed[1 + d :].view(d, d) - n * torch.outer(mean, mean)  # sum of centred products
        second = scatter / (n - ddof) + torch.outer(mean, mean)
        var = torch.diagonal(scatter).clamp_min(0.0) / (n - ddof)
        return adaptation.Moments(mean, var, second, n)
    var = (packed[1 + d :] - n * mean * mean).clamp_min(0.0) / (n - ddof)
    return adaptation.Moments(mean, var, None, n)


def _all_finite(*stats: adaptation.Moments) -> bool:
    """Whether every moment of ``stats`` is finite (float64 moments of huge inputs can overflow)."""
    return all(bool(torch.isfinite(t).all()) for m in stats for t in (m.mean, m.var, m.second) if t is not None)


class ComplexExponentialFeatures(PositiveRandomFeatures):
    """CEXP: positive random features of :math:`(Ax, A^{-T}y)` with a real invertible :math:`A`.

    .. math:: \\phi_q(x) = \\frac{1}{\\sqrt m}\\Big(e^{\\omega_i^\\top Ax - \\|Ax\\|^2/2}\\Big)_i, \\quad
              \\phi_k(y) = \\frac{1}{\\sqrt m}\\Big(e^{\\omega_i^\\top A^{-T}y - \\|A^{-T}y\\|^2/2}\\Big)_i,

    with shared :math:`\\omega`. Since :math:`(Ax)^\\top(A^{-T}y) = x^\\top y`, the estimate
    is unbiased for :math:`e^{x^\\top y}` for every :math:`A`, and its MSE (Lemma 3.1) is
    :math:`\\frac1m\\mathrm{SM}^2(e^{\\|z\\|^2} - 1)` with :math:`z = Ax + A^{-T}y`:
    :math:`A` is chosen to make :math:`\\|z\\|` small for the data.

    Rules for :math:`A` (``rule``):

    * ``"identity"``: :math:`A = I`; exactly PRF (bit for bit, same :math:`\\omega`).
    * ``"means"``: diagonal, :math:`a_i = \\sqrt{|\\mu_{y,i}|/|\\mu_{x,i}|}` (HRF rule).
    * ``"variance"``: diagonal, :math:`a_i = ((\\sigma_{y,i}^2+\\mu_{y,i}^2)/(\\sigma_{x,i}^2+\\mu_{x,i}^2))^{1/4}`
      (Lemma 3.4), unbiased sample variance (``ddof = 1``).
    * ``"full"``: :math:`A = (B^\\star)^{1/2}` with :math:`B^\\star = M_x^{-1} \\# M_y`, the matrix
      geometric mean of the second-moment matrices :math:`M = \\Sigma + \\mu\\mu^\\top`
      (minimises :math:`\\mathbb{E}\\|Ax\\|^2 + \\mathbb{E}\\|A^{-T}y\\|^2` over all :math:`A`).
    * ``"fixed"``: a given ``matrix`` (a float :math:`c` for :math:`cI`, a vector for a
      diagonal, or a ``[d, d]`` matrix).

    Statistics are per component, pooled over batch, heads and positions of the
    (scaled) queries ``x`` and keys ``y`` that :meth:`prepare` sees. In training mode
    :math:`A` comes from the batch statistics (``use_batch_stats=True``) and running
    estimates are updated with ``momentum`` (the first batch initialises them); in eval
    mode :math:`A` comes from the running estimates, frozen (a map that has tracked no
    statistics yet, e.g. a fresh model put in eval mode, uses :math:`A = I`). Causal
    calls use only the running estimates of earlier batches; padded keys enter no
    statistic (see :meth:`prepare`). :meth:`fit` sets the running estimates from given data.
    Statistics are detached: no gradient flows through :math:`A`. Every rule is guarded by the floor ``eps`` (see
    :mod:`kernelattn_prf.adaptation`).

    Parameters
    ----------
    head_dim, num_features, orthogonal, norm, generator
        As :class:`PositiveRandomFeatures`.
    rule : {"identity", "means", "variance", "full", "fixed"}
        How :math:`A` is chosen (``"variance"`` by default).
    momentum : float
        Weight of a new batch in the running statistics, in ``(0, 1]``.
    eps : float
        Floor of the statistics in every rule (absolute, in scaled coordinates).
    use_batch_stats : bool
        In training, use this batch's statistics for :math:`A` (they include *later*
        positions of the sequence, so causal training sees the future through
        :math:`A`); ``False`` uses the running statistics of earlier batches
        (causal-safe) and updates them afterwards.
    matrix : float, sequence or Tensor, optional
        :math:`A` for ``rule="fixed"``.
    sync : bool
        Inside an initialised :mod:`torch.distributed` process group of several ranks,
        pool the training statistics over every rank (an all-reduce of their sums, as
        :class:`torch.nn.SyncBatchNorm` does), so that every data-parallel replica sets
        the same :math:`A` and keeps the same running estimates (``True``, the default;
        a collective in every training forward call, so every rank must make it).
        ``False`` keeps per-rank statistics: replicas then drift apart (their eval
        outputs differed by up to 1e-4 before this option existed).

    Attributes
    ----------
    omega : Tensor ``[m, d]``
    scale : Tensor ``[d]``
        The diagonal of :math:`A` (diagonal rules).
    matrix_q, matrix_k : Tensor ``[d, d]``
        :math:`A` and :math:`A^{-T}` (``"full"`` rule and non-diagonal ``"fixed"``).
    running_mean_q, running_mean_k, running_var_q, running_var_k : Tensor ``[d]``
    running_second_q, running_second_k : Tensor ``[d, d]`` (``"full"`` rule)

    Notes
    -----
    Claims: unbiased for every :math:`A` (FM001 at :math:`A = 1.25 I`; FM005 in 1-D
    with symbolic :math:`a`), positive (FM002), Lemma 3.1 variance (FM003).

    References
    ----------
    "Adapting Linear Attention to Query Key Distributions" (spec 004); Choromanski et
    al., "Hybrid Random Features", ICLR 2022.
    """

    name: ClassVar[str] = "cexp"
    aliases: ClassVar[tuple[str, ...]] = ()
    claims: ClassVar[tuple[Any, ...]] = (
        UnbiasedKernelEstimate(dims=(16, 64), options={"rule": "fixed", "matrix": 1.25}),
        UnbiasedKernelEstimate(dims=(16, 64)),
        EstimateVariance(variance=estimate_variance, options={"rule": "fixed", "matrix": 1.25}),
        SymbolicExpectation(derive=derive_cexp_1d),
        *CEXP_OPTION_CLAIMS,
    )

    #: buffers that are no draw (A and the statistics, replayed here, not by RedrawPolicy)
    _not_drawn: ClassVar[tuple[str, ...]] = (
        "scale",
        "matrix_q",
        "matrix_k",
        "running_mean_q",
        "running_mean_k",
        "running_var_q",
        "running_var_k",
        "running_second_q",
        "running_second_k",
        "num_batches_tracked",
    )

    def __init__(
        self,
        head_dim: int | None = None,
        num_features: int | None = None,
        *,
        rule: str = "variance",
        momentum: float = 0.1,
        eps: float = 1e-6,
        use_batch_stats: bool = True,
        matrix: float | Sequence[float] | torch.Tensor | None = None,
        orthogonal: bool = False,
        norm: str = "chi",
        generator: torch.Generator | None = None,
        sync: bool = True,
    ) -> None:
        self.sync = _check_bool("sync", sync)
        if rule not in adaptation.RULES:
            raise InputError(f"rule: expected one of {list(adaptation.RULES)}, got {rule!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, int | float) or not 0 < momentum <= 1:
            raise InputError(f"momentum: expected a number in (0, 1], got {momentum!r}")
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < math.inf:
            raise InputError(f"eps: expected a finite positive number, got {eps!r}")
        if (rule == "fixed") != (matrix is not None):
            raise InputError(
                f"matrix: expected a matrix exactly when rule='fixed', got rule={rule!r}, matrix={matrix!r}"
            )
        self.rule = rule
        self.momentum = float(momentum)
        self.eps = float(eps)
        self.use_batch_stats = _check_bool("use_batch_stats", use_batch_stats)
        self._matrix_option = None if matrix is None else torch.as_tensor(matrix, dtype=torch.float64)
        if self._matrix_option is not None and self._matrix_option.dim() > 2:
            raise InputError(f"matrix: expected a float, a [d] vector or a [d, d] matrix, got {matrix!r}")
        super().__init__(head_dim, num_features, orthogonal=orthogonal, norm=norm, generator=generator)
        #: A (its buffers, by reference) of checkpointed training calls whose recompute may come
        self._adapted = PendingDraws()
        #: the last call's A while a recompute shows an earlier call's
        self._adapted_latest: dict[str, torch.Tensor] | None = None

    # ------------------------------------------------------------------ layout
    @property
    def diagonal(self) -> bool:
        """Whether :math:`A` is diagonal (stored as ``scale [d]``)."""
        if self.rule in ("means", "variance"):
            return True
        if self.rule == "fixed":
            assert self._matrix_option is not None
            return self._matrix_option.dim() < 2
        return False

    def _build(self, head_dim: int) -> None:
        super()._build(head_dim)
        d = head_dim
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        if self.rule == "identity":
            return
        if self.diagonal:
            self.register_buffer("scale", torch.ones(d))
        else:
            self.register_buffer("matrix_q", torch.eye(d))
            self.register_buffer("matrix_k", torch.eye(d))
        if self.rule in ("means", "variance", "full"):
            self.register_buffer("running_mean_q", torch.zeros(d))
            self.register_buffer("running_mean_k", torch.zeros(d))
            self.register_buffer("running_var_q", torch.ones(d))
            self.register_buffer("running_var_k", torch.ones(d))
        if self.rule == "full":
            self.register_buffer("running_second_q", torch.eye(d))
            self.register_buffer("running_second_k", torch.eye(d))
        if self.rule == "fixed":
            self._set_fixed(self._matrix_option, d)

    def _set_fixed(self, a: torch.Tensor | None, d: int) -> None:
        assert a is not None
        if a.dim() == 0:
            a = a.expand(d)
        if a.dim() == 1:
            if a.shape[0] != d:
                raise InputError(f"matrix: expected a [d] = [{d}] diagonal, got shape {tuple(a.shape)}")
            if not bool((a != 0).all()):
                raise InputError(f"matrix: expected a diagonal without zeros (A invertible), got {a.tolist()}")
            self.scale.copy_(a.to(self.scale))
            return
        if tuple(a.shape) != (d, d):
            raise InputError(f"matrix: expected shape [d, d] = [{d}, {d}], got {tuple(a.shape)}")
        sv = torch.linalg.svdvals(a)
        if not bool(sv.min() > 1e-12 * sv.max()):
            raise InputError(f"matrix: expected an invertible matrix, got singular values {sv.tolist()}")
        self.matrix_q.copy_(a.to(self.matrix_q))
        self.matrix_k.copy_(torch.linalg.inv(a).mT.to(self.matrix_k))

    @torch.no_grad()
    def set_matrix(self, matrix: float | Sequence[float] | torch.Tensor) -> None:
        """Replace :math:`A` of a ``rule="fixed"`` map (same layout: diagonal or ``[d, d]``),
        stored in the buffers' dtype (call after ``.double()`` for float64 precision)."""
        if self.rule != "fixed":
            raise InputError(f"matrix: set_matrix needs rule='fixed', got rule={self.rule!r}")
        a = torch.as_tensor(matrix, dtype=torch.float64)
        if (a.dim() < 2) != self.diagonal:
            layout = "a float or a [d] vector" if self.diagonal else "a [d, d] matrix"
            raise InputError(f"matrix: expected {layout} as at construction, got shape {tuple(a.shape)}")
        if not self.built:
            self._matrix_option = a
            return
        assert self.head_dim is not None
        self._set_fixed(a, self.head_dim)

    # ------------------------------------------------------------------ statistics and A
    def matrices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The current :math:`A` and :math:`A^{-T}` as ``[d, d]`` tensors."""
        if not self.built:
            raise InputError(f"{self.name!r}: matrices() needs the head dimension; call build(head_dim) first")
        assert self.head_dim is not None
        if self.rule == "identity":
            eye = torch.eye(self.head_dim, dtype=self.omega.dtype, device=self.omega.device)
            return eye, eye.clone()
        if self.diagonal:
            return torch.diag(self.scale), torch.diag(1.0 / self.scale)
        return self.matrix_q.clone(), self.matrix_k.clone()

    def _set_from(self, mean_q, var_q, mean_k, var_k, second_q, second_k) -> None:  # type: ignore[no-untyped-def]
        if self.rule == "means":
            a = adaptation.means_scale(mean_q, mean_k, self.eps)
        elif self.rule == "variance":
            a = adaptation.variance_scale(mean_q, var_q, mean_k, var_k, self.eps)
        else:  # full
            aq, ak = adaptation.full_matrices(second_q.double(), second_k.double(), self.eps)
            self.matrix_q.copy_(aq)
            self.matrix_k.copy_(ak)
            return
        self.scale.copy_(a)

    def _set_from_running(self) -> None:
        full = self.rule == "full"
        self._set_from(
            self.running_mean_q.double(),
            self.running_var_q.double(),
            self.running_mean_k.double(),
            self.running_var_k.double(),
            self.running_second_q.double() if full else None,
            self.running_second_k.double() if full else None,
        )

    def _update_running(self, mq: adaptation.Moments, mk: adaptation.Moments, momentum: float) -> None:
        if int(self.num_batches_tracked) == 0:
            momentum = 1.0  # the first batch initialises the running statistics
        pairs = [
            (self.running_mean_q, mq.mean),
            (self.running_var_q, mq.var),
            (self.running_mean_k, mk.mean),
            (self.running_var_k, mk.var),
        ]
        if self.rule == "full":
            pairs += [(self.running_second_q, mq.second), (self.running_second_k, mk.second)]
        for buf, new in pairs:
            buf.lerp_(new.to(buf), momentum)
        self.num_batches_tracked += 1

    def _set_identity(self) -> None:
        """A = I: the map is exactly PRF until statistics exist."""
        if self.diagonal:
            self.scale.fill_(1.0)
        else:
            eye = torch.eye(self.matrix_q.shape[-1], dtype=self.matrix_q.dtype, device=self.matrix_q.device)
            self.matrix_q.copy_(eye)
            self.matrix_k.copy_(eye)

    def _a_names(self) -> tuple[str, ...]:
        return ("scale",) if self.diagonal else ("matrix_q", "matrix_k")

    def _a_now(self) -> dict[str, torch.Tensor]:
        return {n: self._buffers[n] for n in self._a_names()}  # type: ignore[misc]

    def _own_a(self) -> None:
        """Before :math:`A` changes in place: end a replay, and give the map copies of A's
        buffers while a checkpointed call's recompute still needs the current ones."""
        self._end_replay()
        if len(self._adapted):
            for n in self._a_names():
                self._buffers[n] = self._buffers[n].clone()  # type: ignore[union-attr]

    def _replay_a(self) -> None:
        """In a checkpoint recompute: show the :math:`A` of the call it replays until the
        features are computed (:meth:`_end_replay`, which the estimator calls right after
        the recompute's forward computation; else at the end of the backward pass or
        at the next call)."""
        shown = self._a_now()
        latest = self._adapted_latest if self._adapted_latest is not None else shown
        want = self._adapted.replay(latest, f"{self.name}'s data-adapted matrix A (rule={self.rule!r})")
        if same_draws(want, shown):
            return
        self._buffers.update(want)  # type: ignore[arg-type]
        if self._adapted_latest is None:
            self._adapted_latest = latest
            after_backward(self._end_replay)

    def _end_replay(self) -> None:
        """Put the last call's :math:`A` back after a replay: right after the recompute's
        forward computation (:meth:`~kernelattn_core.redraw.RedrawPolicy.end_replay` calls
        it); else at the end of the backward pass, or at the next call."""
        if self._adapted_latest is not None:
            latest, self._adapted_latest = self._adapted_latest, None
            self._buffers.update(latest)  # type: ignore[arg-type]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        # a loaded A is never overwritten by a restore still pending from a recompute (a
        # backward pass that raised before its end): the map keeps what is loaded into it
        self._adapted_latest = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @torch.no_grad()
    def prepare(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> None:
        """Update the statistics (training) and set :math:`A` before features are made.

        * eval: :math:`A` from the frozen running statistics; :math:`A = I` (plain PRF)
          while none have been tracked, so an eval output never depends on the rest of
          its batch;
        * training, non-causal: :math:`A` from this batch (``use_batch_stats``) or the
          running statistics, which are then updated;
        * training, causal: :math:`A` from the running statistics of *earlier* batches
          only (:math:`A = I` before the first), because this batch's statistics
          include later tokens and would leak them into earlier outputs;
        * the recompute of an activation checkpoint (a training call inside a backward
          pass, :func:`~kernelattn_core.redraw.recomputing`): no statistic is updated and
          :math:`A` is the one the call it replays set: a training call inside a checkpoint
          records its :math:`A` (by reference, kept until the checkpoint's graph is freed;
          :math:`A` is then changed in copies), and a recompute of an earlier call than the
          last shows that call's :math:`A` for its forward computation (the last call's is
          put back right after it). A recompute that
          cannot be matched to its call while another pending call had another :math:`A`
          raises :class:`~kernelattn_core.errors.ReplayError`.

        Padded keys (``key_padding_mask``) enter no statistic.

        Parameters
        ----------
        q : Tensor ``[B, H, N, d]`` (or any ``[..., d]``)
            Scaled queries.
        k : Tensor ``[B, H, M, d]`` (or any ``[..., d]``)
            Scaled keys.
        key_padding_mask : Tensor ``[B, M]`` of bool, optional
        causal : bool
        """
        if self.rule in ("identity", "fixed"):
            return
        if not self.built:
            self.build(q.shape[-1])
        for arg, x in (("q", q), ("k", k)):  # before any statistic is copied into A
            if x.shape[-1] != self.head_dim:
                raise InputError(f"{arg}: expected last dimension d = {self.head_dim}, got shape {tuple(x.shape)}")
        if self.training and recomputing():
            # an activation checkpoint's recompute replays the training call that made the
            # output: A as that call set it, and the batch is not counted again
            self._replay_a()
            return
        self._own_a()
        tracked = int(self.num_batches_tracked) > 0
        if not self.training:
            self._set_from_running() if tracked else self._set_identity()  # frozen
            return
        full = self.rule == "full"
        if self.sync and _group_size() > 1:  # every replica: the statistics of the pooled batch
            mq = _synced_moments(q, full=full)
            mk = _synced_moments(k, full=full, padding=key_padding_mask)
        else:
            mq = adaptation.moments(q, full=full)
            mk = adaptation.moments(k, full=full, padding=key_padding_mask)
        # a batch with no (finite, unpadded) query or key has no statistics: it neither
        # sets A nor enters the running estimates, which never store a non-finite value
        usable = mq.count > 0 and mk.count > 0 and _all_finite(mq, mk)
        if self.use_batch_stats and not causal and usable:
            self._set_from(mq.mean, mq.var, mk.mean, mk.var, mq.second, mk.second)
        elif tracked:
            self._set_from_running()
        else:
            self._set_identity()
        if usable:
            self._update_running(mq, mk, self.momentum)
        token = checkpoint_token()
        if token is not None:
            self._adapted.add(token, self._a_now())

    @torch.no_grad()
    def fit(self, x: torch.Tensor, y: torch.Tensor) -> ComplexExponentialFeatures:
        """Set the running statistics (and :math:`A`) from queries ``x [..., d]`` and keys ``y [..., d]``.

        The data are in the coordinates the map sees (already scaled). Returns ``self``.
        """
        if not self.built:
            self.build(x.shape[-1])
        if self.rule in ("identity", "fixed"):
            return self
        self._own_a()
        full = self.rule == "full"
        mx, my = adaptation.moments(x, full=full), adaptation.moments(y, full=full)
        for arg, m, t in (("x", mx, x), ("y", my, y)):
            if m.count == 0 or not _all_finite(m):
                raise InputError(
                    f"{arg}: fit needs at least one finite row [..., d], got none in shape {tuple(t.shape)}"
                )
        self.num_batches_tracked.zero_()
        self._update_running(mx, my, 1.0)
        self._set_from_running()
        return self

    # ------------------------------------------------------------------ features
    def transform(self, x: torch.Tensor, *, query: bool) -> torch.Tensor:
        """:math:`Ax` for queries (``query=True``), :math:`A^{-T}y` for keys; ``x [..., d]``."""
        if self.rule == "identity":
            return x
        if self.diagonal:
            a = self.scale.to(dtype=x.dtype, device=x.device)
            return x * a if query else x / a
        mat = (self.matrix_q if query else self.matrix_k).to(dtype=x.dtype, device=x.device)
        return x @ mat.mT  # row vectors: (M x)^T = x^T M^T

    def extra_repr(self) -> str:
        return super().extra_repr() + f", rule={self.rule!r}, sync={self.sync}"


class HyperbolicComplexExponentialFeatures(ComplexExponentialFeatures):
    """HCEXP: the two-sided CEXP map, :math:`2m` features.

    .. math:: \\phi_q(x)^\\top\\phi_k(y) = \\frac{1}{m} e^{-(\\|Ax\\|^2 + \\|A^{-T}y\\|^2)/2}
              \\sum_{i=1}^m \\cosh(\\omega_i^\\top z), \\qquad z = Ax + A^{-T}y,

    with MSE :math:`\\frac{1}{2m}\\mathrm{SM}^2\\,(2\\sinh(\\|z\\|^2/2))^2` (Lemma 3.1). With
    ``rule="identity"`` it is ``prf-hyperbolic`` bit for bit. Options as
    :class:`ComplexExponentialFeatures`.
    """

    name: ClassVar[str] = "hcexp"
    two_sided: ClassVar[bool] = True
    claims: ClassVar[tuple[Any, ...]] = (
        UnbiasedKernelEstimate(dims=(16, 64), options={"rule": "fixed", "matrix": 1.25}),
        UnbiasedKernelEstimate(dims=(16, 64)),
        EstimateVariance(variance=estimate_variance, options={"rule": "fixed", "matrix": 1.25}),
        SymbolicExpectation(derive=derive_hcexp_1d),
        *CEXP_OPTION_CLAIMS,
    )
