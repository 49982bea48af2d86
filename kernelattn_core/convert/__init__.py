"""Convert the attention of a pretrained model, and fit the estimators to its softmax.

* :func:`convert_attention` — a copy of a model whose self-attention modules
  (:class:`torch.nn.MultiheadAttention`, also inside
  :class:`~torch.nn.TransformerEncoderLayer`/:class:`~torch.nn.TransformerDecoderLayer`,
  and the Hugging Face BERT family: BERT, RoBERTa, MiniLM, DistilBERT) run a kernelized
  estimator with the pretrained projection weights.
* :func:`distill_attention` — fit the learnable parameters of every converted layer to
  the teacher's softmax attention, layer by layer.

``transformers`` is never imported by this package (modules are recognised by their
class and attributes); loading a Hugging Face model is the caller's business
(``pip install 'kernelattn-core[hf]'``).
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from ..errors import InputError
from ..module import KernelAttention
from .distill import DistillReport, LayerReport, distill_attention, output_errors
from .hf import HFKernelSelfAttention, is_hf_self_attention

__all__ = [
    "DistillReport",
    "HFKernelSelfAttention",
    "LayerReport",
    "convert_attention",
    "converted_modules",
    "distill_attention",
    "output_errors",
]


def convert_attention(
    model: nn.Module,
    estimator: str = "softmax",
    *,
    cross_attention: bool = False,
    **options: Any,
) -> nn.Module:
    """A copy of ``model`` with every self-attention replaced by kernelized attention.

    The pretrained projection weights are carried over; ``model`` itself is untouched.
    Each converted layer gets its own estimator built with
    ``create(estimator, **options)``, plus ``head_dim`` and ``num_heads`` when the
    estimator (or feature map) takes them. With ``seed=s`` layer ``i`` gets seed
    ``s + i`` (independent draws per layer, reproducible); without it the draws come
    from the global torch generator (``torch.manual_seed`` makes them reproducible).

    Parameters
    ----------
    model : nn.Module
        Any module holding :class:`torch.nn.MultiheadAttention` modules (for example an
        :class:`torch.nn.TransformerEncoder`), or a Hugging Face BERT-family model.
    estimator : str
        Registry name of an estimator, feature map or kernel (``"softmax"``: exact,
        the same function as the original).
    cross_attention : bool
        Also convert the cross-attention ``multihead_attn`` of
        :class:`torch.nn.TransformerDecoderLayer` (off by default: only self-attention).
    **options
        Estimator options (``num_features``, ``window``, ``seed``, ...).

    Returns
    -------
    nn.Module
        The converted copy, in the training mode of ``model``. The fused fast path of
        :class:`torch.nn.TransformerEncoder` is switched off on it
        (``use_nested_tensor = False``).

    Raises
    ------
    InputError
        When ``model`` holds no attention module this function knows.

    Examples
    --------
    >>> import torch, kernelattn_core as ka
    >>> from kernelattn_core.convert import convert_attention
    >>> layer = torch.nn.TransformerEncoderLayer(32, 4, batch_first=True)
    >>> encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    >>> fast = convert_attention(encoder, "elu")
    >>> type(fast.layers[0].self_attn).__name__
    'KernelAttention'
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    out = copy.deepcopy(model)
    targets: list[tuple[str, nn.Module]] = []
    for name, module in out.named_modules():
        if isinstance(module, KernelAttention | HFKernelSelfAttention):
            continue
        if isinstance(module, nn.MultiheadAttention):
            if not cross_attention and name.split(".")[-1] == "multihead_attn":
                continue
            targets.append((name, module))
        elif is_hf_self_attention(name, module):
            targets.append((name, module))
    if not targets:
        raise InputError(
            f"model: no self-attention to convert in {type(model).__name__} (expected torch.nn.MultiheadAttention "
            "or a Hugging Face BERT/RoBERTa/DistilBERT self-attention)"
        )
    for index, (name, module) in enumerate(targets):
        layer_options = dict(options)
        if layer_options.get("seed") is not None:
            layer_options["seed"] = int(layer_options["seed"]) + index
        if isinstance(module, nn.MultiheadAttention):
            new: nn.Module = KernelAttention.from_multihead(module, estimator, **layer_options)
        else:
            new = HFKernelSelfAttention.from_module(module, estimator, **layer_options)
        parent_name, _, attr = name.rpartition(".")
        setattr(out.get_submodule(parent_name), attr, new)
    for module in out.modules():
        if isinstance(module, nn.TransformerEncoder):
            module.use_nested_tensor = False
    return out


def converted_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The kernelized attention modules of ``model`` with their names, in order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, KernelAttention | HFKernelSelfAttention)]
