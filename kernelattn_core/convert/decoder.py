"""Hugging Face decoder language models with a kernelized estimator.

GPT-2 and the Llama family (Llama, Mistral, Qwen2, and any ``transformers`` model whose
attention module calls ``ALL_ATTENTION_FUNCTIONS``) are converted through
``transformers``' own extension points:

* **The attention function.** :func:`kernel_attention_forward` is registered in
  ``transformers.AttentionInterface`` under ``"kernelattn"`` and the converted model runs
  with ``attn_implementation="kernelattn"``. The model's attention module does everything
  it always does (its projections, GPT-2's fused ``c_attn``, biases, QK-norms, the rotary
  embedding of Llama, Mistral and Qwen2, the cache update) and then calls the function
  with ``q [B, H, N, d]`` and ``k, v [B, H_kv, M, d]``, **the rotary embedding already
  applied**. The function repeats the ``H_kv`` key/value heads to ``H`` (grouped-query
  attention) and runs the layer's estimator.
* **The mask function.** :func:`kernel_mask` is registered in
  ``transformers.masking_utils.AttentionMaskInterface`` under the same name, so
  ``create_causal_mask`` hands it the model's 2-D padding mask and the mask pattern
  instead of building a ``[B, 1, N, M]`` tensor: it returns ``None`` (causal, no padding),
  the ``[B, M]`` padding (causal) or ``[B, 1, 1, M]`` (bidirectional), which is all a
  kernelized estimator can honour. Any other pattern is refused when it binds: packed
  sequences, chunked attention, or a sliding window shorter than the sequence
  (Mistral's ``config.sliding_window``; set it to ``None`` to let every earlier token in).
* **What is wrapped, and why.** The estimator must live in the layer (its parameters and
  draws are per layer and belong in the state dict) and decoding must reach the layer's
  state, which ``transformers`` does not pass to the attention function (the cache
  object stays in the module). So the converted attention module is the original module
  with its class swapped for a subclass (:class:`KernelDecoderAttention` first in the
  MRO, ``isinstance`` still holds, the state dict keeps every original key plus
  ``estimator.*``) whose ``forward`` only finds the layer's decoding state in the cache
  it is given and then runs the original ``forward`` unchanged. Encoders of the BERT
  family are wrapped instead (:mod:`kernelattn_core.convert.hf`): their masks reach the
  attention function only as ``[B, 1, N, M]`` tensors.

Decoding state: :mod:`kernelattn_core.convert.cache`. Saving and loading: the converted
config records the estimator and its options (``config.kernelattn``) and the
implementation (``attn_implementation: "kernelattn"``), so ``save_pretrained`` writes
everything :func:`~kernelattn_core.convert.from_pretrained` needs to rebuild the model; plain
``AutoModel.from_pretrained`` of such a folder fails loudly instead of loading softmax
attention.

Attention-probability dropout (GPT-2's ``attn_pdrop``) is not applied: kernelized
estimators never form the attention probabilities.

What cannot be kernelized is refused, at conversion when the model says so and at call
time otherwise, never dropped: logit soft-capping (Gemma 2's
``config.attn_logit_softcapping``, the ``softcap`` argument), learned attention sinks
(GPT-OSS's ``sinks``, the ``s_aux`` argument), any other argument the attention function
does not implement (packed-sequence lengths, a position bias), ``output_attentions=True``,
and encoder-decoder models (BART, Whisper, T5: ``config.is_encoder_decoder``), whose
encoder and cross-attention would run the ``"kernelattn"`` implementation without an
estimator. The logits' scale is the ``scaling`` the module passes to the attention
function (OPT scales the query itself and passes ``1.0``), read from its ``forward``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import math
import textwrap
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import InputError
from ..module import build_estimator, zero_padded
from .hf import BIDIRECTIONAL_WITH_STATE, CACHE_ARGS, NO_WEIGHTS, forward_source, masks_from_hf

#: the name under which the attention and mask functions are registered in transformers
IMPLEMENTATION = "kernelattn"

#: the ``config`` attribute that records the conversion (estimator, options, version)
RECORD = "kernelattn"


# ---------------------------------------------------------------------- recognising the modules
@functools.cache
def _calls_attention_interface(cls: type) -> bool:
    """Whether ``cls.forward`` dispatches through ``ALL_ATTENTION_FUNCTIONS``."""
    source = forward_source(cls)
    return source is not None and "ALL_ATTENTION_FUNCTIONS" in source


def is_hf_decoder_attention(name: str, module: nn.Module) -> bool:
    """Whether ``module`` is the causal self-attention of a ``transformers`` decoder that
    dispatches through the attention interface (GPT-2, Llama, Mistral, Qwen2, ...)."""
    if isinstance(module, KernelDecoderAttention):
        return False
    cls = type(module)
    if not cls.__module__.startswith("transformers."):
        return False
    if getattr(module, "is_causal", None) is not True or getattr(module, "is_cross_attention", False):
        return False
    if "Cross" in cls.__name__ or "crossattention" in name.split("."):
        return False
    return hasattr(module, "config") and _calls_attention_interface(cls)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def decoder_shape(module: nn.Module) -> tuple[int, int]:
    """``(head_dim, num_heads)`` of a decoder attention module.

    The head width is the module's ``head_dim`` (Llama, GPT-2, ...) or ``head_size``
    (GPT-NeoX), else the config's ``head_dim``, else ``hidden_size / num_attention_heads``
    where that divides evenly.

    Raises
    ------
    InputError
        When neither the number of heads nor the head width can be told.
    """
    config = module.config
    heads = _int(getattr(config, "num_attention_heads", None)) or _int(getattr(module, "num_heads", None))
    head_dim = _int(getattr(module, "head_dim", None)) or _int(getattr(module, "head_size", None))
    if head_dim is None:
        head_dim = _int(getattr(config, "head_dim", None))
    hidden = _int(getattr(config, "hidden_size", None))
    if head_dim is None and heads is not None and hidden is not None and hidden % heads == 0:
        head_dim = hidden // heads
    if heads is None or head_dim is None:
        raise InputError(
            f"model: cannot tell the heads of {type(module).__name__} (expected a positive int "
            "config.num_attention_heads and a head width: the module's head_dim or head_size, config.head_dim or "
            f"config.hidden_size divisible by the heads; got heads={heads}, head_dim={head_dim}, hidden_size={hidden})"
        )
    return head_dim, heads


# ---------------------------------------------------------------------- the converted class
_CLASSES: dict[type, type] = {}


def kernel_class(base: type) -> type:
    """The converted class of the attention class ``base``: ``(KernelDecoderAttention,
    base)``, made once per class."""
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(f"Kernel{base.__name__}", (KernelDecoderAttention, base), {"_kernel_base": base})
        cls.__module__ = __name__
        _CLASSES[base] = cls
    return cls


def _rebuild(base: type, state: dict[str, Any]) -> nn.Module:
    """Unpickle a converted module (its class is made on demand, so it is pickled by its base)."""
    cls = kernel_class(base)
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


@dataclass
class _Call:
    """What the attention function needs from the module's current call."""

    layer: Any = None  # the KernelStateLayer when decoding with a cache
    capture: list[Any] | None = None  # attention_inputs: record q, k, v, mask instead of attending
    extra: dict[str, Any] = field(default_factory=dict)


