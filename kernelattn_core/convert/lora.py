"""Low-rank adapters of the converted attention layers' projections (LoRA, Hu et al., 2021),
for the end-to-end stages of conversion (encoders: :mod:`kernelattn_core.convert.e2e`;
decoders: :mod:`kernelattn_core.convert.lm`).

An adapter turns a projection :math:`y = W x + b` into

.. math:: y = W x + b + \\frac{\\alpha}{r} B A x, \\qquad A \\in \\mathbb{R}^{r \\times d_{in}},\\
          B \\in \\mathbb{R}^{d_{out} \\times r},

with :math:`A` drawn (seeded, variance :math:`1 / d_{in}`) and :math:`B = 0`, so the model
starts unchanged; at the end the adapter is merged, :math:`W \\leftarrow W + (\\alpha / r) B A`,
and the layer is the plain projection again (the state dict keeps its keys).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ..errors import InputError

#: query/key/value projections of Hugging Face encoder attention (BERT family, DistilBERT)
ENCODER_TARGETS = ("query", "key", "value", "q_lin", "k_lin", "v_lin")
#: query/key/value projections of decoder attention (Llama family; GPT-2's fused ``c_attn``)
DECODER_TARGETS = ("q_proj", "k_proj", "v_proj", "c_attn")


class LoRAProjection(nn.Module):
    """``base(x) + (alpha / r) x A^T B^T`` around an ``nn.Linear`` (``weight [out, in]``)
    or GPT-2's ``Conv1D`` (``weight [in, out]``); ``B`` starts at zero, so the model starts
    unchanged, and :meth:`merged` folds the adapter into the base weight."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base
        self.transposed = not isinstance(base, nn.Linear)  # Conv1D: y = x W + b, W [in, out]
        w = base.weight
        fan_in, fan_out = (w.shape[0], w.shape[1]) if self.transposed else (w.shape[1], w.shape[0])
        self.scale = alpha / rank
        a = torch.randn(rank, fan_in, generator=generator, dtype=torch.float64) / math.sqrt(fan_in)
        self.lora_a = nn.Parameter(a.to(device=w.device, dtype=w.dtype))
        self.lora_b = nn.Parameter(torch.zeros(fan_out, rank, device=w.device, dtype=w.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scale

    @torch.no_grad()
    def merged(self) -> nn.Module:
        """The base layer with :math:`W + (\\alpha / r) B A` (the base is updated in place)."""
        delta = (self.lora_b @ self.lora_a) * self.scale  # [out, in]
        self.base.weight += delta.T if self.transposed else delta
        return self.base


Attached = list[tuple[nn.Module, str, LoRAProjection]]


def attach_adapters(student: nn.Module, rank: int, alpha: float, seed: int, targets: Sequence[str]) -> Attached:
    """Wrap the ``targets`` projections of every converted attention module of ``student``
    in a :class:`LoRAProjection` (drawn from one generator seeded with ``seed``, in module
    order); returns ``(module, attribute, adapter)`` for :func:`detach_adapters`.

    Raises
    ------
    InputError
        A converted module has none of ``targets`` (``torch.nn.MultiheadAttention``
        replacements, for example: their projections are not separate layers).
    """
    from .attention import converted_modules

    gen = torch.Generator().manual_seed(seed)
    attached: Attached = []
    for name, module in converted_modules(student):
        found = [t for t in targets if isinstance(getattr(module, t, None), nn.Module)]
        if not found:
            raise InputError(
                f"lora_rank: adapters go on Hugging Face layers' q/k/v projections ({', '.join(targets)}); "
                f"{name!r} ({type(module).__name__}) has none (use lora_rank=0)"
            )
        for target in found:
            wrapped = LoRAProjection(getattr(module, target), rank, alpha, gen)
            setattr(module, target, wrapped)
            attached.append((module, target, wrapped))
    return attached


def detach_adapters(attached: Attached, merge: bool) -> None:
    """Put the plain projections back: merged with their adapters (``merge``) or as they
    were (an aborted or rejected fine-tuning)."""
    for module, target, wrapped in attached:
        setattr(module, target, wrapped.merged() if merge else wrapped.base)
