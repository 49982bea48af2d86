"""RMFA (random Maclaurin feature attention) and SchoenbAt / Macformer (ppSBN + RMFA)."""

from __future__ import annotations

import inspect
import math
from typing import Any, ClassVar

import torch

from kernelattn_core import FeatureMap, FeatureMapAttention, Normalizer, get_registry
from kernelattn_core.toolkit import ConsistentAttention, InputError, check_scale

from .claims import OPTION_CLAIMS
from .feature_maps import RandomMaclaurinFeatures
from .normalizers import PPSBN


class RMFA(FeatureMapAttention):
    """Random Maclaurin feature attention (Theorem 1 of SchoenbAt / Macformer).

    .. math::
        \\mathrm{RMFA}_K(Q, K, V)_i = \\frac{\\Phi(q_i)^\\top \\sum_j \\Phi(k_j) v_j^\\top}
                                          {\\Phi(q_i)^\\top \\sum_j \\Phi(k_j)}

    with :math:`\\Phi` the random Maclaurin features (``rmf``) of the dot-product kernel
    :math:`K` applied to :math:`d^{-1/4} q` and :math:`d^{-1/4} k`, in
    :math:`O(N D d_v)` time (non-causal: sums; causal: the core's chunked prefix form,
    no ``[N, D, d_v]`` tensor). Padded keys leave numerator and denominator.

    **Consistent, not unbiased.** Numerator and denominator are unbiased for those of
    exact kernelized attention, but the ratio is not: the papers' unbiasedness theorem
    (Macformer Thm 1, SchoenbAt Thm 3) moves the expectation through the ratio. The
    bias is :math:`O(1/D)` and measured to shrink with ``num_features`` (README).
    Features are signed, so a denominator can be near zero at small :math:`D`.

    Parameters
    ----------
    feature_map : str or FeatureMap
        ``"rmf"`` by default; the ``rmf`` options below build it when it is a name.
    normalizer : str or Normalizer
        ``"row"`` by default (``"ppsbn"`` gives :class:`SchoenbAt`'s pipeline).
    num_features : int, optional
        The budget :math:`D` (128 by default).
    kernel, kernel_options, p, projection, mode, max_degree, check
        Options of :class:`~kernelattn_maclaurin.feature_maps.RandomMaclaurinFeatures`.
    head_dim, redraw_every, seed, chunk_size, backend, scale
        As for :class:`~kernelattn_core.FeatureMapAttention` (features are drawn once,
        as in the authors' code, unless ``redraw_every > 0``).
    **normalizer_options
        Options of the normaliser when it is given by name (for ``ppsbn``: ``bn_eps``,
        ``stats``, ``power``, ``channels``).

    Examples
    --------
    >>> import torch, kernelattn_core as ka
    >>> est = ka.create("rmfa", num_features=64, kernel="exp", seed=0)
    >>> q = k = v = torch.randn(1, 2, 10, 16)
    >>> est(q, k, v, causal=True).shape
    torch.Size([1, 2, 10, 16])
    """

    name: ClassVar[str] = "rmfa"
    aliases: ClassVar[tuple[str, ...]] = ()
    unbiased: ClassVar[bool] = False
    consistent: ClassVar[bool] = True
    supports_causal: ClassVar[bool] = True
    random: ClassVar[bool] = True
    has_budget: ClassVar[bool] = True
    linear: ClassVar[bool] = True
    claims: ClassVar[tuple[Any, ...]] = (
        ConsistentAttention(
            biased_at_finite_budget=None, budgets=(16, 256), options={"kernel": "exp", "mode": "released"}
        ),
        ConsistentAttention(biased_at_finite_budget=None, budgets=(64, 512), options={"kernel": "exp"}),
    )
    default_normalizer: ClassVar[str] = "row"

    def __init__(
        self,
        feature_map: FeatureMap | str = "rmf",
        normalizer: Normalizer | str | None = None,
        *,
        num_features: int | None = None,
        head_dim: int | None = None,
        redraw_every: int = 0,
        seed: int | None = None,
        chunk_size: int = 64,
        backend: str | None = None,
        scale: float | None = None,
        kernel: Any = "exp",
        kernel_options: dict[str, Any] | None = None,
        p: float = 2.0,
        projection: str = "rademacher",
        mode: str = "paper",
        max_degree: int | None = None,
        check: bool = True,
        **normalizer_options: Any,
    ) -> None:
        registry = get_registry()
        if isinstance(feature_map, str):
            feature_map = registry.feature_map(feature_map)(
                num_features=num_features,
                kernel=kernel,
                kernel_options=kernel_options,
                p=p,
                projection=projection,
                mode=mode,
                max_degree=max_degree,
                check=check,
            )
        elif num_features is not None:
            raise InputError("num_features: goes with a feature-map name, not an instance")
        if normalizer is None:
            normalizer = self.default_normalizer
        if isinstance(normalizer, str):
            normalizer = _construct_normalizer(registry.normalizer(normalizer), normalizer_options)
        elif normalizer_options:
            raise InputError(f"{sorted(normalizer_options)}: normaliser options go with a normaliser name")
        scale = check_scale(scale)  # before it is used: a bad scale names the argument
        if isinstance(normalizer, PPSBN) and scale is not None and normalizer.row_scale is None:
            normalizer.row_scale = math.sqrt(scale)  # pre-scaling fixes the row norm: keep the asked scale
        super().__init__(
            feature_map,
            normalizer,
            head_dim=head_dim,
            redraw_every=redraw_every,
            seed=seed,
            chunk_size=chunk_size,
            backend=backend,
            scale=scale,
        )

    @property
    def kernel(self) -> Any:
        """The target dot-product kernel of the features."""
        fm = self.feature_map
        return fm.target if isinstance(fm, RandomMaclaurinFeatures) else None

    def step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        state: Any = None,
        *,
        key_padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """Causal decoding from a cached state (see :meth:`kernelattn_core.FeatureMapAttention.step`);
        refused with ppSBN batch statistics, which would be statistics of the new positions only."""
        if isinstance(self.normalizer, PPSBN) and self.normalizer.stats == "batch":
            raise InputError(
                "normalizer: ppSBN with stats='batch' cannot decode step by step (its statistics span the "
                "whole sequence); use stats='token'"
            )
        return super().step(q, k, v, state, key_padding_mask=key_padding_mask)

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        norm = self.normalizer
        if isinstance(norm, PPSBN) and norm.stats == "batch":
            if causal:
                raise InputError(
                    "causal: ppSBN with stats='batch' mixes statistics over all positions (a causality leak); "
                    "use stats='token' for causal attention"
                )
        return super()._attend(q, k, v, causal, key_padding_mask)


