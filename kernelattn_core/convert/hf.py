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

The wrapper reproduces only the attention step, so only a module that does nothing else
is converted (:func:`is_hf_self_attention` refuses the others at conversion, naming the
class): its children are the projections and dropout, it owns no other parameter or
buffer, its ``forward`` computes softmax attention (``ALL_ATTENTION_FUNCTIONS`` or a
softmax, no Nyström/LSH/block-sparse/convolutional attention), takes no argument that
carries position information the wrapper would drop (RoFormer's ``sinusoidal_pos``) and
scales the logits by :math:`1/\\sqrt d`. ALBERT's ``AlbertAttention`` (which also owns
the output projection, LayerNorm and residual), ConvBERT, Nystromformer, YOSO, MRA and
RoFormer are refused. At call time every argument is read by the name the original
``forward`` gives it, and one that carries a value the wrapper would not use (a position
bias, rotary embeddings, encoder states, a head mask) is an error naming it. A causal
(``is_decoder``) BERT self-attention given a cache decodes on the estimator's state, as
converted decoders do (:mod:`kernelattn_core.convert.cache`).

``transformers`` is never imported here: modules are recognised by their attributes.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import re
from typing import Any

import torch
from torch import nn

from ..errors import InputError
from ..module import build_estimator, zero_padded

_BERT = ("query", "key", "value")
_DISTIL = ("q_lin", "k_lin", "v_lin", "out_lin")

#: the arguments of the original ``forward`` before its first call (older wrappers)
_DEFAULT_CALL = ("hidden_states", "attention_mask")
#: names under which an attention module receives the cache (encoders here, decoders in
#: :mod:`kernelattn_core.convert.decoder`)
CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
#: the refusal of ``output_attentions=True`` (encoders and decoders)
NO_WEIGHTS = "output_attentions: kernelized attention never forms the attention weights; pass False"
#: arguments whose value the wrapper does not need, whatever it is (absolute positions
#: are in the hidden states already; the cache is read under its own names; the encoder
#: mask only matters with encoder states, which are refused)
_IGNORED = (
    "position_ids",
    "cache_position",
    "use_cache",
    "output_hidden_states",
    "return_dict",
    "encoder_attention_mask",
)
#: arguments the wrapper refuses when they carry a value
_REFUSED = ("encoder_hidden_states", "head_mask")
#: position information some families pass per call, ``None`` when the model has none
#: (LayoutLMv3's ``position_bias``/``rel_pos``/``rel_2d_pos``, ESM's rotary
#: ``position_embeddings``): refused when they carry a value
_POSITION = ("position_bias", "rel_pos", "rel_2d_pos", "position_embeddings")
#: every argument name an accepted module's ``forward`` may take
_KNOWN = frozenset(
    ("hidden_states", "attention_mask", "output_attentions", *CACHE_ARGS, *_IGNORED, *_REFUSED, *_POSITION)
)
#: module attributes of attention algorithms other than softmax
_APPROXIMATIONS = {
    "num_landmarks": "Nyström attention",
    "hash_code_len": "LSH attention (YOSO)",
    "num_block": "multi-resolution attention (MRA)",
    "num_random_blocks": "block-sparse attention",
    "conv_kernel_size": "convolutional attention",
}
#: config flags that add position terms to the attention logits
_POSITION_FLAGS = ("has_relative_attention_bias", "has_spatial_attention_bias", "rotary_value")


def is_hf_self_attention(name: str, module: nn.Module) -> bool:
    """Whether ``module`` is a BERT-family self-attention module (not cross-attention).

    A module with BERT's ``query``/``key``/``value`` projections (and
    ``attention_head_size``) or DistilBERT's ``q_lin``/``k_lin``/``v_lin``/``out_lin``
    is one only if the wrapper computes what it computes (:func:`unconvertible`).

    Raises
    ------
    InputError
        When ``module`` has those projections but does more than the wrapper reproduces
        (ALBERT's output projection and LayerNorm, ConvBERT's convolutions, Nyström or
        LSH attention, RoFormer's rotary positions): converting it would change the
        model's function.
    """
    if isinstance(module, HFKernelSelfAttention):
        return False
    cls = type(module)
    if not cls.__module__.startswith("transformers."):
        return False
    if "Cross" in cls.__name__ or "crossattention" in name.split("."):
        return False
    has = all(isinstance(getattr(module, a, None), nn.Linear) for a in _BERT) and hasattr(module, "attention_head_size")
    has_distil = all(isinstance(getattr(module, a, None), nn.Linear) for a in _DISTIL)
    if not (has or has_distil):
        return False
    reason = unconvertible(module)
    if reason:
        raise InputError(
            f"model: {name!r} ({cls.__name__}) {reason}; kernelized self-attention replaces only the softmax "
            "attention step of a BERT-family self-attention, so converting it would change the model's function "
            f"(expected a module that computes softmax attention of its {'/'.join(_DISTIL if has_distil else _BERT)} "
            "projections and nothing else)"
        )
    return True


