"""``KernelAttention``: multi-head attention with any registered estimator."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .api import create
from .engine.traced import tracing
from .errors import InputError
from .interfaces.estimator import supports_step
from .interfaces.state import StateOwner, check_state, check_state_tensor
from .validation import FLOAT_DTYPES, check_bool, check_device, check_positive_int, check_tensor


@dataclass
class KVCache:
    """Decoding state of :meth:`KernelAttention.step` for estimators without a ``step``
    of their own: the keys, values and padding seen so far (the output of each new
    position is recomputed from them, quadratic per token).

    Attributes
    ----------
    q, k, v : Tensor ``[B, H, L, d]``
        Every position consumed so far.
    key_padding_mask : Tensor ``[B, L]`` of bool, optional
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_padding_mask: torch.Tensor | None
    #: the module's estimator, options, batch, heads and head dimension
    #: (:class:`~kernelattn_core.interfaces.state.StateOwner`); :meth:`KernelAttention.step`
    #: refuses a cache of another owner
    owner: StateOwner | None = None

    @property
    def length(self) -> int:
        """Number of positions consumed."""
        return self.k.shape[2]

    def extended(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None
    ) -> KVCache:
        """This cache with the new positions ``q, k, v [B, H, T, d]`` (and their padding
        ``[B, T]``) appended; the masks are kept only when either side has one."""
        mask = None
        if key_padding_mask is not None or self.key_padding_mask is not None:
            b, length = q.shape[0], self.length
            old = self.key_padding_mask
            old = torch.zeros(b, length, dtype=torch.bool, device=q.device) if old is None else old
            new = (
                torch.zeros(b, q.shape[2], dtype=torch.bool, device=q.device)
                if key_padding_mask is None
                else key_padding_mask
            )
            mask = torch.cat([old, new], 1)
        return KVCache(
            torch.cat([self.q, q], 2), torch.cat([self.k, k], 2), torch.cat([self.v, v], 2), mask, self.owner
        )

    def attend_new(self, estimator: nn.Module, new: int) -> torch.Tensor:
        """The causal output ``[B, H, new, dv]`` of the last ``new`` positions, recomputed
        over every cached one (``new = 0``: no row; ``out[..., -0:, :]`` would be every row)."""
        out = estimator(self.q, self.k, self.v, causal=True, key_padding_mask=self.key_padding_mask)
        return out[:, :, out.shape[2] - new :]


