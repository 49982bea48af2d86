"""``KernelAttention``: multi-head attention with any registered estimator."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .api import create
from .errors import InputError
from .validation import check_positive_int, check_tensor


class KernelAttention(nn.Module):
    """Multi-head self or cross attention whose attention step is any estimator.

    A drop-in for the common uses of :class:`torch.nn.MultiheadAttention`: the same
    projections, the same ``key_padding_mask`` convention (``True`` = padded), and a
    ``(output, None)`` return so ``out, _ = attn(x, x, x)`` keeps working. Attention
    weights are never formed by linear estimators, so the second element is always
    ``None``.

    .. math:: \\mathrm{out} = W_o\\,\\mathrm{concat}_h\\big(\\mathrm{Att}_h(W_q^h x_q, W_k^h x_k, W_v^h x_v)\\big)

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
        Inputs are ``[B, N, E]`` when true (the default here; note that
        :class:`torch.nn.MultiheadAttention` defaults to ``False``), ``[N, B, E]`` otherwise.
    bias : bool
        Bias in the projections.
    kdim, vdim : int, optional
        Widths of key and value inputs (default ``embed_dim``).
    **estimator_options
        Passed to :func:`create` (``num_features``, ``redraw_every``, ``seed``, ...).

    Examples
    --------
    >>> import torch, kernelattn_core as ka
    >>> attn = ka.KernelAttention(32, 4, estimator="elu")
    >>> out, _ = attn(torch.randn(2, 10, 32))
    >>> out.shape
    torch.Size([2, 10, 32])
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        estimator: str = "softmax",
        *,
        causal: bool = False,
        batch_first: bool = True,
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
        if embed_dim % num_heads:
            raise InputError(f"num_heads: expected a divisor of embed_dim = {embed_dim}, got {num_heads}")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.causal, self.batch_first = causal, batch_first
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        options = dict(estimator_options)
        if "head_dim" not in options and _accepts_head_dim(estimator):
            options["head_dim"] = self.head_dim
        self.estimator = create(estimator, **options)
        if device is not None or dtype is not None:
            self.estimator.to(device=device, dtype=dtype)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool | None = None,
    ) -> tuple[torch.Tensor, None]:
        """Attend ``query`` to ``key``/``value`` (self-attention when they are ``None``).

        Parameters
        ----------
        query : Tensor ``[B, N, E]`` (``[N, B, E]`` when not ``batch_first``)
        key : Tensor ``[B, M, kdim]``, optional
        value : Tensor ``[B, M, vdim]``, optional
        key_padding_mask : Tensor ``[B, M]`` of bool, optional
            ``True`` marks padding.
        need_weights : bool
            Accepted for compatibility; weights are never returned (``None``).
        attn_mask : None
            Arbitrary masks are not supported (use ``is_causal``); anything but
            ``None`` is an error rather than being silently ignored.
        is_causal : bool, optional
            Overrides the module's ``causal`` flag for this call.

        Returns
        -------
        (Tensor, None)
            The output, shaped like ``query``, and ``None`` in place of weights.
        """
        if attn_mask is not None:
            raise InputError(
                "attn_mask: only None is supported (kernelized estimators take causal=True and "
                f"key_padding_mask), got a tensor of shape {tuple(attn_mask.shape)}"
            )
        key = query if key is None else key
        value = key if value is None else value
        for name, t, width in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            check_tensor(name, t, 3, "[B, N, E]" if self.batch_first else "[N, B, E]")
            if t.shape[-1] != width:
                raise InputError(f"{name}: expected last dimension {width}, got shape {tuple(t.shape)}")
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        b, n, _ = query.shape
        m = key.shape[1]
        if value.shape[:2] != key.shape[:2]:
            raise InputError(f"value: expected [B, M] = {list(key.shape[:2])} as key, got {list(value.shape[:2])}")
        if key.shape[0] != b:
            raise InputError(f"key: expected batch size {b} as query, got {key.shape[0]}")
        q = self.q_proj(query).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, N, Dh]
        k = self.k_proj(key).view(b, m, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, M, Dh]
        v = self.v_proj(value).view(b, m, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, M, Dh]
        causal = self.causal if is_causal is None else is_causal
        out = self.estimator(q, k, v, causal=causal, key_padding_mask=key_padding_mask)  # [B, H, N, Dh]
        out = self.out_proj(out.transpose(1, 2).reshape(b, n, self.embed_dim))
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, None

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, causal={self.causal}"


def _accepts_head_dim(name: str) -> bool:
    from .lookup import resolve

    entry = resolve(name)
    return entry.kind == "feature_map" or "head_dim" in _init_params(entry.cls)


def _init_params(cls: type) -> set[str]:
    import inspect

    return set(inspect.signature(cls.__init__).parameters)
