"""Decoding state of converted Hugging Face decoders: a ``transformers`` cache whose
layers hold each estimator's recurrent state instead of every key and value.

A converted layer (:mod:`kernelattn_core.convert.decoder`) decodes with its estimator's
``step``: feature-map attention keeps the running sums :math:`S = \\sum_j \\phi_k(k_j)
v_j^\\top` and :math:`z = \\sum_j \\phi_k(k_j)`, the stabiliser of log-space maps and the
poisoned flag (:class:`~kernelattn_core.engine.chunked.CausalState`);
``sliding-window`` a ring buffer of the last ``w`` keys and values plus the feature state
of everything older; ``rfa-gate`` its gated sums. None of these grows with the context,
so ``model.generate()`` runs in memory independent of the context length. An estimator
without a ``step`` (exact attention, the sampling estimators) falls back to a key-value
cache recomputed per token (:class:`~kernelattn_core.module.KVCache`; it grows).

:class:`KernelCache` is a :class:`transformers.Cache` of :class:`KernelStateLayer`; pass it
as ``model.generate(..., cache=KernelCache())`` or let ``generate()`` make its usual
``DynamicCache``: a converted layer replaces the empty ``DynamicLayer`` it is given by a
:class:`KernelStateLayer` on its first call (:func:`state_layer`), so the default path
decodes on the constant-size state too. A cache that already holds keys and values (made
by an unconverted model) or a static cache is refused.

This module imports ``transformers`` (its cache classes are the base classes here); it is
imported only when a converted decoder runs with a cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, EncoderDecoderCache

from ..engine.chunked import autocast_off
from ..errors import InputError
from ..interfaces.state import StateOwner
from ..module import KVCache, _check_cache

#: the refusal of an attention that is not the converted one updating a state layer
FOREIGN_ATTENTION = (
    "past_key_values: this cache holds a kernelized model's recurrent state (KernelStateLayer: the estimator's "
    "running sums, not the keys and values), which cannot serve softmax attention: an attention that is not the "
    "converted one (the original model, or another) is updating it and would attend the new positions alone; "
    "continue the cache with the converted model that made it, or give the other model a cache of its own "
    "(expected a cache of keys and values, got a KernelStateLayer)"
)


class KernelStateLayer(CacheLayerMixin):
    """One layer's decoding state: what its estimator's ``step`` returned.

    ``update`` (called by the attention module with the new keys and values) only counts
    the positions and hands the new keys and values back, so the attention function sees
    ``N == M`` new positions and continues :attr:`state` with them (:meth:`attend`). It
    serves a converted layer only: :func:`state_layer` arms the layer right before the
    converted attention's call, and ``update`` disarms it; an update that was not armed
    (the original, softmax model given a converted model's cache would attend the new
    positions alone) is refused.

    Attributes
    ----------
    state : object or None
        The estimator's state (``CausalState``, ``WindowState``, ``GateState``, ...), a
        :class:`~kernelattn_core.module.KVCache` for estimators without ``step``, or
        ``None`` before the first call.
    length : int
        Positions consumed (padding included), what ``get_seq_length`` reports.
    armed : bool
        Whether a converted attention is about to update the layer (set by
        :func:`state_layer`, cleared by :meth:`update` and when that call ends).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.state: Any = None
        self.length = 0
        self.armed = False

    def __repr__(self) -> str:
        kind = type(self.state).__name__ if self.state is not None else "empty"
        return f"KernelStateLayer({kind}, length={self.length})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Count the new positions and return the new keys and values themselves (the
        state is continued by :meth:`attend`, which needs the queries too).

        Raises
        ------
        InputError
            When the layer was not armed by :func:`state_layer`: the attention updating it
            is not a converted one and would attend the new positions alone.
        """
        if not getattr(self, "armed", False):
            raise InputError(FOREIGN_ATTENTION)
        self.armed = False
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.length += key_states.shape[-2]
        return key_states, value_states

    def attend(
        self,
        estimator: torch.nn.Module,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Causal attention ``[B, H, T, dv]`` of the ``T`` new positions given :attr:`state`,
        which is replaced by the continued state.

        ``estimator.step`` when it has one (constant-size state; run with autocast off,
        as the estimator's engine runs a forward call, so that training with a cache
        under autocast computes what training without one does); otherwise every query,
        key and value so far is kept and the estimator recomputes the causal output, whose
        last ``T`` rows are returned (exact attention with one new query attends it alone).
        """
        step = getattr(estimator, "step", None)
        if callable(step):
            # autocast off, as the estimator's forward call runs its engine (float32 for
            # half inputs): under autocast the features would be bfloat16 products on this
            # path only, and a training step with a cache would drift from one without
            with autocast_off(q.device):
                out, self.state = step(q, k, v, self.state, key_padding_mask=key_padding_mask)
            return out
        owner = StateOwner(
            type(estimator).__name__,
            (("num_features", getattr(estimator, "num_features", None)),),
            q.shape[0],
            q.shape[1],
            (("d", q.shape[-1]),),
        )
        if self.state is None:
            self.state = KVCache(q, k, v, key_padding_mask, owner)
        else:
            _check_cache(self.state, owner, q.device)
            self.state = self.state.extended(q, k, v, key_padding_mask)
        s = self.state
        if q.shape[2] == 1 and getattr(estimator, "name", None) == "exact":  # one query: all earlier keys, no mask
            return estimator(q, s.k, s.v, causal=False, key_padding_mask=s.key_padding_mask)
        return s.attend_new(estimator, q.shape[2])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the mask ``transformers`` builds before the call:
        every position so far plus the new ones, from 0."""
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:  # the state is small: it stays where it is
        return None

    def prefetch(self) -> None:
        return None

    def reset(self) -> None:
        self.state = None
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise InputError(
            "cache: a kernelized decoding state cannot drop positions (crop); it summarises them. "
            "Assisted or speculative decoding that rolls the cache back is not supported"
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: the state of batch row ``beam_idx[i]`` becomes row ``i``."""
        if self.state is not None:
            self.state = map_state(self.state, lambda t: t.index_select(0, beam_idx.to(t.device)), len(beam_idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            batch = state_batch(self.state) * repeats
            self.state = map_state(self.state, lambda t: t.repeat_interleave(repeats, dim=0), batch)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.state is not None:
            self.state = map_state(self.state, lambda t: t[indices], len(indices))

    def nbytes(self) -> int:
        """Bytes held by the state's tensors."""
        return state_nbytes(self.state)


class KernelCache(Cache):
    """A ``transformers`` cache of :class:`KernelStateLayer`, one per converted layer
    (created as layers are first called).

    Examples
    --------
    >>> from kernelattn_core.convert.cache import KernelCache
    >>> cache = KernelCache()
    >>> cache.get_seq_length(), cache.nbytes()
    (0, 0)
    """

    def __init__(self, num_layers: int | None = None) -> None:
        if num_layers is None:
            super().__init__(layer_class_to_replicate=KernelStateLayer)
        else:
            super().__init__(layers=[KernelStateLayer() for _ in range(num_layers)])

    def nbytes(self) -> int:
        """Bytes held by every layer's state (constant in the context length for
        estimators with a ``step``)."""
        return sum(layer.nbytes() for layer in self.layers if isinstance(layer, KernelStateLayer))


def state_layer(cache: Any, layer_idx: int) -> KernelStateLayer:
    """The :class:`KernelStateLayer` of layer ``layer_idx`` in ``cache``.

    A :class:`KernelCache` has one; in any other ``transformers`` cache an *empty*
    ``DynamicLayer`` (what ``generate()`` and ``use_cache=True`` make) is replaced by one.
    A layer that already holds keys and values (the cache of an unconverted model) or of
    another kind (static, quantized, offloaded) is refused. The layer returned is armed
    for one ``update`` (:class:`KernelStateLayer`): call this right before the converted
    attention updates the cache.
    """
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    if not isinstance(cache, Cache):
        raise InputError(
            f"cache: expected a transformers Cache (or None), got {type(cache).__name__}; "
            "tuples of tensors are not supported"
        )
    if not isinstance(layer_idx, int) or isinstance(layer_idx, bool) or layer_idx < 0:
        raise InputError(f"cache: the attention module has no layer index (layer_idx={layer_idx!r})")
    layers = cache.layers
    if cache.layer_class_to_replicate is not None:
        while len(layers) <= layer_idx:
            layers.append(cache.layer_class_to_replicate())
    if layer_idx >= len(layers):
        raise InputError(f"cache: holds {len(layers)} layers, the model called layer {layer_idx}")
    layer = layers[layer_idx]
    if isinstance(layer, DynamicLayer) and not layer.is_initialized:
        layer = layers[layer_idx] = KernelStateLayer()
    if isinstance(layer, KernelStateLayer):
        layer.armed = True
        return layer
    what = "holds keys and values already" if isinstance(layer, DynamicLayer) else f"is a {type(layer).__name__}"
    raise InputError(
        f"cache: layer {layer_idx} of the {type(cache).__name__} {what}; a converted layer decodes on its "
        "estimator's state: pass cache=KernelCache() (kernelattn_core.convert.KernelCache), an empty "
        "DynamicCache, or nothing (generate() makes one)"
    )


# ---------------------------------------------------------------------- state helpers
def _fields(state: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(state)] if dataclasses.is_dataclass(state) else []


def state_batch(state: Any) -> int:
    """The batch size ``B`` of a decoding state (its owner's, else its first tensor's)."""
    owner = getattr(state, "owner", None)
    if isinstance(owner, StateOwner):
        return owner.batch
    for name in _fields(state):
        value = getattr(state, name)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise InputError(f"state: cannot tell the batch size of a {type(state).__name__}")


def map_state(state: Any, fn: Callable[[torch.Tensor], torch.Tensor], batch: int) -> Any:
    """A copy of the dataclass ``state`` with ``fn`` applied to every tensor whose first
    dimension is the batch (nested states too) and the owner's batch set to ``batch``."""
    old = state_batch(state)
    changes: dict[str, Any] = {}
    for name in _fields(state):
        value = getattr(state, name)
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == old:
            changes[name] = fn(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type) and not isinstance(value, StateOwner):
            changes[name] = map_state(value, fn, batch)
        elif isinstance(value, StateOwner):
            changes[name] = dataclasses.replace(value, batch=batch)
    return dataclasses.replace(state, **changes)


def state_nbytes(state: Any) -> int:
    """Bytes of every tensor of a decoding state (nested dataclasses included)."""
    if state is None:
        return 0
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    total = 0
    for name in _fields(state):
        value = getattr(state, name)
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif dataclasses.is_dataclass(value) and not isinstance(value, StateOwner):
            total += state_nbytes(value)
    return total