class SchoenbAt(RMFA):
    """SchoenbAt / Macformer attention: ppSBN around RMFA.

    .. math::
        \\mathrm{SchoenbAt}_K(Q, K, V) = \\gamma \\cdot
        \\mathrm{sign}(A)\\,|A|^{\\beta}, \\qquad
        A = \\mathrm{RMFA}_K\\big(\\overrightarrow{\\mathrm{SBN}}(Q), \\overrightarrow{\\mathrm{SBN}}(K), V\\big),

    where :math:`\\overrightarrow{\\mathrm{SBN}}` centres, standardises and
    L2-normalises each row (:class:`~kernelattn_maclaurin.normalizers.PPSBN`), so the
    kernel arguments lie in :math:`[-d^{-1/2}, d^{-1/2}]` and the radius-one kernels
    (``inv``, ``logi``, ``sqrt``) are always in their domain (with finite variance for
    :math:`d > 6` at :math:`p = 2`). The same method is called Macformer in the earlier
    paper; ``macformer`` is an alias.

    **Target.** With :math:`\\gamma = \\beta = 1` the output estimates exact kernelized
    attention *on the pre-scaled inputs*, not softmax attention of the raw inputs (the
    papers' Theorem 2/3 "restoration" by :math:`\\gamma, \\beta` is not an identity), so
    ``consistent`` is ``False`` with respect to the raw-input target. Its error on
    pre-scaled inputs shrinks with ``num_features`` like RMFA's.

    **Two post-transforms.** Algorithm 1 of the SchoenbAt paper applies
    :math:`\\gamma\\,\\mathrm{sign}(A)|A|^{\\beta}` (the default, ``post_form="gamma_pow"``,
    so trained models keep their meaning); §3.2 writes :math:`(\\gamma A)^{\\beta}`
    (``post_form="pow_gamma"``, a signed power). ``power=False`` keeps only
    :math:`\\gamma`. See :doc:`/departures`.

    Parameters
    ----------
    bn_eps, stats, power, channels, post_form
        ppSBN options (see :class:`~kernelattn_maclaurin.normalizers.PPSBN`); they apply
        to the default ``ppsbn`` normaliser only.
    **options
        As for :class:`RMFA`.

    Examples
    --------
    >>> import torch, kernelattn_core as ka
    >>> attn = ka.KernelAttention(
    ...     32, 4, estimator="schoenbat", num_features=64, kernel="logi", seed=0, batch_first=True
    ... )
    >>> out, _ = attn(torch.randn(2, 10, 32))
    >>> out.shape
    torch.Size([2, 10, 32])
    """

    name: ClassVar[str] = "schoenbat"
    aliases: ClassVar[tuple[str, ...]] = ("macformer",)
    consistent: ClassVar[bool] = False
    claims: ClassVar[tuple[Any, ...]] = OPTION_CLAIMS["schoenbat"]
    default_normalizer: ClassVar[str] = "ppsbn"

    def __init__(
        self,
        feature_map: FeatureMap | str = "rmf",
        normalizer: Normalizer | str | None = None,
        *,
        bn_eps: float = 1e-12,
        stats: str = "token",
        power: bool = True,
        channels: int | None = None,
        post_form: str | None = None,
        **options: Any,
    ) -> None:
        if normalizer is None or normalizer in ("ppsbn", "pp-sbn"):
            options.update(bn_eps=bn_eps, stats=stats, power=power, channels=channels, post_form=post_form)
        elif post_form is not None:
            raise InputError(
                f"post_form: applies to the ppsbn normaliser only; got post_form={post_form!r} with "
                f"normalizer={normalizer!r} (pass post_form to that normaliser instead)"
            )
        super().__init__(feature_map, normalizer, **options)


def _construct_normalizer(cls: type, options: dict[str, Any]) -> Normalizer:
    """``cls(**options)`` with an error naming unknown options and the accepted ones."""
    params = inspect.signature(cls.__init__).parameters
    accepted = [n for n, p in params.items() if n != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
    unknown = sorted(set(options) - set(accepted))
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise InputError(
            f"options: unknown option(s) {unknown} for normalizer {cls.name!r} and the rmf feature map; "
            f"accepted normalizer options: {accepted}"
        )
    return cls(**options)