def unconvertible(module: nn.Module) -> str:
    """Why the wrapper would not compute what the BERT-family attention ``module``
    computes (``""``: it would).

    The wrapper applies the module's projections (and DistilBERT's ``out_lin``), then
    softmax attention with the logits scaled by :math:`1/\\sqrt d`: anything else the
    module owns or does is a reason, checked on its structure (children, parameters,
    buffers, ``forward`` arguments) and on the few attributes that mark another
    attention algorithm or position terms in the logits.
    """
    names = _DISTIL if all(isinstance(getattr(module, a, None), nn.Linear) for a in _DISTIL) else _BERT
    extra = [
        f"{n} ({type(c).__name__})"
        for n, c in module.named_children()
        if n not in names and not isinstance(c, nn.Dropout)
    ]
    if extra:
        return f"owns {', '.join(extra)} beyond the projections (the wrapper would drop them)"
    own = [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]
    if own:
        return f"owns the parameters or buffers {', '.join(own)} (the wrapper would drop them)"
    for attr, what in _APPROXIMATIONS.items():
        if getattr(module, attr, None) is not None:
            return f"computes {what} ({attr}={getattr(module, attr)!r}), not softmax attention"
    kind = getattr(module, "position_embedding_type", None)
    if kind not in (None, "absolute"):
        return f"adds {kind!r} position terms to the attention logits (position_embedding_type={kind!r})"
    config = getattr(module, "config", None)
    for flag in _POSITION_FLAGS:
        if getattr(config, flag, None) is True:
            return f"adds position terms to the attention logits (config.{flag}=True)"
    params = _forward_parameters(type(module))
    if params and params[0] == "hidden_states":  # otherwise from_module says which call it expects
        unknown = [p for p in params[1:] if p not in _KNOWN]
        if unknown:
            return (
                f"takes {', '.join(unknown)} in forward (position or layout information kernelized "
                "self-attention does not apply)"
            )
    source = forward_source(type(module))
    if source is not None and "ALL_ATTENTION_FUNCTIONS" not in source and "softmax" not in source.lower():
        return "computes its attention without a softmax (another attention algorithm)"
    head_dim = getattr(module, names[0]).out_features // _num_heads(module)
    scale = _logit_scale(module, head_dim, source)
    if scale is not None and not math.isclose(scale, head_dim**-0.5, rel_tol=1e-6):
        return f"scales the attention logits by {scale!r}, not 1/sqrt(head_dim) = {head_dim**-0.5!r}"
    return ""


#: the refusal of a bidirectional mask on a call that continues a decoding state (encoder
#: wrapper and converted decoders alike)
BIDIRECTIONAL_WITH_STATE = (
    "attention_mask: this call's mask is bidirectional (every query attends every key), but the converted layer "
    "continues a decoding state, which is causal only: the model was given a cache (cache= or past_key_values=), "
    "or none was passed and use_cache defaults to True, so transformers made one; pass use_cache=False to attend "
    "bidirectionally without a state, or a causal mask to decode"
)


@functools.cache
def _forward_parameters(cls: type) -> tuple[str, ...]:
    """The named parameters of ``cls.forward`` after ``self`` (no ``*args``/``**kwargs``)."""
    try:
        params = inspect.signature(cls.forward).parameters.values()
    except (TypeError, ValueError):  # pragma: no cover - no signature to read
        return ()
    named = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in params if p.kind in named)[1:]


@functools.cache
def forward_source(cls: type) -> str | None:
    """The source of ``cls.forward`` (read once per class), ``None`` where it is not available."""
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):  # pragma: no cover - source not available
        return None


#: ESM scales the query by ``attention_head_size ** -0.5`` in ``forward`` and passes ``scaling=1.0``
_PRESCALED_QUERY = re.compile(r"\*\s*self\.attention_head_size\s*\*\*\s*-0\.5")


