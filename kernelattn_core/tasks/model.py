"""The one model every estimator is trained in: a small pre-norm Transformer whose attention
is :class:`~kernelattn_core.module.KernelAttention` with the estimator under test.

.. math::
    h_0 = E[x] + P, \\qquad
    h_{l} = h'_{l} + \\mathrm{MLP}(\\mathrm{LN}(h'_{l})), \\quad
    h'_{l} = h_{l-1} + \\mathrm{Att}(\\mathrm{LN}(h_{l-1}))

with learned token and position embeddings :math:`E, P`, a GELU MLP of width ``4 d``, and
one of two heads: per-position logits over the vocabulary (``"lm"`` tasks, causal
attention) or the mean of the unpadded positions followed by a linear classifier
(``"classify"`` tasks, bidirectional attention with the padding mask; mean pooling as in
the LRA set-ups of the LARA and SchoenbAt papers).

**Token shift.** Each block first mixes every position with its predecessor,
:math:`\\tilde h_i = h_i + W_s h_{i-1}` (RWKV's token shift; the short convolution of
Based and Zoology's baselines), so that one attention layer can form an induction head
(match a key's successor) and a two-layer model learns the recall tasks within the CPU
budget. The shift is causal and local: it cannot carry information further than one
position, so long-range mixing is the attention's alone.

**The floor.** ``baseline:no-mixing`` is the same model with no token mixing at all (no
attention and no shift): every position is computed from its own token and position, so
a classifier sees a bag of tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..module import KernelAttention

#: registry-free name of the floor: the same model without attention
NO_MIXING = "baseline:no-mixing"


class TokenShift(nn.Module):
    """:math:`h_i + W_s h_{i-1}` (with :math:`h_{-1} = 0`); ``W_s`` starts at zero."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, d_model, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        prev = F.pad(h, (0, 0, 1, 0))[:, :-1]  # [B, N, d]: position i holds h_{i-1}
        return h + self.proj(prev)


class Block(nn.Module):
    """Token shift and attention (neither in the floor), then the MLP; pre-norm residual."""

    def __init__(self, d_model: int, num_heads: int, attention: nn.Module | None) -> None:
        super().__init__()
        self.shift = TokenShift(d_model) if attention is not None else None  # the floor mixes nothing
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = attention
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, h: torch.Tensor, padding: torch.Tensor | None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``h [B, N, d]`` -> ``[B, N, d]``; with ``rows`` (see :func:`_read_rows`) the MLP runs
        on those positions only and the result is ``[S, d]``."""
        if self.shift is not None and self.attn is not None:
            h = self.shift(h)
            h = h + self.attn(self.norm1(h), key_padding_mask=padding)[0]
        if rows is not None:
            h = _read_rows(h, rows)
        return h + self.mlp(self.norm2(h))


def _read_rows(h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The ``[S, d]`` rows of ``h [B, N, d]`` that ``rows`` names: a boolean ``[B, N]``
    selection, or the int64 indices ``[S]`` of its true entries in the flattened ``[B * N]``."""
    if rows.dtype == torch.bool:
        return h[rows]
    return h.flatten(0, 1).index_select(0, rows)


class TaskModel(nn.Module):
    """A small Transformer for one task with one attention estimator.

    Parameters
    ----------
    vocab_size : int
    max_len : int
        Longest input (size of the position embedding).
    kind : {"lm", "classify"}
        Per-position logits with causal attention, or one label per sequence with
        bidirectional attention and mean pooling.
    estimator : str
        Registry name for :class:`~kernelattn_core.module.KernelAttention`, or
        :data:`NO_MIXING` for the floor without token mixing (no attention, no shift).
    num_classes : int, optional
        Classes of a ``"classify"`` task.
    d_model, num_heads, num_layers : int
        Width, heads per layer, layers.
    **estimator_options
        Passed to the estimator (``num_features``, ``seed``, ...).

    Notes
    -----
    Shapes: ``inputs [B, N]`` (int64) and ``padding [B, N]`` (bool, ``True`` = pad) give
    logits ``[B, N, vocab_size]`` (``"lm"``) or ``[B, num_classes]`` (``"classify"``).
    """

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        kind: str,
        estimator: str = "softmax",
        *,
        num_classes: int | None = None,
        d_model: int = 64,
        num_heads: int = 2,
        num_layers: int = 2,
        **estimator_options: Any,
    ) -> None:
        super().__init__()
        if kind not in ("lm", "classify"):
            raise ValueError(f"kind: expected 'lm' or 'classify', got {kind!r}")
        self.kind, self.estimator_name = kind, estimator
        self.embed = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(max_len, d_model)
        causal = kind == "lm"

        def attention() -> nn.Module | None:
            if estimator == NO_MIXING:
                return None
            return KernelAttention(d_model, num_heads, estimator, causal=causal, batch_first=True, **estimator_options)

        self.blocks = nn.ModuleList([Block(d_model, num_heads, attention()) for _ in range(num_layers)])
        self.norm = nn.LayerNorm(d_model)
        out = vocab_size if kind == "lm" else num_classes
        if out is None:
            raise ValueError("num_classes: a 'classify' model needs the number of classes")
        self.head = nn.Linear(d_model, out)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position.weight, std=0.02)

    def forward(
        self, inputs: torch.Tensor, padding: torch.Tensor | None = None, scored: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits ``[B, N, V]`` (``"lm"``; ``[S, V]`` at the ``S`` positions where ``scored [B, N]``
        is true, when given: the last block's MLP, the final norm and the head run only where a
        prediction is read; every block's attention still sees every position) or ``[B, C]``.

        ``scored`` may also be the ``[S]`` int64 indices of those positions in the flattened
        ``[B * N]`` (``scored.flatten().nonzero()``, the same rows in the same order): a
        compiled model takes them, as a boolean selection has a data-dependent size."""
        n = inputs.shape[1]
        h = self.embed(inputs) + self.position.weight[:n]  # [B, N, d]
        # the last block's MLP (position-wise), the norm and the head run only where a
        # prediction is read: its attention needs every position, the rest of it does not
        rows = scored if self.kind == "lm" else None
        for i, block in enumerate(self.blocks):
            h = block(h, padding, rows if i == len(self.blocks) - 1 else None)
        h = self.norm(h)
        if self.kind == "lm":
            return self.head(h)  # [B, N, V], or [S, V] at the scored positions
        if padding is None:
            pooled = h.mean(1)
        else:
            keep = (~padding).unsqueeze(-1).to(h.dtype)  # [B, N, 1]
            pooled = (h * keep).sum(1) / keep.sum(1).clamp_min(1.0)
        return self.head(pooled)  # [B, C]
