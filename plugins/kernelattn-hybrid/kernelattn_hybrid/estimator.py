"""The ``sliding-window`` estimator: exact softmax inside a local window, a feature map
outside it, one normaliser."""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch

from kernelattn_core.toolkit import (
    AttentionEstimator,
    FeatureMap,
    InputError,
    RedrawPolicy,
    StateOwner,
    absorb_keys,
    check_positive_int,
    check_state,
    check_state_tensor,
    compute_dtype,
    continues_state,
    finite_rows,
    masks_nothing,
    one_position,
)

from . import window as window_module
from .claims import SLIDING_WINDOW_CLAIMS
from .heavy import HeavyKeys, select_heavy_keys
from .naive import leading_padding
from .window import (
    WindowState,
    empty_window_state,
    window_attention_blocked,
    window_attention_dense,
    window_step_finite,
    window_step_one,
    window_weights_rows,
)

#: smallest block length of the blocked computation (fewer, larger matmuls)
MIN_BLOCK = 32


def _nonneg_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InputError(f"{name}: expected an int >= 0, got {value!r}")
    return value


def _flags(state: WindowState) -> tuple[tuple[Any, ...], tuple[int, ...]] | None:
    """A window state's flag tensors (``valid``, ``poisoned``, ``sink_valid``, ``lead``)
    and their in-place versions; ``None`` when one of them keeps no version (an inference
    tensor, made under ``torch.inference_mode()``): such flags are checked every step."""
    tensors = (state.valid, state.poisoned, state.sink_valid, state.lead)
    if any(t is not None and t.is_inference() for t in tensors):
        return None
    return tensors, tuple(-1 if t is None else t._version for t in tensors)


def _same_flags(seen: Any, flags: tuple[tuple[Any, ...], tuple[int, ...]]) -> bool:
    """Whether ``flags`` are the very tensors of ``seen`` (the same objects, not modified since)."""
    return seen[1] == flags[1] and all(a is b for a, b in zip(seen[0], flags[0]))