def _logit_scale(module: nn.Module, head_dim: int, source: str | None) -> float | None:
    """The factor of the module's attention logits when its ``scaling`` attribute says
    (``None``: it has none, the logits are divided by :math:`\\sqrt d` in ``forward``)."""
    scaling = getattr(module, "scaling", None)
    if isinstance(scaling, bool) or not isinstance(scaling, int | float):
        return None
    if source is not None and _PRESCALED_QUERY.search(source):
        return float(scaling) * head_dim**-0.5
    return float(scaling)


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

    Arguments are read by the names of the original ``forward`` (``call_names``), so a
    value passed by position is checked like one passed by keyword: ``output_attentions``,
    encoder states, a head mask, a position bias or position embeddings (any argument
    the wrapper does not implement) are refused when they carry a value. A causal
    module (a ``BertConfig(is_decoder=True)`` model) given a cache decodes on the
    estimator's state (:func:`~kernelattn_core.convert.cache.state_layer`), as the
    converted decoders do.

    Attributes
    ----------
    estimator : AttentionEstimator
    num_heads, head_dim : int
    source : str
        Class name of the module that was replaced.
    call_names : tuple of str
        The named arguments of the replaced module's ``forward``, in order.
    layer_idx : int or None
        The replaced module's layer index (where its decoding state is in a cache).
    """

    def __init__(
        self,
        projections: dict[str, nn.Module],
        num_heads: int,
        estimator: nn.Module,
        *,
        source: str = "",
        is_causal: bool = False,
        call_names: tuple[str, ...] = _DEFAULT_CALL,
        layer_idx: int | None = None,
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
        self.call_names = tuple(call_names)
        self.layer_idx = layer_idx

    @classmethod
    def from_module(cls, module: nn.Module, estimator: str, **options: Any) -> HFKernelSelfAttention:
        """Convert ``module`` (copied; the original is untouched)."""
        params = list(inspect.signature(type(module).forward).parameters)
        if len(params) < 2 or params[1] != "hidden_states":
            raise InputError(
                f"model: {type(module).__name__}.forward takes ({', '.join(params[1:4])}, ...) in this transformers "
                "version; conversion supports modules called as forward(hidden_states, attention_mask, ...) "
                "(transformers >= 5.24)"
            )
        names = _DISTIL if hasattr(module, "q_lin") else _BERT
        projections = {n: copy.deepcopy(getattr(module, n)) for n in names}
        heads = _num_heads(module)
        ref = projections[names[0]].weight
        est = build_estimator(estimator, ref.shape[0] // heads, heads, options).to(device=ref.device, dtype=ref.dtype)
        layer_idx = getattr(module, "layer_idx", None)
        out = cls(
            projections,
            heads,
            est,
            source=type(module).__name__,
            is_causal=bool(getattr(module, "is_causal", False)),
            call_names=_forward_parameters(type(module)),
            layer_idx=layer_idx if isinstance(layer_idx, int) and not isinstance(layer_idx, bool) else None,
        )
        out.train(module.training)
        return out

    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        """``(hidden_states, attention_mask, cache)`` of a call with the replaced module's
        arguments, each read by its name there; any other argument that carries a value
        the wrapper would not use is refused, naming it."""
        names = getattr(self, "call_names", _DEFAULT_CALL)
        if len(args) > len(names):
            raise InputError(
                f"hidden_states: {self.source}.forward takes at most {len(names)} positional arguments "
                f"({', '.join(names)}), got {len(args)}"
            )
        bound = dict(zip(names, args))
        for key, value in kwargs.items():
            if key in bound:
                raise InputError(f"{key}: given both by position and by keyword")
            bound[key] = value
        if "hidden_states" not in bound:
            raise InputError(
                "hidden_states: missing (kernelized self-attention is called as forward(hidden_states, ...))"
            )
        hidden_states = bound.pop("hidden_states")
        attention_mask = bound.pop("attention_mask", None)
        if bound.pop("output_attentions", None):
            raise InputError(NO_WEIGHTS)
        cache = None
        for name in CACHE_ARGS:
            value = bound.pop(name, None)
            if value is not None:
                cache = value
        for name, value in bound.items():
            if value is None or name in _IGNORED:
                continue
            if name in _REFUSED:
                raise InputError(f"{name}: not supported by kernelized self-attention (got a value, expected None)")
            raise InputError(
                f"{name}: not supported by kernelized self-attention (got a {type(value).__name__}, expected None); "
                f"the wrapper of {self.source} uses the hidden states, the attention mask and a decoder's cache "
                "only, and would drop it (a position bias, position embeddings or other information)"
            )
        return hidden_states, attention_mask, cache

    def _batch_length(self, hidden_states: Any) -> tuple[int, int]:
        """``B, N`` of ``hidden_states [B, N, E]``, refused by name when it is not such a
        tensor of the projections' width ``E``."""
        proj = self.q_lin if self.distil else self.query
        width = getattr(proj, "base", proj).weight.shape[1]  # an nn.Linear [out, in], or one a LoRA adapter wraps
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3 or hidden_states.shape[-1] != width:
            raise InputError(
                f"hidden_states: expected a tensor [B, N, E] with E = {width}, "
                f"got {getattr(hidden_states, 'shape', type(hidden_states).__name__)}"
            )
        return hidden_states.shape[0], hidden_states.shape[1]

    def _project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v [B, H, N, d]`` of ``hidden_states`` (checked by :meth:`_batch_length`)."""
        b, n = hidden_states.shape[:2]
        qp, kp, vp = (self.q_lin, self.k_lin, self.v_lin) if self.distil else (self.query, self.key, self.value)
        shape = (b, n, self.num_heads, self.head_dim)
        q = qp(hidden_states).view(shape).transpose(1, 2)  # [B, H, N, d]
        k = kp(hidden_states).view(shape).transpose(1, 2)  # [B, H, N, d]
        v = vp(hidden_states).view(shape).transpose(1, 2)  # [B, H, N, d]
        return q, k, v

    def attention_inputs(
        self, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
        """``q, k, v [B, H, N, d]``, the bool ``key_padding_mask [B, N]`` and the causal
        flag for the arguments of :meth:`forward` (called with the teacher's arguments by
        :func:`~kernelattn_core.convert.distill_attention`; a cache is neither read nor
        written)."""
        hidden_states, attention_mask, _ = self._arguments(args, kwargs)
        return self._inputs(hidden_states, attention_mask)

    def _inputs(
        self, hidden_states: Any, attention_mask: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
        b, n = self._batch_length(hidden_states)
        kpm, causal = masks_from_hf(attention_mask, b, n, n)
        if kpm is not None:  # padded rows are keys and queries: nothing there (NaN too) reaches a weight gradient
            hidden_states = hidden_states.masked_fill(kpm[:, :, None], 0.0)
        q, k, v = self._project(hidden_states)
        k, v = zero_padded(k, v, kpm)
        return q, k, v, kpm, causal or (self.is_causal and attention_mask is None)

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """``(output [B, N, E], None)``, as the replaced module returns ``(output, weights)``."""
        hidden_states, attention_mask, cache = self._arguments(args, kwargs)
        if cache is None:
            q, k, v, kpm, causal = self._inputs(hidden_states, attention_mask)
            out = self.estimator(q, k, v, causal=causal, key_padding_mask=kpm)  # [B, H, N, d]
        else:
            out = self._decode(hidden_states, attention_mask, cache)  # [B, H, N, d]
        b, _, n, _ = out.shape
        out = out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim)
        if self.distil:
            out = self.out_lin(out)
        return out, None

    def _decode(self, hidden_states: Any, attention_mask: Any, cache: Any) -> torch.Tensor:
        """Causal attention ``[B, H, N, d]`` of the ``N`` new positions, continuing the
        layer's decoding state in ``cache`` (the estimator's ``step`` state, or a
        key/value cache for estimators without one)."""
        if not self.is_causal:
            raise InputError(
                f"cache: {self.source} is bidirectional (is_causal=False); only the causal self-attention of a "
                "decoder (BertConfig(is_decoder=True)) decodes with a cache (got a "
                f"{type(cache).__name__}, expected None)"
            )
        from .cache import state_layer

        b, n = self._batch_length(hidden_states)
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() in (2, 4) and attention_mask.shape[-1] > n:
            attention_mask = attention_mask[..., -n:]  # a mask over every position so far: the new keys
        kpm, causal = masks_from_hf(attention_mask, b, n, n)
        rows = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and attention_mask.shape[-2] > 1
        if n > 1 and rows and not causal:
            raise InputError(BIDIRECTIONAL_WITH_STATE)
        if kpm is not None:
            hidden_states = hidden_states.masked_fill(kpm[:, :, None], 0.0)
        q, k, v = self._project(hidden_states)
        # armed for this update only, after every check (update disarms it, even when it fails):
        # a call refused in between would leave the layer open to another attention's update
        layer = state_layer(cache, getattr(self, "layer_idx", None))
        k, v = layer.update(k, v)
        k, v = zero_padded(k, v, kpm)
        return layer.attend(self.estimator, q, k, v, kpm)

    def extra_repr(self) -> str:
        return f"source={self.source}, num_heads={self.num_heads}, head_dim={self.head_dim}"


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
