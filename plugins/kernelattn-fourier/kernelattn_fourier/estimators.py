"""Estimator presets: feature-map attention with a trigonometric map and the
``signed-row`` normaliser, and the gated causal RFA (``rfa-gate``)."""

from __future__ import annotations

import inspect
import math
from typing import Any, ClassVar

import torch

from kernelattn_core import FeatureMapAttention, Normalizer
from kernelattn_core.toolkit import (
    AttentionEstimator,
    InputError,
    RedrawPolicy,
    StateOwner,
    check_key_padding_mask,
    check_positive_int,
    check_qkv,
    check_state,
    check_state_tensor,
    continued_sums,
    isolated_pre,
    isolated_rows,
    masks_nothing,
    non_finite_rows,
    resolve_class,
)

from .claims import OPTION_CLAIMS
from .feature_maps import RFAFeatures, TrigSoftmaxFeatures
from .gate import Gate, GateState, gated_step_finite, gated_sums_state
from .normalizers import SignedRowNormalizer


def _normalizer(normalizer: Normalizer | str | None) -> Normalizer | str:
    return SignedRowNormalizer() if normalizer is None else normalizer


class TrigSoftmaxAttention(FeatureMapAttention):
    """Softmax attention through the trigonometric features (``trig-softmax-features``)
    with the ``signed-row`` normaliser.

    .. math:: \\mathrm{out}_i = \\frac{\\mathrm{den}_i\\, \\mathrm{num}_i}{\\mathrm{den}_i^2 + \\tau_i^2},
              \\quad \\mathrm{num}_i = \\phi(q_i)^\\top \\sum_j \\phi(k_j) v_j^\\top, \\quad
              \\mathrm{den}_i = \\phi(q_i)^\\top \\sum_j \\phi(k_j)

    with :math:`\\phi(x) = e^{\\|x\\|^2/2}[\\sin \\omega^\\top x, \\cos \\omega^\\top x]/\\sqrt m`
    (unbiased for :math:`e^{q^\\top k}`, not positive). Self-normalised, so biased at finite
    ``num_features`` and consistent as it grows.

    Parameters
    ----------
    num_features : int, optional
        Frequencies :math:`m` (feature dimension :math:`2m`; default 256).
    normalizer : Normalizer or str, optional
        ``SignedRowNormalizer()`` by default; ``"row"`` gives plain division.
    orthogonal : bool
        Orthogonal (Haar) frequencies.
    head_dim, redraw_every, seed, chunk_size, backend, scale
        As for :class:`~kernelattn_core.FeatureMapAttention`.
    """

    name: ClassVar[str] = "trig-softmax"
    unbiased: ClassVar[bool] = False
    consistent: ClassVar[bool] = True
    random: ClassVar[bool] = True
    has_budget: ClassVar[bool] = True
    linear: ClassVar[bool] = True
    claims: ClassVar[tuple[Any, ...]] = OPTION_CLAIMS["trig-softmax"]

    def __init__(
        self,
        *,
        num_features: int | None = None,
        normalizer: Normalizer | str | None = None,
        orthogonal: bool = False,
        head_dim: int | None = None,
        redraw_every: int = 0,
        seed: int | None = None,
        chunk_size: int = 64,
        backend: str | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__(
            TrigSoftmaxFeatures(num_features=num_features, orthogonal=orthogonal),
            _normalizer(normalizer),
            head_dim=head_dim,
            redraw_every=redraw_every,
            seed=seed,
            chunk_size=chunk_size,
            backend=backend,
            scale=scale,
        )


class RFAAttention(FeatureMapAttention):
    """Random feature attention (Peng et al., 2021), the baseline of the source papers.

    Feature-map attention with :class:`~kernelattn_fourier.feature_maps.RFAFeatures`
    (trigonometric features of unit-normalised queries and keys, learnable scale
    :math:`\\sigma_h`) and the ``signed-row`` normaliser; it estimates

    .. math:: \\mathrm{out}_i \\approx \\sum_j
              \\frac{e^{\\hat q_i^\\top \\hat k_j / \\sigma_h^2}}
              {\\sum_{j'} e^{\\hat q_i^\\top \\hat k_{j'} / \\sigma_h^2}} v_j,
              \\qquad \\hat x = x / \\|x\\| .

    The :math:`d^{-1/4}` scaling of the package convention is removed by the
    normalisation; :math:`1/\\sigma_h^2` plays the role of the temperature.

    Parameters
    ----------
    num_features : int, optional
        Frequencies :math:`m` (default 128; feature dimension :math:`2m`).
    num_heads : int, optional
        One learnable scale per head (inputs with ``H = num_heads``); one shared scale
        when ``None``.
    init_scale : float
        Initial :math:`\\sigma` (default 1).
    learn_scale : bool
        Train :math:`\\sigma` (default ``True``).
    orthogonal : bool
        Orthogonal (Haar) directions (Peng et al. use i.i.d.; default ``False``).
    normalizer : Normalizer or str, optional
        ``SignedRowNormalizer()`` by default.
    head_dim, redraw_every, seed, chunk_size, backend, scale
        As for :class:`~kernelattn_core.FeatureMapAttention`.
    """

    name: ClassVar[str] = "rfa"
    unbiased: ClassVar[bool] = False
    consistent: ClassVar[bool] = True
    random: ClassVar[bool] = True
    has_budget: ClassVar[bool] = True
    linear: ClassVar[bool] = True
    claims: ClassVar[tuple[Any, ...]] = OPTION_CLAIMS["rfa"]

    def __init__(
        self,
        *,
        num_features: int | None = None,
        num_heads: int | None = None,
        init_scale: float = 1.0,
        learn_scale: bool = True,
        orthogonal: bool = False,
        normalizer: Normalizer | str | None = None,
        head_dim: int | None = None,
        redraw_every: int = 0,
        seed: int | None = None,
        chunk_size: int = 64,
        backend: str | None = None,
        scale: float | None = None,
    ) -> None:
        fm = RFAFeatures(
            num_features=num_features,
            num_heads=num_heads,
            init_scale=init_scale,
            learn_scale=learn_scale,
            orthogonal=orthogonal,
        )
        super().__init__(
            fm,
            _normalizer(normalizer),
            head_dim=head_dim,
            redraw_every=redraw_every,
            seed=seed,
            chunk_size=chunk_size,
            backend=backend,
            scale=scale,
        )


class RFAGateAttention(AttentionEstimator):
    """RFA-Gate (Peng et al., 2021, §3.2, Eq. 7): causal random feature attention with a
    learned forget gate, a recency bias.

    .. math::
        g_t = \\sigma(w_h^\\top k_t + b_h), \\qquad
        S_t = g_t S_{t-1} + (1 - g_t)\\, \\phi(k_t) v_t^\\top, \\qquad
        z_t = g_t z_{t-1} + (1 - g_t)\\, \\phi(k_t),

    .. math::
        \\mathrm{out}_t = \\mathrm{post}\\!\\left(\\frac{\\phi(q_t)^\\top S_t}{\\phi(q_t)^\\top z_t}\\right),
        \\qquad S_0 = 0,\\ z_0 = 0,

    with :math:`\\phi` the RFA features (:class:`~kernelattn_fourier.feature_maps.RFAFeatures`:
    trigonometric features of unit-normalised inputs, learnable scale :math:`\\sigma_h`)
    and the ``signed-row`` division (the trigonometric :math:`\\phi(q_t)^\\top z_t` can be
    near zero or negative). Unrolled, query :math:`t` weighs key :math:`j \\le t` by
    :math:`(1 - g_j) \\prod_{j < i \\le t} g_i \\; \\phi(q_t)^\\top\\phi(k_j)`.

    The recurrence is computed in chunks (:func:`~kernelattn_fourier.gate.gated_sums`,
    decays :math:`e^{G_t - G_j} \\le 1` from cumulative log-gates, all chunks in batched
    products and the chunk-state scan with its own backward), linear in :math:`N` in
    training too; :func:`~kernelattn_fourier.gate.gated_sums_naive`
    is the per-position reference the tests compare it with.

    **Causal only.** The gate orders the keys in time, so the paper defines RFA-Gate in
    causal attention only; ``causal=False`` is refused with an
    :class:`~kernelattn_core.errors.InputError` (``supports_noncausal = False``, which the
    conformance kit and the fuzz suite read). **Not a softmax estimator**: the gate
    changes the target (``consistent = False``); with :math:`g \\equiv 1` it is causal
    ``rfa`` (without the :math:`1 - g` factor, which cancels in the ratio when constant).

    Departures from the paper (documented in ``docs/departures.rst``): the gate reads the
    scaled key :math:`k_t` instead of the layer input :math:`x_t` (:math:`k_t = W_k x_t`,
    so the family of gates is that of :math:`x_t` restricted to the key projection's
    row space); Peng et al. give no padding rule, here a padded position keeps the state
    (:math:`g = 1`, no update).

    Parameters
    ----------
    num_features : int, optional
        Frequencies :math:`m` (default 128; feature dimension :math:`2m`).
    num_heads : int, optional
        One learnable scale and one gate per head (inputs with ``H = num_heads``); shared
        by every head when ``None``.
    init_scale : float
        Initial :math:`\\sigma` (default 1).
    learn_scale : bool
        Train :math:`\\sigma` (default ``True``).
    orthogonal : bool
        Orthogonal (Haar) directions (default ``False``).
    init_gate_bias : float
        Initial gate bias :math:`b_h` (default 2: :math:`g \\approx 0.88`); the gate weight
        starts at zero.
    normalizer : Normalizer or str, optional
        ``SignedRowNormalizer()`` by default.
    head_dim : int, optional
        Build the map and the gate now (otherwise on the first call).
    redraw_every, seed, scale
        As for :class:`~kernelattn_core.FeatureMapAttention`.
    chunk_size : int
        Positions per chunk of the causal form (default 64).

    Attributes
    ----------
    feature_map : RFAFeatures
    gate : Gate
        ``weight [H, d]``, ``bias [H]`` (``H = 1`` when shared).
    normalizer : Normalizer

    Examples
    --------
    >>> import torch, kernelattn_core as ka
    >>> est = ka.create("rfa-gate", num_features=32, seed=0)
    >>> q = k = v = torch.randn(1, 2, 10, 16)
    >>> est(q, k, v, causal=True).shape
    torch.Size([1, 2, 10, 16])
    """

    name: ClassVar[str] = "rfa-gate"
    unbiased: ClassVar[bool] = False
    consistent: ClassVar[bool] = False
    supports_causal: ClassVar[bool] = True
    supports_noncausal: ClassVar[bool] = False
    random: ClassVar[bool] = True
    has_budget: ClassVar[bool] = True
    linear: ClassVar[bool] = True
    claims: ClassVar[tuple[Any, ...]] = OPTION_CLAIMS["rfa-gate"]

    def __init__(
        self,
        *,
        num_features: int | None = None,
        num_heads: int | None = None,
        init_scale: float = 1.0,
        learn_scale: bool = True,
        orthogonal: bool = False,
        init_gate_bias: float = 2.0,
        normalizer: Normalizer | str | None = None,
        head_dim: int | None = None,
        redraw_every: int = 0,
        seed: int | None = None,
        chunk_size: int = 64,
        scale: float | None = None,
    ) -> None:
        super().__init__(scale=scale)
        self.feature_map = RFAFeatures(
            num_features=num_features,
            num_heads=num_heads,
            init_scale=init_scale,
            learn_scale=learn_scale,
            orthogonal=orthogonal,
        )
        self.gate = Gate(None, num_heads, init_gate_bias)
        normalizer = _normalizer(normalizer)
        if not isinstance(normalizer, Normalizer):
            normalizer = resolve_class(normalizer, "normalizer")()
        self.normalizer = normalizer
        self.redraw_policy = RedrawPolicy(redraw_every, seed)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        if head_dim is not None:
            self.redraw_policy.initial(self.feature_map, head_dim)
            self.gate.build(head_dim)

    @property
    def num_features(self) -> int:
        """The number of frequencies :math:`m`."""
        return self.feature_map.num_features

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention output ``[B, H, N, dv]``; ``causal=False`` is refused (see the
        class docstring)."""
        check_qkv(q, k, v)
        check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[2], q.device)
        _refuse_noncausal(causal)
        return super().forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask)

    def step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        state: GateState | None = None,
        *,
        key_padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, GateState]:
        """Causal attention of new positions given the state of the earlier ones (decoding).

        Parameters
        ----------
        q, k, v : Tensor ``[B, H, T, d]``, ``[B, H, T, d]``, ``[B, H, T, dv]``
            The next ``T`` positions (``T = 1`` token by token).
        state : GateState, optional
            Returned by the previous call; ``None`` starts a sequence.
        key_padding_mask : Tensor ``[B, T]`` of bool, optional
            Padding among the new positions (they keep the state).

        Returns
        -------
        out : Tensor ``[B, H, T, dv]``
            Equal to the last ``T`` rows of ``forward(..., causal=True)`` over the whole
            sequence so far; memory and time per call do not grow with the sequence.
        state : GateState
            :math:`[S_t, z_t]` after the last new position. No redraw happens between
            steps.
        """
        if state is not None and not torch.is_grad_enabled() and masks_nothing(key_padding_mask, q):
            fast = self._step_finite(q, k, v, state)
            if fast is not None:
                return fast
        q, k, mask = self._step_inputs(q, k, v, key_padding_mask)
        if not self.feature_map.built:
            self.redraw_policy.initial(self.feature_map, q.shape[-1])
        owner = self.state_owner(q, v)
        if state is not None:
            check_state(state, GateState, owner)
            assert isinstance(state, GateState)
            d_feat, dv = self.feature_map.feature_dim, v.shape[-1]
            b, h = q.shape[:2]
            check_state_tensor("kv", state.kv, (b, h, d_feat, dv + 1), q.device, owner, "[B, H, D, dv + 1]")
            if state.poisoned is not None:
                check_state_tensor("poisoned", state.poisoned, (b, h), q.device, owner, "[B, H]")
        out, state = self._run(q, k, v, mask, state, redraw=False)
        state.owner = owner
        self._finite_step = self._finite_step_plan(q, v, owner)
        return out, state

    def _finite_step_plan(self, q: torch.Tensor, v: torch.Tensor, owner: StateOwner) -> tuple | None:
        """What :meth:`_step_finite` needs to continue a state of this call's owner (``None``
        when it cannot: another device, half precision, a normaliser with its own ``pre`` or
        ``post``, or a map that adds work of its own to its features)."""
        plain = (
            q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64)
            and type(self.normalizer).pre is Normalizer.pre
            and type(self.normalizer).post is Normalizer.post
            and self.feature_map.plain_features()
            and type(self)._step_inputs is AttentionEstimator._step_inputs
        )
        if not plain:
            return None
        b, h, _, d = q.shape
        dv = v.shape[-1]
        return (owner, (b, h, 1, d), (b, h, 1, dv), (b, h, self.feature_map.feature_dim, dv + 1), q.dtype)

    def _step_finite(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: object
    ) -> tuple[torch.Tensor, GateState] | None:
        """One decoding position on :func:`~kernelattn_fourier.gate.gated_step_finite`, or
        ``None`` for the guarded path of :meth:`step` (the chunked gated scan, which for one
        position costs about four times as much): taken only for a state of the owner the
        previous ``step`` stated (or an equal one), not poisoned, inputs of one position
        with that call's shapes and dtype on the CPU, a padding mask that pads none of them
        and no autograd; a non-finite value anywhere declines."""
        plan = continued_sums(getattr(self, "_finite_step", None), state, GateState, q, k, v)
        if plan is None:
            return None
        owner, _, _, kv_shape, dtype = plan
        fm = self.feature_map
        root = self._input_root(q.shape[-1])  # read now: the scale may change between steps
        q, k = q * root, k * root
        phi_q, phi_k = fm._features(q, True), fm._features(k, False)
        if phi_q.dtype != dtype or phi_k.shape[-1] != kv_shape[2]:
            return None
        done = gated_step_finite(phi_q, phi_k, v, self.gate(k), state, self.normalizer.normalize)
        if done is not None:
            done[1].owner = owner
            self.last_backend = "torch"
        return done

    def state_owner(self, q: torch.Tensor, v: torch.Tensor) -> StateOwner:
        """The :class:`~kernelattn_core.interfaces.state.StateOwner` of the decoding states
        made from ``q [B, H, T, d]`` and ``v [B, H, T, dv]`` (a built map)."""
        norm = getattr(self.normalizer, "name", type(self.normalizer).__name__)
        return StateOwner(
            type(self).__name__,
            (("num_features", self.num_features), ("normalizer", norm)),
            q.shape[0],
            q.shape[1],
            (("D", self.feature_map.feature_dim), ("dv", v.shape[-1]), ("d", q.shape[-1])),
        )

    def _attend(self, q, k, v, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        _refuse_noncausal(causal)
        return self._run(q, k, v, key_padding_mask, None, redraw=True)[0]

    def _run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        state: GateState | None,
        *,
        redraw: bool,
    ) -> tuple[torch.Tensor, GateState]:
        out_dtype = v.dtype
        work = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype  # sums in float32
        q, k, v = q.to(work), k.to(work), v.to(work)
        if key_padding_mask is not None:  # padded keys never reach the gate or the features
            k = k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        if type(self.normalizer).pre is not Normalizer.pre:  # padded and non-finite rows never reach it
            options = {"causal": True} if "causal" in inspect.signature(self.normalizer.pre).parameters else {}
            q, k = isolated_pre(self.normalizer.pre, q, k, key_padding_mask, **options)
        fm = self.feature_map
        if not fm.built:
            self.redraw_policy.initial(fm, q.shape[-1])
        if redraw:
            self.redraw_policy.before_forward(fm, self.training)
        fm.prepare(q, k, key_padding_mask=key_padding_mask, causal=True)
        # raw features (query(q) without the cast): a refusal names q or k, not x
        phi_q, phi_k = fm.raw_features(q, query=True).to(work), fm.raw_features(k, query=False).to(work)
        bad_k = non_finite_rows(k)  # [B, H, N]: the gate never sees them (its parameters' gradients stay finite)
        if bad_k is None:
            log_g = self.gate(k)  # [B, H, N]
        else:  # a non-finite gate: the key is dropped and the rows that see it are NaN
            log_g = self.gate(k.masked_fill(bad_k[..., None], 0.0)).masked_fill(bad_k, math.nan)
        self.last_backend = "torch"
        num, den, state = gated_sums_state(
            phi_q, phi_k, v, log_g, key_padding_mask=key_padding_mask, chunk_size=self.chunk_size, state=state
        )
        out = self.normalizer.normalize(num, den)
        if type(self.normalizer).post is not Normalizer.post:
            out = isolated_rows(self.normalizer.post, out)
        return out.to(out_dtype), state

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}"


def _refuse_noncausal(causal: object) -> None:
    if causal is False:
        raise InputError(
            "causal: rfa-gate is causal only (its gate is a recurrence over positions, Peng et al. 2021, Eq. 7); "
            "got causal=False, pass causal=True"
        )