class SlidingWindowAttention(AttentionEstimator):
    """Sliding-window + feature-map attention (hybrid local/global, as in LoLCATs and
    Based): exact softmax terms for the keys in a local window (and optional global
    tokens), feature-map terms for every other key, and **one** normaliser, so every
    row sums to one.

    .. math::
        \\mathrm{out}_i = \\frac{\\sum_{j \\in W_i} e^{q_i^\\top k_j} v_j
                                 + \\sum_{j \\notin W_i} \\phi_q(q_i)^\\top \\phi_k(k_j) v_j}
                                {\\sum_{j \\in W_i} e^{q_i^\\top k_j}
                                 + \\sum_{j \\notin W_i} \\phi_q(q_i)^\\top \\phi_k(k_j)}

    with :math:`W_i = \\{ j : |i - j| \\le w \\}` non-causal (``2w + 1`` keys) or
    :math:`W_i = \\{ j : i - w < j \\le i \\}` causal (the last ``w`` keys), plus the first
    ``global_tokens`` keys of the row after its leading padding (attention sinks such as
    ``[CLS]`` or a decoder's first token) for every query, plus (non-causal, with
    ``heavy_keys = s``) the :math:`s` keys of each head that draw the most attention by
    the feature map's estimate (:mod:`kernelattn_hybrid.heavy`).
    Linear in sequence length (see :mod:`kernelattn_hybrid.window`); with
    :math:`w \\ge N` it is exact softmax attention.

    The exact and feature terms share one per-row stabiliser (the log-features of the
    map and the logits are compared on one scale), so the normaliser is exact and the
    causal form never lets a later key change an earlier output.

    Parameters
    ----------
    window : int
        Half-width ``w`` non-causal, number of most recent keys causal (``0``: none).
    feature_map : FeatureMap or str
        Any registered feature map (by name, built with ``num_features``,
        ``num_heads`` when it accepts it, and ``**feature_map_options``) or an instance.
        Positive maps are expected (signed maps can give denominators near zero).
    num_features : int, optional
        The map's feature budget :math:`D`.
    num_heads : int, optional
        Passed to maps with per-head parameters (``hedgehog``); ignored by others.
    head_dim : int, optional
        Build the map now; otherwise on the first call.
    heavy_keys : int
        Non-causal only: each head's ``s`` keys of largest estimated attention mass
        :math:`\\hat c_j = \\sum_i \\phi_q(q_i)^\\top \\phi_k(k_j) / \\sum_{j'} \\phi_q(q_i)^\\top
        \\phi_k(k_{j'})` (valid keys other than the global tokens, chosen anew at every call
        in :math:`O((N + M) D)`, :mod:`kernelattn_hybrid.heavy`) are exact for every query
        (counted in :attr:`budget`). For encoders whose heads spread their attention beyond
        any window onto a few keys (all-MiniLM-L6-v2's last layers); ``0`` (default): none.
        A causal call or a decoding step refuses it (the choice reads every query).
    global_tokens : int
        The first this many keys of each row are always exact (counted in :attr:`budget`).
        They are counted from the end of the row's **leading padding**: with
        ``key_padding_mask [B, M]`` (``True`` = padded), row ``b`` whose first ``o_b`` keys
        are padded (left padding, as ``generate()`` pads batched prompts) has the global
        tokens ``o_b .. o_b + g - 1``
        (:func:`~kernelattn_hybrid.naive.leading_padding`), so the amount of left padding
        never changes a row's output. Padding that does not start the row (right padding,
        holes) moves nothing: a padded global token there is masked like any padded key.
        The window is relative and needs no offset. Cross-attention (``N != M``) offsets the
        keys' global tokens alone; the window stays at :math:`|i - j| \\le w`. The decoding
        state (:meth:`step`) keeps the same tokens in its sink slots.
    block_size : int, optional
        Block length of the blocked computation; ``max(window, 32)`` by default. Given, the
        blocked computation runs at every length; by default inputs of at most
        :data:`~kernelattn_hybrid.window.DENSE_MAX_PAIRS` query-key pairs per head take the
        dense form (:func:`~kernelattn_hybrid.window.window_attention_dense`, the same rows,
        faster there). ``last_backend`` says which ran.
    redraw_every, seed : int
        Redraw policy of random maps (see :class:`~kernelattn_core.redraw.RedrawPolicy`).
    scale : float, optional
        See :class:`~kernelattn_core.interfaces.AttentionEstimator`.
    **feature_map_options
        Passed to the map (``activation="softmax"`` for ``hedgehog``, ...).

    Examples
    --------
    >>> import torch, kernelattn_core as ka
    >>> q = k = v = torch.randn(1, 2, 16, 8, dtype=torch.float64)
    >>> est = ka.create("sliding-window", window=16, num_features=8).double()
    >>> ref = ka.create("softmax")(q, k, v)
    >>> bool(torch.allclose(est(q, k, v), ref, atol=1e-12))  # window >= N: exact
    True
    """

    name: ClassVar[str] = "sliding-window"
    aliases: ClassVar[tuple[str, ...]] = ("swa-hybrid",)
    unbiased: ClassVar[bool] = False
    consistent: ClassVar[bool] = True
    supports_causal: ClassVar[bool] = True
    random: ClassVar[bool] = False
    has_budget: ClassVar[bool] = True
    linear: ClassVar[bool] = True
    #: EN001 over every window mode, global tokens and maps; AT002 with and without global
    #: tokens (declared in :mod:`kernelattn_hybrid.claims`)
    claims: ClassVar[tuple[Any, ...]] = SLIDING_WINDOW_CLAIMS

    def __init__(
        self,
        window: int = 16,
        feature_map: FeatureMap | str = "hedgehog",
        *,
        num_features: int | None = None,
        num_heads: int | None = None,
        head_dim: int | None = None,
        global_tokens: int = 0,
        heavy_keys: int = 0,
        block_size: int | None = None,
        redraw_every: int = 0,
        seed: int | None = None,
        scale: float | None = None,
        **feature_map_options: Any,
    ) -> None:
        super().__init__(scale=scale)
        self.window = _nonneg_int("window", window)
        self.global_tokens = _nonneg_int("global_tokens", global_tokens)
        self.heavy_keys = _nonneg_int("heavy_keys", heavy_keys)
        self.block_size = None if block_size is None else check_positive_int("block_size", block_size)
        if self.block_size is not None and self.block_size < self.window:
            raise InputError(f"block_size: expected >= window ({self.window}), got {self.block_size}")
        self.num_heads = None if num_heads is None else check_positive_int("num_heads", num_heads)
        if isinstance(feature_map, FeatureMap):
            if num_features is not None or feature_map_options:
                raise InputError(
                    "feature_map: num_features and feature-map options go with a registry name, not an instance"
                )
            self.feature_map = feature_map
        elif isinstance(feature_map, str):
            from kernelattn_core.toolkit import construct as _construct
            from kernelattn_core.toolkit import get_registry

            cls = get_registry().feature_map(feature_map)
            options = dict(feature_map_options)
            if num_features is not None:
                options["num_features"] = num_features
            if num_heads is not None and "num_heads" in inspect.signature(cls.__init__).parameters:
                options["num_heads"] = num_heads
            self.feature_map = _construct("feature map", cls, "sliding-window", options)
        else:
            raise InputError(f"feature_map: expected a FeatureMap or a registered name, got {feature_map!r}")
        self.redraw_policy = RedrawPolicy(redraw_every, seed)
        if head_dim is not None:
            self.redraw_policy.initial(self.feature_map, check_positive_int("head_dim", head_dim))

    @property
    def num_features(self) -> int:
        """The feature budget :math:`D` of the map."""
        return self.feature_map.num_features

    def exact_keys(self, causal: bool = False) -> int:
        """Keys computed exactly per query: ``2w + 1`` (non-causal) or ``w`` (causal),
        plus the global tokens, plus the heavy keys (non-causal)."""
        if causal:
            return self.window + self.global_tokens
        return 2 * self.window + 1 + self.global_tokens + self.heavy_keys

    def budget(self, causal: bool = False) -> int:
        """Total per-query budget: exact keys plus features (what a budget comparison
        with pure feature maps should count)."""
        return self.exact_keys(causal) + self.feature_map.num_features

    def _global_offset(self, key_padding_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Where each row's global tokens start: its number of leading padded keys ``[B]``
        (:func:`~kernelattn_hybrid.naive.leading_padding`), or ``None`` (the keys
        ``0 .. g - 1``, the kernels' plain slices) without global tokens, without a mask, or,
        eagerly, when no row starts with a padded key (one read of ``mask[:, 0]``; compiled,
        no value is read back: the offsets, zeros then, are always passed)."""
        if self.global_tokens == 0 or key_padding_mask is None:
            return None
        if not torch.compiler.is_compiling() and not bool(key_padding_mask[:, 0].any()):
            return None
        return leading_padding(key_padding_mask)

    def _attend_scaled(self, q, k, v, root, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        # the factor is applied in _attend, on the copies that its masking makes anyway
        return self._attend(q, k, v, causal, key_padding_mask, root=root)

    def _refuse_causal_heavy(self, causal: bool, what: str = "causal") -> None:
        if causal and self.heavy_keys:
            raise InputError(
                f"{what}: sliding-window with heavy_keys={self.heavy_keys} is non-causal only (the heavy keys are "
                "chosen from every query's attention); got a causal call. Use heavy_keys=0 for causal attention "
                "and decoding"
            )

    def _heavy(self, q, k, key_padding_mask, phi_q=None, phi_k=None, query_ok=None) -> HeavyKeys | None:  # type: ignore[no-untyped-def]
        """Each head's heavy keys for scaled ``q`` and ``k`` (finite here: non-finite rows
        were zeroed), or ``None``: chosen among the valid keys that are not global tokens,
        by the queries ``query_ok [B, H, N]`` (the finite ones) that are valid (padded
        positions of self-attention count as neither). The features are the forward's own
        tensors when given (both forms), else computed here (``attention_rows``)."""
        if not self.heavy_keys:
            return None
        fm = self.feature_map
        with torch.no_grad():
            dtype = compute_dtype(q.dtype)
            lq = (fm.raw_features(q, query=True) if phi_q is None else phi_q).to(dtype)
            lk = (fm.raw_features(k, query=False) if phi_k is None else phi_k).to(dtype)
            m = k.shape[-2]
            key_valid = None if key_padding_mask is None else ~key_padding_mask
            query_valid = key_valid[:, None, :] if (key_valid is not None and q.shape[-2] == m) else None
            if query_ok is not None:
                query_valid = query_ok if query_valid is None else query_valid & query_ok
            eligible = None
            if self.global_tokens:
                pos = torch.arange(m, device=k.device)
                offset = self._global_offset(key_padding_mask)
                if offset is None:
                    eligible = (pos >= self.global_tokens)[None].expand(k.shape[0], m)
                else:
                    o = offset[:, None]
                    eligible = (pos < o) | (pos >= o + self.global_tokens)
            return select_heavy_keys(
                lq.detach(),
                lk.detach(),
                self.heavy_keys,
                log_space=fm.log_space,
                eligible=eligible,
                key_valid=key_valid,
                query_valid=query_valid,
            )

    def _attend(self, q, k, v, causal, key_padding_mask, redraw=True, root=1.0):  # type: ignore[no-untyped-def]
        self._refuse_causal_heavy(causal)
        # Keys and values that are padded, or non-finite, are zeroed before any product:
        # a matmul would spread them (0 * NaN) into queries that must not see them (padding,
        # future positions inside a block). A non-finite key or value that a query *may*
        # see makes that query's output NaN, as in exact attention. ``q`` and ``k`` are
        # scaled by ``root`` first (one fresh copy each, then masked in place).
        q, k = q.mul(root), k.mul(root)
        dead = ~(finite_rows(k) & finite_rows(v))  # [B, H, M]
        if key_padding_mask is not None:
            dead = dead & ~key_padding_mask[:, None, :]
            zero = (dead | key_padding_mask[:, None, :]).unsqueeze(-1)
        else:
            zero = dead.unsqueeze(-1)
        k.masked_fill_(zero, 0.0)
        v = v.masked_fill(zero, 0.0)
        # a non-finite query spoils its own row only: kept out of the products too, or its
        # NaN row would send 0 * NaN into the keys' and values' gradients of every row
        bad_q = ~finite_rows(q)  # [B, H, N]
        q.masked_fill_(bad_q.unsqueeze(-1), 0.0)
        out = self._attend_finite(q, k, v, causal, key_padding_mask, redraw, query_ok=~bad_q)
        if causal:
            poisoned = dead.cummax(-1).values[..., : q.shape[-2]]  # [B, H, N]: some earlier key is non-finite
        else:
            poisoned = dead.any(-1, keepdim=True).expand(q.shape[:-1])
        return out.masked_fill((poisoned | bad_q).unsqueeze(-1), float("nan"))

    def _attend_finite(self, q, k, v, causal, key_padding_mask, redraw=True, query_ok=None):  # type: ignore[no-untyped-def]
        fm = self.feature_map
        if not fm.built:
            self.redraw_policy.initial(fm, q.shape[-1])
        if redraw:
            self.redraw_policy.before_forward(fm, self.training)
        fm.prepare(q, k, key_padding_mask=key_padding_mask, causal=causal)
        dtype = compute_dtype(q.dtype)

        def features(x: torch.Tensor, query: bool) -> torch.Tensor:  # [B, H, L, d] -> [B, H, L, D]
            return fm.raw_features(x, query=query).to(dtype)

        kw: dict[str, Any] = {
            "log_space": fm.log_space,
            "window": self.window,
            "global_tokens": self.global_tokens,
            "causal": causal,
            "key_padding_mask": key_padding_mask,
            "global_offset": self._global_offset(key_padding_mask),
        }
        out_dtype = v.dtype
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if self.block_size is None and q.shape[-2] * k.shape[-2] <= window_module.DENSE_MAX_PAIRS:
            self.last_backend = "dense"
            phi_q, phi_k = features(q, True), features(k, False)
            kw["heavy"] = self._heavy(q, k, key_padding_mask, phi_q, phi_k, query_ok)
            out = window_attention_dense(q, k, v, phi_q, phi_k, **kw)
        else:
            self.last_backend = "blocked"
            block = self.block_size or max(self.window, MIN_BLOCK)
            block = min(block, max(q.shape[-2], k.shape[-2], self.window, 1))
            if self.heavy_keys:  # the features once, for the choice and the kernel (which copies them)
                phi_q, phi_k = features(q, True), features(k, False)
                kw["heavy"] = self._heavy(q, k, key_padding_mask, phi_q, phi_k, query_ok)
                out = window_attention_blocked(q, k, v, phi_q, phi_k, block_size=block, **kw)
            else:  # the features as a function: the blocked kernel applies it to its padded copies
                out = window_attention_blocked(q, k, v, features, features, block_size=block, **kw)
        return out.to(out_dtype)

    # ------------------------------------------------------------------ decoding
    def step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        state: WindowState | None = None,
        *,
        key_padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, WindowState]:
        """Causal attention of new positions given the state of the earlier ones (decoding).

        The state is constant in size (:class:`~kernelattn_hybrid.window.WindowState`): a
        ring buffer of the last ``window`` keys and values, the ``global_tokens`` first
        ones, and the feature sums (with their stabiliser) of every position that left the
        window, handed to the features as it leaves
        (:func:`~kernelattn_core.engine.torch_backend.absorb_keys`).

        Parameters
        ----------
        q, k, v : Tensor ``[B, H, T, d]``, ``[B, H, T, d]``, ``[B, H, T, dv]``
            The next ``T`` positions. Without a state they are attended by the blocked
            forward and the state is built from them; with one they are attended one
            position at a time (``T = 1`` when decoding token by token).
        state : WindowState, optional
            Returned by the previous call; ``None`` starts a sequence.
        key_padding_mask : Tensor ``[B, T]`` of bool, optional
            Padding among the new positions. Leading padding (a row whose positions so far
            are all padded) moves that row's global tokens past it, as in the forward; the
            state counts it across calls (``WindowState.lead``).

        Returns
        -------
        out : Tensor ``[B, H, T, dv]``
            Equal to the last ``T`` rows of ``forward(..., causal=True)`` over the whole
            sequence so far (non-finite keys and queries poison the rows the forward
            poisons).
        state : WindowState
            To pass to the next call. No redraw happens between steps.
        """
        self._refuse_causal_heavy(True, "step")
        if state is not None and not torch.is_grad_enabled() and masks_nothing(key_padding_mask, q):
            fast = self._step_finite(q, k, v, state)
            if fast is not None:
                return fast
        q, k, mask = self._step_inputs(q, k, v, key_padding_mask)
        fm = self.feature_map
        if not fm.built:
            self.redraw_policy.initial(fm, q.shape[-1])
        owner = self.state_owner(q, v)
        if state is not None:
            self._check_state(state, owner, q.device)
        self.last_backend = "step"
        self._finite_step = self._finite_step_plan(q, v, owner)
        if state is None:
            out = self._attend(q, k, v, True, mask, redraw=False) if q.shape[2] else v.new_zeros(v.shape)
            state = self._state_of(q, k, v, mask)
            state.owner = owner
            return out, state
        if not q.shape[2]:  # no new position
            return v.new_zeros(v.shape), state
        fm.prepare(q, k, key_padding_mask=mask, causal=True)
        outs = []
        for t in range(q.shape[2]):  # decoding: one position per step (no graph over a sequence)
            one = None if mask is None else mask[:, t : t + 1]
            out, state = self._step_one(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, one)
            outs.append(out)
        state.owner = owner
        return torch.cat(outs, dim=2), state

    def _finite_step_plan(self, q: torch.Tensor, v: torch.Tensor, owner: StateOwner) -> tuple | None:
        """What :meth:`_step_finite` needs to continue a state of this call's owner (``None``
        when it cannot: no window, half precision, another device, or a map that adds work
        of its own to its features)."""
        fm = self.feature_map
        plain = (
            self.window > 0
            and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64)
            and fm.plain_features()
            and type(self)._step_inputs is AttentionEstimator._step_inputs
        )
        if not plain:
            return None
        b, h, _, d = q.shape
        return (owner, (b, h, 1, d), (b, h, 1, v.shape[-1]), q.dtype)

    def _step_finite(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: object
    ) -> tuple[torch.Tensor, WindowState] | None:
        """One decoding position on :func:`~kernelattn_hybrid.window.window_step_finite`, or
        ``None`` for the guarded path of :meth:`step`: taken only for a state of the owner
        the previous ``step`` of this estimator stated (that object, or an equal one: a beam
        search's reorder restates it), past the global tokens, while the window fills or
        once a position has left it past the global tokens, for inputs of one position with
        that call's shapes and dtype on the CPU, a padding mask that pads none of them and
        no autograd."""
        plan = getattr(self, "_finite_step", None)
        if plan is None or type(state) is not WindowState:
            return None
        owner, q_shape, v_shape, dtype = plan
        p, w, g = state.length, self.window, self.global_tokens
        if not continues_state(state, owner) or p < g or (p >= w and (state.features is None or p - w < g)):
            return None
        if not one_position(q, k, v, q_shape, v_shape, dtype):
            return None
        fm = self.feature_map
        root = self._input_root(q.shape[-1])  # read now: the scale may change between steps
        q, k = q * root, k * root
        flags = _flags(state)
        seen = self.__dict__.get("_clean_flags")  # (tensors, versions, position) that passed the check
        clean = flags is not None and seen is not None and seen[2] <= p and _same_flags(seen, flags)
        done = window_step_finite(
            state,
            q,
            k,
            v,
            fm._features(q, True),
            lambda x: fm._features(x, False),
            log_space=fm.log_space,
            window=self.window,
            global_tokens=self.global_tokens,
            clean=clean and p >= w,
        )
        if done is not None:
            self.last_backend = "step"
            if p >= w and not clean and flags is not None:  # these flags passed at p (the next steps hand them on)
                self.__dict__["_clean_flags"] = (*flags, p)
        return done

    def _step_one(self, q, k, v, state, mask):  # type: ignore[no-untyped-def]
        """One position: non-finite keys and queries handled as in :meth:`_attend`."""
        fm = self.feature_map
        out_dtype, dtype = v.dtype, compute_dtype(q.dtype)
        dead = ~(finite_rows(k) & finite_rows(v))  # [B, H, 1]
        keep = torch.ones_like(dead) if mask is None else ~mask[:, None, :].expand_as(dead)
        dead = dead & keep
        keep = keep & ~dead
        k = k.masked_fill(~keep.unsqueeze(-1), 0.0).to(dtype)
        v = v.masked_fill(~keep.unsqueeze(-1), 0.0).to(dtype)
        bad_q = ~finite_rows(q)  # [B, H, 1]
        q = q.masked_fill(bad_q.unsqueeze(-1), 0.0).to(dtype)
        out, state = window_step_one(
            state,
            q,
            k,
            v,
            fm.raw_features(q, query=True).to(dtype),
            lambda x: fm.raw_features(x, query=False).to(dtype),
            log_space=fm.log_space,
            window=self.window,
            global_tokens=self.global_tokens,
            keep=keep,
            padded=None if mask is None else mask[:, 0],
        )
        state.poisoned = state.poisoned | dead.squeeze(-1)
        nan_rows = (state.poisoned.unsqueeze(-1) | bad_q).unsqueeze(-1)  # [B, H, 1, 1]
        return out.masked_fill(nan_rows, float("nan")).to(out_dtype), state

    def _state_of(self, q, k, v, mask) -> WindowState:  # type: ignore[no-untyped-def]
        """The state after the positions ``0 .. T - 1`` of a first call."""
        b, h, t, d = k.shape
        w, g = self.window, self.global_tokens
        dtype = compute_dtype(q.dtype)
        dead = ~(finite_rows(k) & finite_rows(v))  # [B, H, T]
        keep = torch.ones_like(dead) if mask is None else ~mask[:, None, :].expand_as(dead)
        dead = dead & keep
        keep = keep & ~dead
        k = k.masked_fill(~keep.unsqueeze(-1), 0.0).to(dtype)
        v = v.masked_fill(~keep.unsqueeze(-1), 0.0).to(dtype)
        state = empty_window_state(b, h, d, v.shape[-1], w, g, dtype, q.device)
        pos = torch.arange(t, device=q.device)
        # the global tokens: positions lead .. lead + g - 1 of each row (lead: its leading padding)
        lead = None if mask is None else leading_padding(mask)  # [B]
        if lead is None:
            local = (pos >= g)[None, None]  # [1, 1, T]: not a global token
        else:
            local = ~((pos >= lead[:, None]) & (pos < lead[:, None] + g))[:, None]  # [B, 1, T]
        if w > 0:
            recent = pos[max(0, t - w) :]  # [r]: the positions in the window after this call
            slots = recent % w
            state.keys[:, :, slots] = k[:, :, recent]
            state.values[:, :, slots] = v[:, :, recent]
            state.valid[:, :, slots] = keep[:, :, recent] & local[..., recent]
        if lead is None:
            first = pos[: min(g, t)]
            state.sink_keys[:, :, first] = k[:, :, first]
            state.sink_values[:, :, first] = v[:, :, first]
            state.sink_valid[:, :, first] = keep[:, :, first]
        elif g and t:
            where = lead[:, None] + torch.arange(g, device=q.device)  # [B, g]
            inside = where < t  # a row's global tokens may not have come yet
            index = where.clamp(max=t - 1)[:, None].expand(b, h, g)  # [B, H, g]
            absent = ~inside[:, None, :, None]
            state.sink_keys = k.gather(2, index[..., None].expand(b, h, g, d)).masked_fill(absent, 0.0)
            state.sink_values = v.gather(2, index[..., None].expand(b, h, g, v.shape[-1])).masked_fill(absent, 0.0)
            state.sink_valid = keep.gather(2, index) & inside[:, None, :]
        state.lead = lead
        older = pos[: max(0, t - w)]  # positions that left the window: in the features unless global
        if older.numel():
            fm = self.feature_map
            lk = fm.raw_features(k[:, :, older], query=False).to(dtype)
            drop = ~(keep[:, :, older] & local[..., older])
            state.features = absorb_keys(None, lk, v[:, :, older], log_space=fm.log_space, drop=drop)
        state.length = t
        state.poisoned = dead.any(-1)
        return state

    def state_owner(self, q: torch.Tensor, v: torch.Tensor) -> StateOwner:
        """The :class:`~kernelattn_core.interfaces.state.StateOwner` of the decoding states
        made from ``q [B, H, T, d]`` and ``v [B, H, T, dv]`` (a built map)."""
        fm = self.feature_map
        return StateOwner(
            type(self).__name__,
            (
                ("window", self.window),
                ("global_tokens", self.global_tokens),
                ("feature_map", fm.name),
                ("num_features", fm.num_features),
            ),
            q.shape[0],
            q.shape[1],
            (("D", fm.feature_dim), ("dv", v.shape[-1]), ("d", q.shape[-1])),
        )

    def _check_state(self, state: object, owner: StateOwner, device: torch.device) -> None:
        """Refuse a state this estimator cannot continue, naming ``state``."""
        check_state(state, WindowState, owner)
        assert isinstance(state, WindowState)
        b, h = owner.batch, owner.heads
        widths = dict(owner.widths)
        d, dv, w, g = widths["d"], widths["dv"], self.window, self.global_tokens
        check_state_tensor("keys", state.keys, (b, h, w, d), device, owner, "[B, H, w, d]")
        check_state_tensor("values", state.values, (b, h, w, dv), device, owner, "[B, H, w, dv]")
        check_state_tensor("valid", state.valid, (b, h, w), device, owner, "[B, H, w]")
        check_state_tensor("sink_keys", state.sink_keys, (b, h, g, d), device, owner, "[B, H, g, d]")
        check_state_tensor("sink_values", state.sink_values, (b, h, g, dv), device, owner, "[B, H, g, dv]")
        check_state_tensor("poisoned", state.poisoned, (b, h), device, owner, "[B, H]")
        if state.lead is not None:
            check_state_tensor("lead", state.lead, (b,), device, owner, "[B]")
        if isinstance(state.length, bool) or not isinstance(state.length, int) or state.length < 0:
            raise InputError(f"state: expected length to be an int >= 0, got {state.length!r}")
        f = state.features
        if f is not None:
            d_feat = widths["D"]
            check_state_tensor("features.kv", f.kv, (b, h, d_feat, dv), device, owner, "[B, H, D, dv]")
            check_state_tensor("features.z", f.z, (b, h, d_feat), device, owner, "[B, H, D]")

    def _attention_rows(self, q, k, rows, causal, key_padding_mask):  # type: ignore[no-untyped-def]
        # The rows' weights formed directly, O(R M (d + D)), instead of one-hot values
        # through the blocked path (O(N M (C + D)) for a fit step). Non-finite keys are
        # zeroed before any product, and a row that may see one is NaN, as in ``_attend``.
        self._refuse_causal_heavy(causal)
        dead = ~finite_rows(k)  # [B, H, M]
        if key_padding_mask is not None:
            dead = dead & ~key_padding_mask[:, None, :]
        k = k.masked_fill(dead.unsqueeze(-1), 0.0)
        fm = self.feature_map
        if not fm.built:
            self.redraw_policy.initial(fm, q.shape[-1])
        self.redraw_policy.before_forward(fm, self.training)
        fm.prepare(q, k, key_padding_mask=key_padding_mask, causal=causal)
        dtype = compute_dtype(q.dtype)
        q_rows = q[:, :, rows]
        # the heavy keys are chosen by every query, as the forward chooses them (a non-finite
        # query is left out of the choice there too: its own row is NaN either way)
        q_ok = finite_rows(q)
        heavy = self._heavy(q.masked_fill(~q_ok.unsqueeze(-1), 0.0), k, key_padding_mask, query_ok=q_ok)
        w = window_weights_rows(
            q_rows.to(dtype),
            k.to(dtype),
            fm.raw_features(q_rows, query=True).to(dtype),
            fm.raw_features(k, query=False).to(dtype),
            rows,
            log_space=fm.log_space,
            window=self.window,
            global_tokens=self.global_tokens,
            causal=causal,
            key_padding_mask=key_padding_mask,
            global_offset=self._global_offset(key_padding_mask),
            heavy=heavy,
        )
        self.last_backend = "rows"
        pos = torch.arange(k.shape[-2], device=k.device)
        sees = (pos[None, :] <= rows[:, None]) if causal else torch.ones(len(rows), len(pos), dtype=torch.bool)
        poisoned = (dead[:, :, None, :] & sees.to(k.device)).any(-1)  # [B, H, R]
        return w.to(q.dtype).masked_fill(poisoned.unsqueeze(-1), float("nan"))

    def extra_repr(self) -> str:
        heavy = f", heavy_keys={self.heavy_keys}" if self.heavy_keys else ""
        return f"window={self.window}, global_tokens={self.global_tokens}{heavy}, scale={self.scale}"