class KernelAttention(nn.Module):
    """Multi-head self or cross attention whose attention step is any estimator.

    A drop-in for :class:`torch.nn.MultiheadAttention` wherever it is used without
    attention weights, inside :class:`torch.nn.TransformerEncoderLayer` and
    :class:`torch.nn.TransformerDecoderLayer` included (their fused fast path is
    skipped: ``_qkv_same_embed_dim`` is ``False`` and there is no ``in_proj_weight``).
    The same projections, the same ``key_padding_mask`` convention (``True`` = padded,
    or the additive ``0``/``-inf`` float form), and a ``(output, None)`` return so
    ``out, _ = attn(x, x, x)`` keeps working. Attention weights are never formed by
    linear estimators: ``need_weights=True`` is an error, not a silent ``None``.

    .. math:: \\mathrm{out} = W_o\\,\\mathrm{concat}_h\\big(\\mathrm{Att}_h(W_q^h x_q, W_k^h x_k, W_v^h x_v)\\big)

    Pretrained weights: :meth:`from_multihead` converts a
    :class:`~torch.nn.MultiheadAttention`, and :meth:`load_state_dict` accepts its
    state dict (``in_proj_weight``/``in_proj_bias`` are split into the three
    projections; the estimator keeps its own state).

    Parameters
    ----------
    embed_dim : int
        Model width ``E`` (divisible by ``num_heads``).
    num_heads : int
    estimator : str
        Registry name of the estimator, feature map or kernel (see :func:`create`);
        ``"softmax"`` (exact) by default.
    causal : bool
        Default causal flag for :meth:`forward`.
    batch_first : bool
        Inputs are ``[B, N, E]`` when true, ``[N, B, E]`` when false (the default, as for
        :class:`torch.nn.MultiheadAttention`, so that the module is a drop-in inside
        ``nn.TransformerEncoderLayer(batch_first=False)``; it was ``True`` before, see the
        changelog).
    bias : bool
        Bias in the projections.
    kdim, vdim : int, optional
        Widths of key and value inputs (default ``embed_dim``).
    **estimator_options
        Passed to :func:`create` (``num_features``, ``redraw_every``, ``seed``, ...).
        ``head_dim`` and ``num_heads`` are added when the estimator (or feature map)
        accepts them.

    Examples
    --------
    >>> import torch, kernelattn_core as ka
    >>> attn = ka.KernelAttention(32, 4, estimator="elu", batch_first=True)
    >>> out, _ = attn(torch.randn(2, 10, 32))  # [B, N, E]
    >>> out.shape
    torch.Size([2, 10, 32])
    """

    #: read by nn.TransformerEncoder(Layer): separate projections, so no fused fast path
    _qkv_same_embed_dim = False
    #: no packed input projection (nn.MultiheadAttention's fast-path tensors)
    in_proj_weight = None
    in_proj_bias = None
    #: attention-probability dropout is not applied (no weights are formed)
    dropout = 0.0

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        estimator: str = "softmax",
        *,
        causal: bool = False,
        batch_first: bool = False,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **estimator_options: Any,
    ) -> None:
        super().__init__()
        check_positive_int("embed_dim", embed_dim)
        check_positive_int("num_heads", num_heads)
        check_bool("causal", causal)
        check_bool("batch_first", batch_first)
        check_bool("bias", bias)
        if embed_dim % num_heads:
            raise InputError(f"num_heads: expected a divisor of embed_dim = {embed_dim}, got {num_heads}")
        if not isinstance(estimator, str):
            raise InputError(
                f"estimator: expected a registry name (a str such as 'prf'; options as keyword arguments), "
                f"got {type(estimator).__name__}"
            )
        _refuse_multihead_only(estimator_options)
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        for name, width in (("kdim", kdim), ("vdim", vdim)):
            if width is not None:  # None: embed_dim (0 is refused, not read as None)
                check_positive_int(name, width)
        if device is not None:
            device = check_device("device", device)
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise InputError(
                f"dtype: expected None or a floating-point torch.dtype (float16, bfloat16, float32 or float64), "
                f"got {dtype!r}"
            )
        self.causal, self.batch_first = causal, batch_first
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.estimator_name = estimator
        self.estimator = build_estimator(estimator, self.head_dim, num_heads, estimator_options)
        if device is not None or dtype is not None:
            self.estimator.to(device=device, dtype=dtype)
        self.register_load_state_dict_pre_hook(_load_multihead_state)

    # ------------------------------------------------------------------ conversion
    @classmethod
    def from_multihead(cls, mha: nn.MultiheadAttention, estimator: str = "softmax", **options: Any) -> KernelAttention:
        """A :class:`KernelAttention` with the weights of ``mha`` (which is left untouched).

        Parameters
        ----------
        mha : torch.nn.MultiheadAttention
            Its width, heads, ``batch_first``, ``kdim``/``vdim``, bias, dtype and device
            are carried over, and its projection weights copied. Its ``dropout`` (of the
            attention probabilities) is not: kernelized attention forms no weights (add
            dropout on the output where training needs it).
        estimator : str
            Registry name (see :func:`create`).
        **options
            ``causal`` and estimator options (``num_features``, ``seed``, ...).

        Raises
        ------
        InputError
            For ``add_bias_kv`` or ``add_zero_attn``, which add a key no kernelized
            estimator models.
        """
        if not isinstance(mha, nn.MultiheadAttention):
            raise InputError(f"mha: expected a torch.nn.MultiheadAttention, got {type(mha).__name__}")
        if mha.bias_k is not None or mha.add_zero_attn:
            raise InputError("mha: add_bias_kv and add_zero_attn are not supported by kernelized attention")
        ref = mha.out_proj.weight
        out = cls(
            mha.embed_dim,
            mha.num_heads,
            estimator,
            batch_first=mha.batch_first,
            bias=mha.in_proj_bias is not None,
            kdim=mha.kdim,
            vdim=mha.vdim,
            device=ref.device,
            dtype=ref.dtype,
            **options,
        )
        out.load_state_dict(mha.state_dict())
        out.train(mha.training)
        return out

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool | None = None,
    ) -> tuple[torch.Tensor, None]:
        """Attend ``query`` to ``key``/``value`` (self-attention when they are ``None``).

        Parameters
        ----------
        query : Tensor ``[B, N, E]`` (``[N, B, E]`` when not ``batch_first``)
        key : Tensor ``[B, M, kdim]``, optional
        value : Tensor ``[B, M, vdim]``, optional
        key_padding_mask : Tensor ``[B, M]``, optional
            Bool with ``True`` marking padding, or the additive float form (``-inf`` at
            padding, ``0`` elsewhere) that :class:`~torch.nn.TransformerEncoderLayer`
            passes on. The key and value rows at padded positions are zeroed before the
            projections, and in self-attention (``key`` left out or the very tensor
            ``query``, as the encoder and decoder layers call it) so are the query rows
            there: nothing a padded position holds (NaN included) reaches an output or a
            gradient. In cross-attention (``query`` another tensor) the query rows are
            other positions and are attended as given.
        need_weights : bool
            Must be ``False``: linear estimators never form the weights.
        attn_mask : Tensor ``[N, M]`` or ``[B * num_heads, N, M]``, optional
            Only the causal mask is accepted (``True``/``-inf`` above the diagonal, as
            :meth:`torch.nn.Transformer.generate_square_subsequent_mask` makes it); it
            is read as ``causal=True``. An all-allowed mask is ignored; any other mask is
            an error rather than being silently dropped. Under ``torch.compile`` the
            choice cannot read the mask's values: a square mask is read as the causal
            mask, another as allowing everything, and the values are asserted in the
            graph (see :func:`causal_from_attn_mask`).
        average_attn_weights : bool
            Accepted for signature compatibility (no weights are returned).
        is_causal : bool, optional
            ``True`` makes this call causal (with or without the causal ``attn_mask``).
            ``False`` and ``None`` leave the module's ``causal`` flag in force: as in
            :class:`~torch.nn.MultiheadAttention`, where ``is_causal`` is a hint about the
            mask and ``False`` removes no masking, a module built with ``causal=True``
            stays causal (``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer``
            pass ``is_causal=False`` by default).

        Returns
        -------
        (Tensor, None)
            The output, shaped like ``query``, and ``None`` in place of weights. In
            self-attention with a ``key_padding_mask`` a padded position's row is the
            output of a zero input row (the projections' biases attending the unpadded
            keys; causally, those before it): finite and independent of what the padded
            position holds, but of no meaning (discard it, as the loss should).
            :class:`~torch.nn.MultiheadAttention` attends the row as given (NaN in, NaN
            out). The zeroing leaves every unpadded row unchanged, bit for bit.

        Raises
        ------
        InputError
            For a tensor argument on another device than the module's parameters
            (``query``, ``key``, ``value``) or than ``query`` (the masks), a mask
            that cannot be kernelized, and the other refusals named above.
        """
        q, k, v, kpm, causal = self.attention_inputs(
            query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
        )
        out = self.estimator(q, k, v, causal=causal, key_padding_mask=kpm)  # [B, H, N, Dh]
        return self._merge(out), None

    def attention_inputs(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
        """What the estimator of :meth:`forward` gets for the same arguments:
        ``q [B, H, N, d]``, ``k [B, H, M, d]``, ``v [B, H, M, d]``, the boolean
        ``key_padding_mask [B, M]`` and the causal flag (used by fitting). The inputs'
        rows at padded positions are zeroed before the projections (the key and value
        rows; in self-attention the query rows too), so the projected rows there are the
        biases."""
        if need_weights is not False:
            check_bool("need_weights", need_weights)
            raise InputError(
                "need_weights: kernelized attention never forms the attention weights; "
                "call with need_weights=False (the second output is None)"
            )
        key = query if key is None else key
        value = key if value is None else value
        for name, t, width in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if isinstance(t, torch.Tensor) and t.is_nested:
                raise InputError(
                    f"{name}: expected a dense tensor, got a nested tensor (nn.TransformerEncoder's fast path packs "
                    "a padded batch when it was built around nn.MultiheadAttention: build it with "
                    "enable_nested_tensor=False, set encoder.use_nested_tensor = False, or convert it with "
                    "kernelattn_core.convert_attention, which does)"
                )
            check_tensor(name, t, 3, "[B, N, E]" if self.batch_first else "[N, B, E]")
            if t.shape[-1] != width:
                raise InputError(f"{name}: expected last dimension {width}, got shape {tuple(t.shape)}")
        # the same positions (nn.TransformerEncoderLayer's self_attn(x, x, x), step): the padded
        # keys are padded queries too
        self_attention, value_is_key = key is query, value is key
        weight = self.q_proj.weight
        weight_dtype = weight.dtype
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.device != weight.device:  # a comparison of devices: no work per call beyond it
                raise InputError(
                    f"{name}: expected device {weight.device} (the module's parameters; move one with .to()), "
                    f"got {t.device}"
                )
            if t.dtype != weight_dtype and not torch.is_autocast_enabled(t.device.type):  # autocast casts
                raise InputError(
                    f"{name}: expected dtype {weight_dtype} (the module's parameters; convert one with .to()), "
                    f"got {t.dtype}"
                )
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        b, n, _ = query.shape
        m = key.shape[1]
        if value.shape[:2] != key.shape[:2]:
            raise InputError(f"value: expected [B, M] = {list(key.shape[:2])} as key, got {list(value.shape[:2])}")
        if key.shape[0] != b:
            raise InputError(f"key: expected batch size {b} as query, got {key.shape[0]}")
        if is_causal is not None:  # never read "no" as True: a bool or None only
            check_bool("is_causal", is_causal, " or None (the module's causal flag)")
        kpm = bool_key_padding_mask(key_padding_mask, b, m, query.device)
        mask_causal = causal_from_attn_mask(attn_mask, n, m, b * self.num_heads, query.device)
        if attn_mask is not None and is_causal and not mask_causal:
            raise InputError("is_causal: True was given with an attn_mask that is not the causal mask")
        # is_causal=False is no request to see the future: the torch layers pass it by default
        causal = bool(self.causal) or is_causal is True or mask_causal
        if kpm is not None:  # before the projections (their weight gradients sum over every row), so
            # that nothing a padded row holds (NaN included: 0 * nan is nan) reaches an output or a
            # gradient; the projected rows are then the bias, finite, and masked by the estimator
            pad = kpm[:, :, None]  # [B, M, 1]
            masked_key = key.masked_fill(pad, 0.0)
            value = masked_key if value_is_key else value.masked_fill(pad, 0.0)
            if self_attention:  # the padded positions are query rows too: a padded query row's
                # output (which the caller discards) would carry its input into the out and q
                # projections' weight gradients (0 * nan); zeroed, it is a finite row of no meaning
                query = masked_key
            key = masked_key
        q = self.q_proj(query).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, N, Dh]
        k = self.k_proj(key).view(b, m, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, M, Dh]
        v = self.v_proj(value).view(b, m, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, M, Dh]
        return q, k, v, kpm, causal

    def _merge(self, out: torch.Tensor) -> torch.Tensor:
        b, _, n, _ = out.shape
        out = self.out_proj(out.transpose(1, 2).reshape(b, n, self.embed_dim))
        return out if self.batch_first else out.transpose(0, 1)

    # ------------------------------------------------------------------ decoding
    def step(
        self,
        x: torch.Tensor,
        state: Any = None,
        *,
        key_padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """Causal self-attention of the next ``T`` positions given the earlier ones (decoding).

        Parameters
        ----------
        x : Tensor ``[B, T, E]`` (``[T, B, E]`` when not ``batch_first``)
            The new positions (``T = 1`` token by token).
        state : optional
            What the previous call returned; ``None`` starts a sequence.
        key_padding_mask : Tensor ``[B, T]`` of bool, optional
            Padding among the new positions (their rows are zeroed before the
            projections, as in :meth:`forward`'s self-attention).

        Returns
        -------
        out : Tensor shaped like ``x``
            Equal to the last ``T`` positions of ``forward(whole_sequence, is_causal=True)``.
        state
            The estimator's running state (constant size for feature-map estimators,
            whose ``step`` is used), or a :class:`KVCache` for estimators without one
            (their output is recomputed over the cache: quadratic per token).
        """
        check_tensor("x", x, 3, "[B, T, E]" if self.batch_first else "[T, B, E]")
        if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
            raise InputError("step: decoding is self-attention; this module has kdim/vdim != embed_dim")
        if x.shape[-1] != self.embed_dim:
            raise InputError(f"x: expected last dimension {self.embed_dim}, got shape {tuple(x.shape)}")
        q, k, v, kpm, _ = self.attention_inputs(x, key_padding_mask=key_padding_mask)
        if supports_step(self.estimator):
            out, state = self.estimator.step(q, k, v, state, key_padding_mask=kpm)
            return self._merge(out), state
        owner = StateOwner(
            type(self.estimator).__name__,
            (("estimator", self.estimator_name), ("num_features", getattr(self.estimator, "num_features", None))),
            q.shape[0],
            self.num_heads,
            (("d", self.head_dim),),
        )
        if state is not None:
            _check_cache(state, owner, q.device)
            state = state.extended(q, k, v, kpm)
        else:
            state = KVCache(q, k, v, kpm, owner)
        return self._merge(state.attend_new(self.estimator, q.shape[2])), state

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, causal={self.causal}, "
            f"batch_first={self.batch_first}"
        )


