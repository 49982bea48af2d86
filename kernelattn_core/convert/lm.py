"""Causal language-model helpers: pack text for a decoder, and held-out perplexity.

They work with any local ``transformers`` decoder and its tokenizer (the project's
byte-level teacher of :mod:`kernelattn_core.convert.teacher`, or a checkpoint of your
own), converted or not, so the teacher's and the student's perplexity are measured by
the same code on the same tokens:

.. math:: \\mathrm{ppl} = \\exp\\Big(-\\frac{1}{T} \\sum_{t} \\log p(x_{t+1} \\mid x_{\\le t})\\Big)

over the ``T`` predicted tokens of every packed sequence (padding excluded).

:func:`finetune_causal_lm` is the second stage of Hedgehog / LoLCATs for a converted
decoder: after the per-layer attention fit, the estimators (and optionally low-rank
adapters of the query/key/value projections) are tuned on the whole model's next-token
distribution against the original's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import InputError
from .lora import (
    DECODER_TARGETS,
    LoRAProjection,  # noqa: F401 - re-exported (it was defined here)
    attach_adapters,
    detach_adapters,
)


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
        from .attention import from_pretrained

        return from_pretrained(folder, **kwargs), tokenizer
    from ..workloads.minilm import loading_quietly

    with loading_quietly():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, **kwargs)
    return model.eval(), tokenizer


# ---------------------------------------------------------------------- end-to-end stage
@dataclass
class CausalFinetuneReport:
    """What :func:`finetune_causal_lm` did.

    Attributes
    ----------
    steps : int
    parameters : int
        Trained scalars (estimators and adapters).
    lora_rank : int
    loss_before, loss_after : float
        Mean next-token KL divergence (nats) to the original on the validation sequences
        (the training sequences without any), before and at the kept step.
    best_step : int
        The step whose parameters were kept (0: the start was best).
    history : list of dict
        ``{"step", "train", "validation"}`` at every check.
    seconds : float
    """

    steps: int
    parameters: int
    lora_rank: int
    loss_before: float = math.nan
    loss_after: float = math.nan
    best_step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0


def causal_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over the real positions of :math:`\\mathrm{KL}(p_T \\| p_S)` of the next-token
    distributions (``logits [B, L, V]``, ``mask [B, L]``, ``1`` = token); a padded
    position's logits reach neither the value nor the gradient (selected out, not
    multiplied)."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    student_logits, teacher_logits = student_logits.to(dtype), teacher_logits.to(dtype)
    keep = None if mask is None else (mask != 0)[..., None]
    if keep is not None:  # selected out before the softmax: a NaN there reaches no gradient either
        student_logits = torch.where(keep, student_logits, student_logits.new_zeros(()))
        teacher_logits = torch.where(keep, teacher_logits, teacher_logits.new_zeros(()))
    log_s = torch.log_softmax(student_logits, -1)
    log_t = torch.log_softmax(teacher_logits, -1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)  # [B, L]; 0 at a masked position (equal rows)
    if keep is None:
        return kl.mean()
    return kl.sum() / keep.sum().clamp_min(1)


def finetune_causal_lm(
    student: nn.Module,
    teacher: nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    validation: dict[str, torch.Tensor] | None = None,
    steps: int = 100,
    lr: float = 1e-3,
    batch_size: int = 4,
    lora_rank: int = 0,
    lora_alpha: float | None = None,
    anchor: float = 0.0,
    eval_every: int | None = None,
    seed: int = 0,
    progress: bool | None = None,
) -> CausalFinetuneReport:
    """Tune a converted decoder on the original's next-token distribution.

    Each Adam step takes ``batch_size`` sequences of ``batch`` (drawn with a seeded
    generator) and minimises

    .. math::

        \\mathcal{L} = \\frac{1}{T} \\sum_{t} \\mathrm{KL}\\big(p_T(\\cdot \\mid x_{\\le t})
        \\,\\|\\, p_S(\\cdot \\mid x_{\\le t})\\big)
        + \\lambda \\sum_p \\lVert \\theta_p - \\theta_p^0 \\rVert^2

    over the real positions (:func:`causal_kl`), the second stage of Hedgehog and LoLCATs
    after the per-layer attention fit. Trained: the estimators' parameters and, with
    ``lora_rank > 0``, adapters of the query/key/value projections
    (:class:`~kernelattn_core.convert.lora.LoRAProjection`, merged into the weights at the
    end); everything else is frozen; both models run in eval mode (frozen random draws, no
    dropout). With ``validation`` the parameters of the lowest validation loss are kept
    (checked every ``eval_every`` steps and at the end).

    Parameters
    ----------
    student, teacher : nn.Module
        The converted decoder (changed in place) and the original (only run).
    batch, validation : dict
        Packed sequences (:func:`pack_causal`): ``input_ids``, ``attention_mask`` ``[S, L]``.
        ``validation`` should be a held-back part of the fitting text, never the
        evaluation text.
    steps, lr, batch_size, lora_rank, lora_alpha, anchor, eval_every, seed, progress
        As named (``lora_alpha`` defaults to the rank, ``eval_every`` to a tenth of the
        steps).
    """
    from ..validation import check_positive_int
    from .attention import converted_modules
    from .distill import _Bar, anchor_penalty

    check_positive_int("steps", steps, minimum=0)
    check_positive_int("batch_size", batch_size)
    check_positive_int("lora_rank", lora_rank, minimum=0)
    for flag, value in (("lr", lr), ("anchor", anchor)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise InputError(f"{flag}: expected a finite number >= 0, got {value!r}")
    if not lr > 0:
        raise InputError(f"lr: expected a positive learning rate, got {lr!r}")
    for flag, b in (("batch", batch), ("validation", validation)):
        if b is None and flag == "validation":
            continue
        if not isinstance(b, dict) or "input_ids" not in b or "attention_mask" not in b:
            raise InputError(f"{flag}: expected a dict with input_ids and attention_mask (pack_causal)")
    if not converted_modules(student):
        raise InputError("student: no converted attention layer (use convert_attention first)")
    every = eval_every if eval_every is not None else max(1, steps // 10)
    check_positive_int("eval_every", every)
    report = CausalFinetuneReport(steps=steps, parameters=0, lora_rank=lora_rank)
    if steps == 0:
        return report
    trainable = [p for _, m in converted_modules(student) for p in m.estimator.parameters() if p.requires_grad]
    if not trainable and not lora_rank:
        raise InputError("student: nothing to train (the estimators have no parameters; give lora_rank > 0)")
    start = time.perf_counter()
    modes = student.training, teacher.training
    student.eval()
    teacher.eval()
    flags = {p: p.requires_grad for p in student.parameters()}
    for p in student.parameters():
        p.requires_grad_(False)
    attached = (
        attach_adapters(student, lora_rank, float(lora_alpha or lora_rank), seed, DECODER_TARGETS) if lora_rank else []
    )
    params = [p for _, m in converted_modules(student) for p in m.estimator.parameters() if flags.get(p, False)]
    params += [p for _, _, w in attached for p in (w.lora_a, w.lora_b)]
    for p in params:
        p.requires_grad_(True)
    report.parameters = sum(p.numel() for p in params)
    start_values = [p.detach().clone() for p in params]
    checks = validation if validation is not None else batch
    gen = torch.Generator().manual_seed(seed)
    rows = batch["input_ids"].shape[0]

    @torch.no_grad()
    def validate() -> float:
        total, count = 0.0, 0
        for i in range(0, checks["input_ids"].shape[0], batch_size):
            x, m = checks["input_ids"][i : i + batch_size], checks["attention_mask"][i : i + batch_size]
            value = causal_kl(
                student(input_ids=x, attention_mask=m).logits, teacher(input_ids=x, attention_mask=m).logits, m
            )
            n = int((m != 0).sum())
            total, count = total + float(value) * n, count + n
        return total / max(count, 1)

    bar = _Bar(steps, "end-to-end", progress)
    merged = False
    try:
        best = validate()
        report.loss_before = best
        best_values = [p.detach().clone() for p in params]
        opt = torch.optim.Adam(params, lr=lr)
        running = 0.0
        for step in range(1, steps + 1):
            pick = torch.randperm(rows, generator=gen)[:batch_size]
            x, m = batch["input_ids"][pick], batch["attention_mask"][pick]
            with torch.no_grad():
                target = teacher(input_ids=x, attention_mask=m).logits
            value = causal_kl(student(input_ids=x, attention_mask=m).logits, target, m)
            if anchor:
                value = value + anchor * anchor_penalty(params, start_values)
            opt.zero_grad(set_to_none=True)
            value.backward()
            opt.step()
            loss = float(value.detach())
            running = loss if step == 1 else 0.9 * running + 0.1 * loss
            bar.advance(f"end-to-end KL {running:.4f}")
            if step % every == 0 or step == steps:
                current = validate()
                report.history.append({"step": step, "train": running, "validation": current})
                if current < best:
                    best, report.best_step = current, step
                    best_values = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, v in zip(params, best_values):
                p.copy_(v)
        report.loss_after = best
        detach_adapters(attached, merge=True)
        merged = True
    finally:
        bar.close()
        if not merged:
            detach_adapters(attached, merge=False)
        for p, flag in flags.items():
            p.requires_grad_(flag)
        student.train(modes[0])
        teacher.train(modes[1])
    report.seconds = time.perf_counter() - start
    return report
