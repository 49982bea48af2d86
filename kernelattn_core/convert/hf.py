"""Hugging Face BERT-family self-attention with a kernelized estimator.

:class:`HFKernelSelfAttention` replaces a BERT/RoBERTa/MiniLM ``*SelfAttention``
module or a DistilBERT ``*SelfAttention`` module. It keeps the original projection
modules under their original names (``query``/``key``/``value``, or
``q_lin``/``k_lin``/``v_lin``/``out_lin``), so the converted model's state dict has
every key of the original (plus the estimator's), and it keeps the original call
contract: ``forward(hidden_states, attention_mask=None, **kwargs) -> (output, None)``.

Why a wrapper rather than a custom function registered through transformers'
attention interface: the registered function would receive whatever mask the model
builds for a custom implementation (none at all in transformers 5: padding would be
lost silently), and a per-config implementation cannot leave unconverted layers on
softmax. The wrapper reads the mask the model built for its own implementation
(``eager``: additive float ``[B, 1, N, M]``; ``sdpa``: bool ``[B, 1, N, M]`` or
``None``; older versions: ``[B, 1, 1, M]``) and accepts exactly the masks a kernelized
estimator can honour: key padding, and causal with key padding. Anything else (a
relative-position bias, ALiBi, packed sequences) is an error.

``transformers`` is never imported here: modules are recognised by their attributes.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn

from ..errors import InputError
from ..module import build_estimator, zero_padded

_BERT = ("query", "key", "value")
_DISTIL = ("q_lin", "k_lin", "v_lin", "out_lin")


def is_hf_self_attention(name: str, module: nn.Module) -> bool:
    """Whether ``module`` is a BERT-family self-attention module (not cross-attention)."""
    if isinstance(module, HFKernelSelfAttention):
        return False
    cls = type(module)
    if not cls.__module__.startswith("transformers."):
        return False
    if "Cross" in cls.__name__ or "crossattention" in name.split("."):
        return False
    has = all(isinstance(getattr(module, a, None), nn.Linear) for a in _BERT) and hasattr(module, "attention_head_size")
    has_distil = all(isinstance(getattr(module, a, None), nn.Linear) for a in _DISTIL)
    return has or has_distil


def _num_heads(module: nn.Module) -> int:
    for attr in ("num_attention_heads", "n_heads", "num_heads"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            return value
    config = getattr(module, "config", None)
    for attr in ("num_attention_heads", "n_heads"):
        if config is not None and isinstance(getattr(config, attr, None), int):
            return int(getattr(config, attr))
    raise InputError(f"model: cannot tell the number of heads of {type(module).__name__}")


class HFKernelSelfAttention(nn.Module):
    """A BERT-family self-attention module whose attention step is an estimator.

    Built by :func:`~kernelattn_core.convert.convert_attention` from the original
    module (:meth:`from_module`). The output for each head is
    ``estimator(q, k, v, causal=..., key_padding_mask=...)`` with the module's own
    projections; DistilBERT's output projection ``out_lin`` is applied as in the
    original module.

    Attributes
    ----------
    estimator : AttentionEstimator
    num_heads, head_dim : int
    source : str
        Class name of the module that was replaced.
    """

    def __init__(
        self,
        projections: dict[str, nn.Module],
        num_heads: int,
        estimator: nn.Module,
        *,
        source: str = "",
        is_causal: bool = False,
    ) -> None:
        super().__init__()
        for name, proj in projections.items():
            self.add_module(name, proj)
        self.distil = "q_lin" in projections
        q = projections["q_lin" if self.distil else "query"]
        self.num_heads = num_heads
        self.head_dim = q.out_features // num_heads
        self.estimator = estimator
        self.source = source
        self.is_causal = is_causal

    @classmethod
    def from_module(cls, module: nn.Module, estimator: str, **options: Any) -> HFKernelSelfAttention:
        """Convert ``module`` (copied; the original is untouched)."""
        params = list(inspect.signature(type(module).forward).parameters)
        if len(params) < 2 or params[1] != "hidden_states":
            raise InputError(
                f"model: {type(module).__name__}.forward takes ({', '.join(params[1:4])}, ...) in this transformers "
                "version; conversion supports modules called as forward(hidden_states, attention_mask, ...) "
                "(transformers >= 4.48)"
            )
        names = _DISTIL if hasattr(module, "q_lin") else _BERT
        projections = {n: copy.deepcopy(getattr(module, n)) for n in names}
        heads = _num_heads(module)
        ref = projections[names[0]].weight
        est = build_estimator(estimator, ref.shape[0] // heads, heads, options).to(device=ref.device, dtype=ref.dtype)
        out = cls(
            projections,
            heads,
            est,
            source=type(module).__name__,
            is_causal=bool(getattr(module, "is_causal", False)),
        )
        out.train(module.training)
        return out

    def attention_inputs(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
        """``q, k, v [B, H, N, d]``, the bool ``key_padding_mask [B, N]`` and the causal
        flag for the arguments of :meth:`forward`."""
        _refuse(args, kwargs)
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            raise InputError(f"hidden_states: expected a tensor [B, N, E], got {getattr(hidden_states, 'shape', None)}")
        b, n, _ = hidden_states.shape
        qp, kp, vp = (self.q_lin, self.k_lin, self.v_lin) if self.distil else (self.query, self.key, self.value)
        shape = (b, n, self.num_heads, self.head_dim)
        q = qp(hidden_states).view(shape).transpose(1, 2)  # [B, H, N, d]
        k = kp(hidden_states).view(shape).transpose(1, 2)  # [B, H, N, d]
        v = vp(hidden_states).view(shape).transpose(1, 2)  # [B, H, N, d]
        kpm, causal = masks_from_hf(attention_mask, b, n, n)
        k, v = zero_padded(k, v, kpm)
        return q, k, v, kpm, causal or (self.is_causal and attention_mask is None)

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, None]:
        """``(output [B, N, E], None)``, as the replaced module returns ``(output, weights)``."""
        q, k, v, kpm, causal = self.attention_inputs(hidden_states, attention_mask, *args, **kwargs)
        out = self.estimator(q, k, v, causal=causal, key_padding_mask=kpm)  # [B, H, N, d]
        b, _, n, _ = out.shape
        out = out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim)
        if self.distil:
            out = self.out_lin(out)
        return out, None

    def extra_repr(self) -> str:
        return f"source={self.source}, num_heads={self.num_heads}, head_dim={self.head_dim}"


def _refuse(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if any(a is not None for a in args):
        raise InputError(
            "hidden_states: kernelized self-attention takes (hidden_states, attention_mask); "
            "extra positional arguments (head_mask, encoder states, cache) are not supported"
        )
    if kwargs.get("output_attentions"):
        raise InputError("output_attentions: kernelized attention never forms the attention weights; pass False")
    for name in ("encoder_hidden_states", "head_mask", "past_key_values", "past_key_value"):
        if kwargs.get(name) is not None:
            raise InputError(f"{name}: not supported by kernelized self-attention (got a value, expected None)")


def masks_from_hf(mask: Any, batch: int, n: int, m: int) -> tuple[torch.Tensor | None, bool]:
    """Key padding ``[B, M]`` (bool, ``True`` = padded) and the causal flag from the
    attention mask a transformers model passes to its attention modules.

    Accepted: ``None``; ``[B, M]`` (``1``/``True`` = token); ``[B, 1 or H, N or 1, M]``
    as bool (``True`` = attend) or additive float (``0`` = attend, very negative =
    masked). The 4-D mask must be a pure key-padding mask (every query row alike) or
    causal with key padding; rows of padded queries are not checked (they are never
    read back).
    """
    if mask is None:
        return None, False
    if not isinstance(mask, torch.Tensor):
        raise InputError(f"attention_mask: expected a tensor or None, got {type(mask).__name__}")
    if mask.dim() == 2:
        if tuple(mask.shape) != (batch, m):
            raise InputError(f"attention_mask: expected [B, M] = [{batch}, {m}], got {list(mask.shape)}")
        return mask == 0, False
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[-1] != m or mask.shape[-2] not in (1, n):
        raise InputError(f"attention_mask: expected [B, 1, N, M] with N={n}, M={m}, got {list(mask.shape)}")
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask > -1e4  # masked: finfo.min (transformers >= 4.3x) or -10000 (older)
        if not bool((mask[allowed] == 0).all()):
            raise InputError(
                "attention_mask: an additive mask with values other than 0 and a large negative value "
                "(a position bias) cannot be kernelized"
            )
    else:
        raise InputError(f"attention_mask: expected a bool or float mask, got dtype {mask.dtype}")
    if allowed.shape[1] > 1 and bool((allowed == allowed[:, :1]).all()):
        allowed = allowed[:, :1]
    if allowed.shape[1] != 1:
        raise InputError("attention_mask: per-head masks cannot be kernelized")
    allowed = allowed[:, 0].expand(batch, -1, -1)  # [B, N or 1, M]
    padded = ~allowed.any(1)  # [B, M]: a key no query attends to
    keep = ~padded
    if allowed.shape[1] == 1 or bool((allowed == keep[:, None, :]).all()):
        return (padded if bool(padded.any()) else None), False
    query_row_padded = padded[:, :, None] if n == m else torch.zeros(batch, n, 1, dtype=torch.bool, device=mask.device)
    if n == m:
        causal = torch.ones(n, m, dtype=torch.bool, device=mask.device).tril()
        expected = causal[None] & keep[:, None, :]
        if bool(((allowed == expected) | query_row_padded).all()):
            return (padded if bool(padded.any()) else None), True
    if bool(((allowed == keep[:, None, :]) | query_row_padded).all()):
        return (padded if bool(padded.any()) else None), False
    raise InputError(
        "attention_mask: only key-padding and causal masks can be kernelized; this model built another "
        "(sliding window, packed sequences or a custom mask)"
    )