def _check_cache(state: object, owner: StateOwner, device: torch.device) -> None:
    """Refuse a key-value cache this module cannot continue, naming ``state``."""
    check_state(state, KVCache, owner)
    assert isinstance(state, KVCache)
    b, h, d = owner.batch, owner.heads, dict(owner.widths)["d"]
    length = state.k.shape[2] if isinstance(state.k, torch.Tensor) and state.k.dim() == 4 else -1
    for name in ("q", "k", "v"):
        check_state_tensor(name, getattr(state, name), (b, h, length, d), device, owner, "[B, H, L, d]")
    if state.key_padding_mask is not None:
        mask = state.key_padding_mask
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise InputError(f"state: expected key_padding_mask to be None or a bool tensor [B, L], got {mask!r}")
        check_state_tensor("key_padding_mask", mask, (b, length), device, owner, "[B, L]")


# ---------------------------------------------------------------------- masks
def zero_padded(
    k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k, v [B, H, M, d]`` with zeros at padded keys, so that no value there (NaN
    included: ``0 * nan`` is ``nan``) can reach an output through a masked weight."""
    if key_padding_mask is None:
        return k, v
    pad = key_padding_mask[:, None, :, None]  # [B, 1, M, 1]
    return k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)


_FLOAT_PADDING = (
    "key_padding_mask: a float mask must be additive with 0 (kept) and -inf (padded) only; "
    "other additive biases cannot be kernelized"
)
_FLOAT_ATTN_MASK = "attn_mask: an additive float mask must hold 0 and -inf only; other biases cannot be kernelized"
_OTHER_ATTN_MASK = (
    "attn_mask: only the causal mask (True or -inf above the diagonal) can be kernelized; "
    "use key_padding_mask for padding, got another mask"
)


def _check_values(ok: torch.Tensor, message: str) -> None:
    """Refuse a mask whose values ``ok`` (a bool tensor) are not all true: eagerly an
    :class:`InputError` (one value read back); under ``torch.compile``, where reading a
    value back would break the graph, an assertion in the graph
    (:func:`torch._assert_async`: a ``RuntimeError`` with ``message`` when the compiled
    call runs, a device-side assertion on CUDA)."""
    if tracing():
        torch._assert_async(ok.all(), message)
    elif not bool(ok.all()):
        raise InputError(message)


def _check_mask_device(name: str, mask: torch.Tensor, device: torch.device | None) -> None:
    if device is not None and mask.device != device:
        raise InputError(f"{name}: expected device {device} (the query's), got {mask.device}")


def bool_key_padding_mask(
    mask: torch.Tensor | None, batch: int, keys: int, device: torch.device | None = None
) -> torch.Tensor | None:
    """``key_padding_mask [B, M]`` as bool (``True`` = padded) from the bool or the
    additive float form (``-inf`` = padded, ``0`` = kept).

    ``device``: the device the mask must be on (``None``: any). A float mask holding
    anything but ``0`` and ``-inf`` is an :class:`InputError`; under ``torch.compile`` the
    conversion is tensor operations only (no graph break) and the values are checked by an
    assertion in the graph instead (a ``RuntimeError`` when the compiled call runs)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise InputError(f"key_padding_mask: expected a tensor of shape [B, M], got {type(mask).__name__}")
    if tuple(mask.shape) != (batch, keys):
        raise InputError(f"key_padding_mask: expected shape [B, M] = [{batch}, {keys}], got {list(mask.shape)}")
    _check_mask_device("key_padding_mask", mask, device)
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        padded = torch.isneginf(mask)
        _check_values((mask == 0) | padded, _FLOAT_PADDING)
        return padded
    raise InputError(f"key_padding_mask: expected dtype torch.bool or a float additive mask, got {mask.dtype}")


def causal_from_attn_mask(
    attn_mask: torch.Tensor | None, n: int, m: int, batch_heads: int, device: torch.device | None = None
) -> bool:
    """Whether ``attn_mask`` (``[N, M]`` or ``[B * H, N, M]``, bool ``True`` = not
    allowed, or additive float ``-inf`` = not allowed) is the causal mask (``True``) or
    allows everything (``False``); anything else is an :class:`InputError`.

    ``device``: the device the mask must be on (``None``: any). Under ``torch.compile``
    the answer cannot depend on the mask's values (reading one back breaks the graph): a
    square mask (``N == M``) is read as the causal mask and any other as allowing
    everything, and the values are checked by an assertion in the graph (a
    ``RuntimeError`` when the compiled call runs; so a square all-allowed mask, which the
    eager call ignores, is refused there: pass ``None`` instead)."""
    if attn_mask is None:
        return False
    if not isinstance(attn_mask, torch.Tensor):
        raise InputError(f"attn_mask: expected a tensor [N, M] or None, got {type(attn_mask).__name__}")
    if (
        attn_mask.dim() not in (2, 3)
        or tuple(attn_mask.shape[-2:]) != (n, m)
        or (attn_mask.dim() == 3 and attn_mask.shape[0] != batch_heads)
    ):
        raise InputError(
            f"attn_mask: expected shape [N, M] = [{n}, {m}] or [B * num_heads, N, M], got {list(attn_mask.shape)}"
        )
    _check_mask_device("attn_mask", attn_mask, device)
    if attn_mask.dtype == torch.bool:
        blocked = attn_mask
    elif attn_mask.is_floating_point():
        blocked = torch.isneginf(attn_mask)
        _check_values((attn_mask == 0) | blocked, _FLOAT_ATTN_MASK)
    else:
        raise InputError(f"attn_mask: expected a bool or float tensor, got dtype {attn_mask.dtype}")
    if tracing():  # decided by the shape alone; the values asserted in the graph
        if n == m:
            _check_values(
                blocked == torch.ones(n, m, dtype=torch.bool, device=blocked.device).triu(1), _OTHER_ATTN_MASK
            )
            return True
        _check_values(~blocked, _OTHER_ATTN_MASK)
        return False
    if not bool(blocked.any()):
        return False
    if n == m:
        future = torch.ones(n, m, dtype=torch.bool, device=blocked.device).triu(1)
        if bool((blocked == future).all()):
            return True
    raise InputError(_OTHER_ATTN_MASK)


# ---------------------------------------------------------------------- helpers
#: nn.MultiheadAttention arguments and the value that means "not used"
_MULTIHEAD_ONLY = {"add_bias_kv": False, "add_zero_attn": False, "dropout": 0.0}


def _refuse_multihead_only(options: dict[str, Any]) -> None:
    """Pop :class:`torch.nn.MultiheadAttention`'s own arguments from ``options`` when they
    ask for nothing (generic code passes ``dropout=0.0``), refuse them when they ask for
    what kernelized attention does not do (they would reach the estimator as unknown
    options, and the error would blame it)."""
    for name, off in _MULTIHEAD_ONLY.items():
        if name not in options:
            continue
        value = options.pop(name)
        if value != off or isinstance(value, bool) != isinstance(off, bool):
            what = "applies no dropout to attention weights (it forms none)" if name == "dropout" else "adds no key"
            raise InputError(
                f"{name}: nn.MultiheadAttention's {name}={value!r} is not supported: KernelAttention {what}; "
                f"expected {off!r} or leave it out"
            )


def build_estimator(name: str, head_dim: int, num_heads: int, options: dict[str, Any]) -> nn.Module:
    """``create(name, **options)`` with ``head_dim`` and ``num_heads`` added when the
    estimator (or, for a feature-map name, the map) accepts them."""
    options = dict(options)
    if "head_dim" not in options and _accepts_head_dim(name):
        options["head_dim"] = head_dim
    if "num_heads" not in options and _accepts(name, "num_heads"):
        options["num_heads"] = num_heads
    return create(name, **options)


def _accepts_head_dim(name: str) -> bool:
    from .registry import resolve

    entry = resolve(name)
    return entry.kind == "feature_map" or "head_dim" in _init_params(entry.cls)


def _accepts(name: str, option: str) -> bool:
    from .registry import resolve

    entry = resolve(name)
    return entry.kind in ("feature_map", "estimator") and option in _init_params(entry.cls)


def _init_params(cls: type) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters)


