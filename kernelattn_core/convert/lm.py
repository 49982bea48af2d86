"""Causal language-model helpers: pack text for a decoder, and held-out perplexity.

They work with any local ``transformers`` decoder and its tokenizer (the project's
byte-level teacher of :mod:`kernelattn_core.convert.teacher`, or a checkpoint of your
own), converted or not, so the teacher's and the student's perplexity are measured by
the same code on the same tokens:

.. math:: \\mathrm{ppl} = \\exp\\Big(-\\frac{1}{T} \\sum_{t} \\log p(x_{t+1} \\mid x_{\\le t})\\Big)

over the ``T`` predicted tokens of every packed sequence (padding excluded).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import InputError


def pack_causal(
    tokenizer: Any, text: str, *, max_length: int = 256, max_sequences: int | None = None
) -> dict[str, torch.Tensor]:
    """Tokenise ``text`` (no special tokens) and cut the token stream into sequences of
    ``max_length`` tokens; the last one is right-padded.

    Returns
    -------
    dict
        ``input_ids`` and ``attention_mask`` ``[S, max_length]`` (``1`` = token).
    """
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
        raise InputError(f"max_length: expected an int >= 2 (a token and the next one), got {max_length!r}")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if len(ids) < 2:
        raise InputError("text: expected at least two tokens")
    pieces = [ids[i : i + max_length] for i in range(0, len(ids), max_length)]
    if len(pieces) > 1 and len(pieces[-1]) < 2:
        pieces = pieces[:-1]
    if max_sequences is not None:
        pieces = pieces[:max_sequences]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = torch.full((len(pieces), max_length), pad, dtype=torch.long)
    mask = torch.zeros(len(pieces), max_length, dtype=torch.long)
    for r, piece in enumerate(pieces):
        rows[r, : len(piece)] = torch.tensor(piece)
        mask[r, : len(piece)] = 1
    return {"input_ids": rows, "attention_mask": mask}


@torch.no_grad()
def negative_log_likelihood(
    model: nn.Module, batch: dict[str, torch.Tensor], *, batch_size: int = 8
) -> tuple[float, int]:
    """Summed next-token negative log-likelihood (nats) and the number of predicted tokens
    of ``batch`` (``input_ids``, ``attention_mask`` ``[S, L]``), ``batch_size`` sequences
    at a time, in eval mode (the model's mode is restored)."""
    was = model.training
    model.eval()
    device = next(iter(model.parameters())).device
    total, count = 0.0, 0
    try:
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(ids)
        for i in range(0, ids.shape[0], batch_size):
            x, m = ids[i : i + batch_size].to(device), mask[i : i + batch_size].to(device)
            logits = model(input_ids=x, attention_mask=m).logits[:, :-1].float()  # predicts tokens 1..L-1
            target = x[:, 1:]
            keep = (m[:, 1:] != 0) & (m[:, :-1] != 0)
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
            total += float(nll[keep].sum())
            count += int(keep.sum())
    finally:
        model.train(was)
    return total, count


def perplexity(
    model: nn.Module, batches: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]], **kw: Any
) -> float:
    """Token-level perplexity of a causal LM on packed ``batches`` (module docstring)."""
    if isinstance(batches, dict):
        batches = [batches]
    total, count = 0.0, 0
    for b in batches:
        t, c = negative_log_likelihood(model, b, **kw)
        total, count = total + t, count + c
    if count == 0:
        raise InputError("batches: no token to predict")
    return math.exp(total / count)


def load_decoder(path: str | Path, **kwargs: Any) -> tuple[nn.Module, Any]:
    """A local decoder checkpoint and its tokenizer, offline, in eval mode: a converted one
    (``config.kernelattn``) through :func:`~kernelattn_core.convert.from_pretrained`, any
    other through ``AutoModelForCausalLM``."""
    import json

    import transformers

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise InputError(f"path: expected a local model folder with config.json, got {str(path)!r}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if "kernelattn" in json.loads((folder / "config.json").read_text("utf-8")):
        from .decoder import from_pretrained

        return from_pretrained(folder, **kwargs), tokenizer
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, **kwargs)
    return model.eval(), tokenizer