_NO_CALL = _Call()


class KernelDecoderAttention(nn.Module):
    """The converted attention module of a ``transformers`` decoder.

    Made by :func:`~kernelattn_core.convert.convert_attention`: the original module with
    its class swapped for ``(KernelDecoderAttention, OriginalAttention)`` and the layer's
    estimator added as ``estimator``. Its ``forward`` is the original one (projections,
    rotary embedding, cache update, then ``ALL_ATTENTION_FUNCTIONS["kernelattn"]``, i.e.
    :func:`kernel_attention_forward`); it only finds the layer's decoding state in the
    cache it is given first (:func:`~kernelattn_core.convert.cache.state_layer`, which arms
    that state layer for this call's cache update only: another attention updating it is
    refused).

    Attributes
    ----------
    estimator : AttentionEstimator
        Gets ``q, k, v [B, H, N, d]`` (rotary embedding applied, key/value heads repeated)
        with ``causal=True`` and the key padding.
    """

    _kernel_base: ClassVar[type]
    estimator: nn.Module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("output_attentions") or _collecting_attentions():
            raise InputError(NO_WEIGHTS)
        cache = _find_cache(self._kernel_base, args, kwargs)
        layer = None
        if cache is not None:
            from .cache import state_layer

            layer = state_layer(cache, self.layer_idx)
        saved = self.__dict__.get("_kernel_call")
        self.__dict__["_kernel_call"] = _Call(layer=layer)
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.__dict__["_kernel_call"] = saved
            if layer is not None:  # armed by state_layer for this call's update only
                layer.armed = False

    def attention_inputs(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """``q, k, v [B, H, N, d]`` (rotary embedding applied, key/value heads repeated),
        the bool ``key_padding_mask [B, N]`` and the causal flag that the estimator gets
        for the arguments of :meth:`forward` (called with the teacher's arguments by
        :func:`~kernelattn_core.convert.distill_attention`). The module's own forward runs
        with the attention step replaced by a recorder; no cache is read or written."""
        args, kwargs = _without_cache(self._kernel_base, args, kwargs)
        record: list[Any] = []
        saved = self.__dict__.get("_kernel_call")
        self.__dict__["_kernel_call"] = _Call(capture=record)
        try:
            super().forward(*args, **kwargs)
        finally:
            self.__dict__["_kernel_call"] = saved
        if not record:
            raise InputError(
                f"model: the attention function of {type(self).__name__} was not called; the model runs "
                f"attn_implementation={getattr(self.config, '_attn_implementation', None)!r}, "
                f"expected {IMPLEMENTATION!r}"
            )
        return record[-1]

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        state = self.__getstate__()
        state = {k: v for k, v in state.items() if k != "_kernel_call"}
        return (_rebuild, (self._kernel_base, state))

    def extra_repr(self) -> str:
        base = super().extra_repr()
        return f"{base}, kernelized" if base else "kernelized"


def _collecting_attentions() -> bool:
    """Whether the running ``transformers`` model collects attention weights
    (``output_attentions=True`` is read by the model's output-capturing hooks and not
    always passed on to its attention modules)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - another transformers version
        return False
    collected = _active_collector.get()
    return isinstance(collected, dict) and "attentions" in collected


@functools.cache
def _cache_position(base: type) -> int | None:
    params = list(inspect.signature(base.forward).parameters)
    for name in CACHE_ARGS:
        if name in params:
            return params.index(name) - 1  # without self
    return None


def _find_cache(base: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for name in CACHE_ARGS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    pos = _cache_position(base)
    if pos is not None and pos < len(args):
        return args[pos]
    return None


def _without_cache(base: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict]:
    kwargs = {k: (None if k in CACHE_ARGS else v) for k, v in kwargs.items()}
    kwargs.pop("use_cache", None)
    pos = _cache_position(base)
    if pos is not None and pos < len(args):
        args = (*args[:pos], None, *args[pos + 1 :])
    return args, kwargs


# ---------------------------------------------------------------------- attention and mask functions
def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, H_kv, M, d]`` to ``[B, H_kv * groups, M, d]``, each key/value head serving
    ``groups`` consecutive query heads (grouped-query attention)."""
    if groups == 1:
        return x
    b, h, m, d = x.shape
    return x[:, :, None].expand(b, h, groups, m, d).reshape(b, h * groups, m, d)


def _masks(mask: Any, module: nn.Module, b: int, n: int, m: int) -> tuple[torch.Tensor | None, bool]:
    """Key padding ``[B, M]`` (``True`` = padded) and the causal flag from what the model
    passes as ``attention_mask``: what :func:`kernel_mask` made (``None``, ``[B, L]``,
    ``[B, 1, 1, L]``), or a ``[B, 1, N, M]`` mask another implementation made (a teacher
    when fitting) or the caller passed."""
    causal = getattr(module, "is_causal", True) is True
    if mask is None:
        return None, causal
    if not isinstance(mask, torch.Tensor):
        raise InputError(
            f"attention_mask: expected a tensor or None, got {type(mask).__name__} (flex-attention block masks "
            "cannot be kernelized)"
        )
    if mask.dim() == 2:  # [B, L]: 1/True = token; the keys of this call are the last M
        if mask.shape[0] != b or mask.shape[1] < m:
            raise InputError(f"attention_mask: expected [B, >= M] = [{b}, >= {m}], got {list(mask.shape)}")
        keep = mask[:, -m:]
        keep = keep if keep.dtype == torch.bool else keep != 0
        return ~keep, causal
    if mask.dim() == 4 and mask.shape[-1] > m:  # a mask over every position while decoding: the new keys
        mask = mask[..., -m:]
    kpm, mask_causal = masks_from_hf(mask, b, n, m)
    return kpm, mask_causal


def _check_scaling(estimator: nn.Module, scaling: Any, d: int) -> None:
    if scaling is None:
        return
    scale = getattr(estimator, "scale", None)
    expected = 1.0 / math.sqrt(d) if scale is None else scale
    if not math.isclose(float(scaling), expected, rel_tol=1e-6):
        raise InputError(
            f"scaling: the model scales attention logits by {float(scaling)!r} at this call, the estimator by "
            f"{expected!r} (the scaling its module passed when it was converted, or the scale option); a module "
            "whose scaling changes between calls cannot be converted"
        )


#: arguments of the attention function that need nothing from it: positions (the rotary
#: embedding is applied by the module), cache and output flags, the sliding window, which
#: the mask function refuses where it binds (:func:`kernel_mask`), and the router flag of
#: mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, PhiMoE, GraniteMoE,
#: JetMoE, MiniMax, ERNIE 4.5 MoE pass ``output_router_logits`` down to every attention
#: call; it only asks the experts' routers for their logits)
_HARMLESS = (
    "position_ids",
    "cache_position",
    "use_cache",
    "sliding_window",
    "output_hidden_states",
    "return_dict",
    "output_router_logits",
)


def _check_arguments(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuse every argument of the attention function that would change its result and
    that the estimator does not implement, naming it."""
    name = getattr(getattr(module, "_kernel_base", None), "__name__", type(module).__name__)
    if kwargs.get("output_attentions"):
        raise InputError(NO_WEIGHTS)
    for key, value in kwargs.items():
        if value is None or key in _HARMLESS or key == "output_attentions":
            continue
        if key == "is_causal" and bool(value) == (getattr(module, "is_causal", True) is True):
            continue
        if key == "softcap":
            raise InputError(
                f"softcap: {name} caps its attention logits with tanh (softcap={value!r}, "
                "config.attn_logit_softcapping); kernelized attention cannot cap the logits it never forms "
                "(expected None)"
            )
        if key in ("s_aux", "sinks"):
            raise InputError(
                f"{key}: {name} has learned attention sinks (an extra logit per head in every softmax row); "
                f"kernelized attention cannot apply them (got a {type(value).__name__}, expected None)"
            )
        raise InputError(
            f"{key}: {name} passes it to the attention function, which kernelized attention does not implement "
            f"(got a {type(value).__name__}, expected None)"
        )


#: the refusal of a bidirectional mask on a call that continues a decoding state
def kernel_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``"kernelattn"`` attention function: the layer's estimator on ``query
    [B, H, N, d]``, ``key``/``value [B, H_kv, M, d]`` (rotary embedding applied by the
    module), returning ``([B, N, H, d], None)`` as every ``transformers`` attention function
    does (no attention weights are formed).

    Causal with the key padding of ``attention_mask`` (:func:`kernel_mask`); with a
    decoding state (the module was given a cache), the state is continued with the new
    positions, and a bidirectional mask over more than one new position is refused
    (``use_cache=False`` runs it without a state). Attention-probability ``dropout`` is
    not applied.
    """
    estimator = getattr(module, "estimator", None)
    if not isinstance(module, KernelDecoderAttention) or not isinstance(estimator, nn.Module):
        raise InputError(
            f"attn_implementation: {IMPLEMENTATION!r} runs the estimator of a converted layer, but "
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) has none; a converted model saved "
            "with save_pretrained loads with kernelattn_core.convert.from_pretrained(path), and a plain model "
            "is converted with kernelattn_core.convert_attention(model, estimator, ...)"
        )
    _check_arguments(module, kwargs)
    call: _Call = module.__dict__.get("_kernel_call") or _NO_CALL
    b, h, n, d = query.shape
    if key.shape[1] == 0 or h % key.shape[1]:
        raise InputError(f"key: expected a divisor of the {h} query heads as key/value heads, got {key.shape[1]}")
    groups = h // key.shape[1]
    k, v = _repeat_kv(key, groups), _repeat_kv(value, groups)  # [B, H, M, d]
    m = k.shape[2]
    if not query.dtype == k.dtype == v.dtype:  # autocast: the rotary embedding leaves q, k in float32, v in bfloat16
        common = torch.promote_types(torch.promote_types(query.dtype, k.dtype), v.dtype)
        query, k, v = query.to(common), k.to(common), v.to(common)
    kpm, causal = _masks(attention_mask, module, b, n, m)
    _check_scaling(estimator, scaling, d)
    if call.capture is not None:  # attention_inputs: what the estimator would get
        call.capture.append((query, k, v, kpm, causal))
        return query.new_zeros(b, n, h, v.shape[-1]), None
    k, v = zero_padded(k, v, kpm)
    if call.layer is not None:
        if not causal and n > 1:  # one new query attends every key so far either way
            raise InputError(BIDIRECTIONAL_WITH_STATE)
        out = call.layer.attend(estimator, query, k, v, kpm)  # [B, H, N, d]
    else:
        out = estimator(query, k, v, causal=causal, key_padding_mask=kpm)  # [B, H, N, d]
    return out.transpose(1, 2), None


def _pattern(mask_function: Any, q_length: int, kv_length: int, q_offset: Any, kv_offset: int) -> str:
    """``"causal"`` or ``"bidirectional"``: what ``mask_function`` (an index-based
    ``transformers`` mask function) amounts to on these positions; anything else is
    ``"other"``. The two standard functions are recognised by identity; others are
    evaluated on the position grid in blocks of rows."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    if mask_function is causal_mask_function:
        return "causal"
    if mask_function is bidirectional_mask_function:
        return "bidirectional"
    q0 = int(q_offset)
    kv = torch.arange(kv_length) + kv_offset
    zero = torch.zeros((), dtype=torch.long)
    causal_ok = full_ok = True
    rows = max(1, 2**22 // max(kv_length, 1))
    for r0 in range(0, q_length, rows):
        q = torch.arange(r0, min(q_length, r0 + rows)) + q0
        got = torch.as_tensor(mask_function(zero, zero, q[:, None], kv[None, :])).expand(len(q), kv_length)
        causal_ok = causal_ok and bool((got == (kv[None, :] <= q[:, None])).all())
        full_ok = full_ok and bool(got.all())
        if not (causal_ok or full_ok):
            return "other"
    return "causal" if causal_ok else "bidirectional"


def kernel_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    config: Any = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The ``"kernelattn"`` mask function (``AttentionMaskInterface``): instead of a
    ``[B, 1, N, M]`` tensor, ``None`` (causal, no padding), the 2-D padding mask ``[B, M]``
    (causal; ``True`` = token, positions ``kv_offset ... kv_offset + M``) or a
    ``[B, 1, 1, M]`` mask (bidirectional), which :func:`kernel_attention_forward` reads.
    A pattern that is neither causal nor bidirectional on these positions (a binding
    sliding window, chunked attention, packed sequences) is refused."""
    from transformers.masking_utils import prepare_padding_mask

    kind = _pattern(mask_function, q_length, kv_length, q_offset, kv_offset)
    if kind == "other":
        window = getattr(config, "sliding_window", None)
        hint = (
            f" (the model's sliding window config.sliding_window = {window} binds at {kv_length} positions; "
            "set model.config.sliding_window = None to let every earlier token in)"
            if window
            else " (packed sequences, chunked or another custom mask)"
        )
        raise InputError(
            "attention_mask: kernelized attention honours causal and key-padding masks only; this model built "
            f"another pattern{hint}"
        )
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None:
        padding = padding[:, kv_offset : kv_offset + kv_length].to(torch.bool)
    if kind == "bidirectional":
        keep = padding if padding is not None else torch.ones(batch_size, kv_length, dtype=torch.bool)
        return keep[:, None, None, :]
    if padding is None or bool(padding.all()):
        return None
    return padding


_REGISTERED = False


def register() -> None:
    """Register :func:`kernel_attention_forward` and :func:`kernel_mask` in
    ``transformers`` under ``"kernelattn"`` (idempotent; done by conversion and loading)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, kernel_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, kernel_mask)
    _REGISTERED = True


# ---------------------------------------------------------------------- conversion
def convert_decoder_module(module: nn.Module, estimator: str, **options: Any) -> KernelDecoderAttention:
    """Convert a decoder attention module in place (the caller owns a copy): its class is
    swapped for the converted class and the layer's estimator is added.

    Raises
    ------
    InputError
        When the module cannot be kernelized (:func:`_refuse_module`), its heads cannot be
        told (a model on the meta device is refused before, by
        :func:`~kernelattn_core.convert.convert_attention`).
    """
    head_dim, heads = decoder_shape(module)
    _refuse_module(module)
    options = dict(options)
    scaling = call_scaling(module)
    if scaling is not None and not math.isclose(scaling, head_dim**-0.5, rel_tol=1e-9):
        if "scale" in options and options["scale"] is not None and not math.isclose(options["scale"], scaling):
            raise InputError(
                f"scale: the module scales attention logits by {scaling}, got scale={options['scale']} "
                "(leave it out: each converted module sets its own)"
            )
        # GPT-2's scale_attn_by_inverse_layer_idx and scale_attn_weights=False, Gemma's
        # query_pre_attn_scalar, OPT's 1.0 (it scales the query itself)
        options["scale"] = scaling
    ref = next(iter(module.parameters()))
    est = build_estimator(estimator, head_dim, heads, options).to(device=ref.device, dtype=ref.dtype)
    if not getattr(est, "supports_causal", True):
        raise InputError(
            f"estimator: {estimator!r} is non-causal only; a decoder's self-attention is causal (choose an "
            "estimator with causal support)"
        )
    module.__class__ = kernel_class(type(module))
    module.estimator = est
    est.train(module.training)
    return module  # type: ignore[return-value]


def _refuse_module(module: nn.Module) -> None:
    """Refuse, at conversion, a decoder attention whose function kernelized attention
    would change: logit soft-capping, attention sinks, an encoder-decoder model."""
    name = type(module).__name__
    config = module.config
    if getattr(config, "is_encoder_decoder", False):
        raise InputError(
            f"model: {name} belongs to an encoder-decoder model (config.is_encoder_decoder = True: BART, Whisper, "
            "T5, ...); conversion supports decoder-only language models (GPT-2, Llama, Mistral, Qwen2, ...) and "
            "BERT-family encoders, not the encoder and cross-attention of an encoder-decoder model"
        )
    cap = getattr(module, "attn_logit_softcapping", getattr(config, "attn_logit_softcapping", None))
    if cap is not None:
        raise InputError(
            f"attn_logit_softcapping: {name} caps its attention logits with tanh (config.attn_logit_softcapping "
            f"= {cap!r}); kernelized attention never forms the logits and cannot cap them (expected None: build "
            "the model with attn_logit_softcapping=None to drop the cap on purpose)"
        )
    sinks = getattr(module, "sinks", None)
    if isinstance(sinks, torch.Tensor):
        raise InputError(
            f"model: {name} has learned attention sinks (sinks {list(sinks.shape)}: an extra logit per head in every "
            "softmax row, GPT-OSS); kernelized attention cannot apply them (expected a module without sinks)"
        )


@functools.cache
def _scaling_arguments(cls: type) -> tuple[Any, ...] | None:
    """What ``cls.forward`` passes as ``scaling`` to its attention function, read from
    its source: ``("self", name)`` for ``self.<name>``, ``("value", x)`` for a number;
    ``None`` when the source cannot tell (it is unavailable, passes none by keyword,
    something else or several things)."""
    source = forward_source(cls)
    if source is None:  # pragma: no cover - source not available
        return None
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:  # pragma: no cover - a source that does not parse alone
        return None
    found: set[tuple[Any, ...]] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for keyword in node.keywords:
            if keyword.arg != "scaling":
                continue
            value = keyword.value
            if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "self":
                found.add(("self", value.attr))
            elif isinstance(value, ast.Constant) and isinstance(value.value, int | float):
                found.add(("value", float(value.value)))
            else:
                return None
    return found.pop() if len(found) == 1 else None


def call_scaling(module: nn.Module) -> float | None:
    """The factor of the attention logits the decoder attention ``module`` passes to
    the attention function as ``scaling`` (``None``: not known, the default
    :math:`1/\\sqrt d`). Read from its ``forward``: OPT scales the query itself and
    passes ``1.0``, which is not its ``scaling`` attribute; where the source names no
    number, the attribute it names (``self.scaling`` by default)."""
    how = _scaling_arguments(type(module))
    if how is not None and how[0] == "value":
        value = how[1]
    else:
        value = getattr(module, how[1] if how is not None and how[0] == "self" else "scaling", None)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _json_options(options: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    out, portable = {}, True
    for key, value in options.items():
        try:
            json.dumps(value)
            out[key] = value
        except TypeError:
            out[key] = repr(value)
            portable = False
    return out, portable


def finish_conversion(model: nn.Module, estimator: str, options: dict[str, Any]) -> None:
    """Set ``attn_implementation="kernelattn"`` on every ``transformers`` model inside
    ``model`` and record the conversion in their configs (``config.kernelattn``:
    estimator, options, whether they can be rebuilt from JSON).

    Raises
    ------
    InputError
        When an attention module that dispatches through the attention interface under
        one of those configs was not converted (the encoder or cross-attention of an
        encoder-decoder model): it would run ``"kernelattn"`` without an estimator.
        Nothing is changed then (``model`` is the caller's copy).
    """
    register()
    from transformers import PreTrainedModel

    switched = {id(c) for sub in model.modules() if isinstance(sub, PreTrainedModel) for c in _configs(sub.config)}
    for name, module in model.named_modules():
        if isinstance(module, KernelDecoderAttention) or id(getattr(module, "config", None)) not in switched:
            continue
        if _calls_attention_interface(type(module)) and not isinstance(module, PreTrainedModel):
            raise InputError(
                f"model: {name!r} ({type(module).__name__}) is an attention that conversion does not convert (not a "
                "causal self-attention: an encoder or cross-attention), and the converted model would run it with "
                f"attn_implementation={IMPLEMENTATION!r} and no estimator; models that mix such attention with a "
                "decoder's (encoder-decoder models such as BART, Whisper or T5) are not supported"
            )
    record_options, portable = _json_options(options)
    done: set[int] = set()
    for sub in model.modules():
        if not isinstance(sub, PreTrainedModel) or id(sub.config) in done:
            continue
        sub.set_attn_implementation(IMPLEMENTATION)
        for config in _configs(sub.config):
            if id(config) in done:
                continue
            done.add(id(config))
            setattr(config, RECORD, {"estimator": estimator, "options": record_options, "portable": portable})
            config.attn_implementation = IMPLEMENTATION  # saved in config.json: AutoModel refuses it loudly


def _configs(config: Any) -> list[Any]:
    out = [config]
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            out.extend(_configs(sub))
    return out
