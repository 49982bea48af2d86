"""Convert the attention of a pretrained model, and fit the estimators to its softmax.

* :func:`convert_attention` — a copy of a model whose self-attention modules
  (:class:`torch.nn.MultiheadAttention`, also inside
  :class:`~torch.nn.TransformerEncoderLayer`/:class:`~torch.nn.TransformerDecoderLayer`,
  the Hugging Face BERT family: BERT, RoBERTa, MiniLM, DistilBERT, and Hugging Face
  decoders: GPT-2, Llama, Mistral, Qwen2) run a kernelized estimator with the pretrained
  projection weights.
* :func:`distill_attention` — fit the learnable parameters of every converted layer to
  the teacher's softmax attention, layer by layer.
* :func:`from_pretrained` — load a converted decoder saved with ``save_pretrained``;
  :class:`KernelCache` — the constant-size decoding state of a converted decoder.

``transformers`` is imported only when a Hugging Face decoder is converted, loaded or
decodes (its attention-function and mask-function registries are the extension points,
:mod:`kernelattn_core.convert.decoder`); BERT-family modules are recognised by their
class and attributes. Loading a Hugging Face model is the caller's business
(``pip install 'kernelattn-core[hf]'``).
"""

from __future__ import annotations

from typing import Any

from .attention import convert_attention, converted_modules, from_pretrained
from .decoder import KernelDecoderAttention
from .distill import DistillReport, LayerReport, distill_attention, output_errors
from .hf import HFKernelSelfAttention

__all__ = [
    "DistillReport",
    "HFKernelSelfAttention",
    "KernelCache",
    "KernelDecoderAttention",
    "LayerReport",
    "convert_attention",
    "converted_modules",
    "distill_attention",
    "from_pretrained",
    "output_errors",
]


def __getattr__(name: str) -> Any:
    if name == "KernelCache":  # imports transformers
        from .cache import KernelCache

        return KernelCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