def _load_multihead_state(module: KernelAttention, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook: read a :class:`torch.nn.MultiheadAttention` state dict.

    ``in_proj_weight [3E, E]`` / ``in_proj_bias [3E]`` (or ``q_proj_weight``,
    ``k_proj_weight``, ``v_proj_weight`` when ``kdim``/``vdim`` differ) become the three
    projections; ``out_proj`` has the same keys. Such a dict carries no estimator
    state, so the estimator keeps its own.
    """
    mha_keys = [prefix + k for k in ("in_proj_weight", "q_proj_weight")]
    if not any(k in state_dict for k in mha_keys):
        return
    if prefix + "bias_k" in state_dict:
        raise InputError("state_dict: add_bias_kv (bias_k, bias_v) is not supported by kernelized attention")
    e = module.embed_dim
    if prefix + "in_proj_weight" in state_dict:
        w = state_dict.pop(prefix + "in_proj_weight")
        if tuple(w.shape) != (3 * e, e):
            raise InputError(f"state_dict: in_proj_weight: expected shape [{3 * e}, {e}], got {list(w.shape)}")
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            state_dict[f"{prefix}{name}.weight"] = w[i * e : (i + 1) * e]
    else:
        for name in ("q_proj", "k_proj", "v_proj"):
            state_dict[f"{prefix}{name}.weight"] = state_dict.pop(f"{prefix}{name}_weight")
    if prefix + "in_proj_bias" in state_dict:
        bias = state_dict.pop(prefix + "in_proj_bias")
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            state_dict[f"{prefix}{name}.bias"] = bias[i * e : (i + 1) * e]
    for key, value in module.estimator.state_dict(prefix=prefix + "estimator.").items():
        state_dict.setdefault(key, value)
