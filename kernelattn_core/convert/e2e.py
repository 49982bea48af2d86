"""End-to-end fitting of a converted model: what the model outputs, not each layer alone.

:func:`~kernelattn_core.convert.distill_attention` fits every layer to the teacher's
attention on the *teacher's* inputs, so each layer is judged alone; errors then compound
through the layers, and a long sequence (where the features carry most of the mass)
drifts although every layer looks good. :func:`finetune_end_to_end` tunes the converted
model on its own outputs against the teacher's, on long sequences, as the second stage
of LoLCATs (Zhang et al., 2024) does with the language-model loss:

.. math::
    \\mathcal{L} = w_e \\frac{1}{B} \\sum_b \\bigl(1 - \\cos(\\bar h_b, \\bar h^{T}_b)\\bigr)
    + w_h \\frac{1}{L} \\sum_{l=1}^{L} \\frac{\\sum_{b,i} \\lVert h^{l}_{bi} - h^{T,l}_{bi} \\rVert^2}
                                          {\\sum_{b,i} \\lVert h^{T,l}_{bi} \\rVert^2}
    + \\lambda \\sum_p \\lVert \\theta_p - \\theta_p^{0} \\rVert^2

with :math:`h^l` the hidden states after layer :math:`l` (valid tokens only),
:math:`\\bar h` the mean-pooled last hidden state (the sentence embedding), :math:`T` the
teacher, and the last term an anchor to the parameters the stage starts from (L2-SP), so
a small fitting corpus does not pull the estimators far from their per-layer fit.

Trained: the estimators' parameters and, with ``lora_rank > 0``, low-rank adapters
:math:`W + \\tfrac{\\alpha}{r} B A` of the query, key and value projections of every
converted Hugging Face layer (``B`` starts at zero, so the stage starts from the
converted model; the adapters are merged into the projection weights at the end, so the
state dict keeps its keys). Everything else stays frozen. Both models run in eval mode
(no dropout, frozen random draws). With ``validation`` batches the parameters of the best
validation loss are kept (early stopping), checked every ``eval_every`` steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import InputError
from ..validation import check_positive_int
from .distill import _Bar, anchor_penalty
from .lora import ENCODER_TARGETS, attach_adapters, detach_adapters


@dataclass
class EndToEndReport:
    """What :func:`finetune_end_to_end` did.

    Attributes
    ----------
    steps : int
        Steps taken.
    parameters : int
        Trained scalars (estimators and adapters).
    lora_rank : int
    loss_before, loss_after : float
        Validation loss (training batches when there is no validation) before and after.
    best_step : int
        The step whose parameters were kept (``steps``: the last).
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


def _hidden(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    out = model(**batch, output_hidden_states=True)
    return tuple(out.hidden_states[1:])  # after each layer


def _loss(
    student: nn.Module,
    teacher_hidden: tuple[torch.Tensor, ...],
    batch: dict[str, torch.Tensor],
    embedding_weight: float,
    hidden_weight: float,
) -> torch.Tensor:
    from ..workloads.minilm import mean_pool

    mask = batch["attention_mask"]
    keep = mask.unsqueeze(-1).bool()  # [B, N, 1]
    hidden = _hidden(student, batch)
    total = hidden[-1].new_zeros(())
    if hidden_weight:
        zero = hidden[-1].new_zeros(())  # where, not a product: nothing at a padded position reaches the loss
        rel = [
            torch.where(keep, h - t, zero).pow(2).sum() / torch.where(keep, t, zero).pow(2).sum().clamp_min(1e-12)
            for h, t in zip(hidden, teacher_hidden)
        ]
        total = total + hidden_weight * torch.stack(rel).mean()
    if embedding_weight:
        a, b = mean_pool(hidden[-1], mask), mean_pool(teacher_hidden[-1], mask)
        total = total + embedding_weight * (1 - torch.nn.functional.cosine_similarity(a, b, dim=-1)).mean()
    return total


def finetune_end_to_end(
    student: nn.Module,
    teacher: nn.Module,
    batches: Sequence[dict[str, torch.Tensor]],
    *,
    validation: Sequence[dict[str, torch.Tensor]] | None = None,
    steps: int = 100,
    lr: float = 2e-3,
    lora_rank: int = 0,
    lora_alpha: float | None = None,
    anchor: float = 1e-3,
    embedding_weight: float = 1.0,
    hidden_weight: float = 1.0,
    eval_every: int = 20,
    seed: int = 0,
    progress: bool | None = None,
) -> EndToEndReport:
    """Tune a converted Hugging Face encoder on its outputs against the teacher's.

    Parameters
    ----------
    student : nn.Module
        The converted model (changed in place), usually after
        :func:`~kernelattn_core.convert.distill_attention`.
    teacher : nn.Module
        The original model (only run).
    batches : sequence of dict
        Training inputs (``input_ids``, ``attention_mask``), taken in turn, one per step;
        long packed sequences (the target length) are the point.
    validation : sequence of dict, optional
        Inputs for early stopping: the parameters with the lowest validation loss are
        kept. They should come from the fitting corpus (a part not trained on), never
        from the evaluation text.
    steps : int
        Adam steps (0: nothing is done).
    lr : float
        Adam learning rate (the adapters and the estimators alike).
    lora_rank : int
        Rank of the adapters of the query/key/value projections (0: none).
    lora_alpha : float, optional
        Adapter scale :math:`\\alpha` (default: the rank, so the scale is 1).
    anchor : float
        :math:`\\lambda` of the pull towards the starting parameters (0: none).
    embedding_weight, hidden_weight : float
        :math:`w_e` (sentence-embedding cosine) and :math:`w_h` (per-layer hidden-state
        relative error).
    eval_every : int
        Validation every this many steps (and at the end).
    seed : int
        Seeds the adapters' initial ``A``.
    progress : bool, optional
        Progress bar with the time remaining (default: when stderr is a terminal).

    Returns
    -------
    EndToEndReport
    """
    from .attention import converted_modules

    check_positive_int("steps", steps, minimum=0)
    check_positive_int("lora_rank", lora_rank, minimum=0)
    check_positive_int("eval_every", eval_every)
    for flag, value in (("lr", lr), ("anchor", anchor), ("embedding_weight", embedding_weight)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise InputError(f"{flag}: expected a finite number >= 0, got {value!r}")
    if not lr > 0:
        raise InputError(f"lr: expected a positive learning rate, got {lr!r}")
    if isinstance(hidden_weight, bool) or not isinstance(hidden_weight, int | float) or hidden_weight < 0:
        raise InputError(f"hidden_weight: expected a number >= 0, got {hidden_weight!r}")
    if not embedding_weight and not hidden_weight:
        raise InputError("embedding_weight, hidden_weight: at least one must be positive")
    batches = list(batches)
    if not batches:
        raise InputError("batches: expected at least one batch of inputs")
    for b in [*batches, *(validation or [])]:
        if not isinstance(b, dict) or "input_ids" not in b or "attention_mask" not in b:
            raise InputError("batches: expected dicts with input_ids and attention_mask (Hugging Face inputs)")
    if not converted_modules(student):
        raise InputError("student: no converted attention layer (use convert_attention first)")
    start = time.perf_counter()
    report = EndToEndReport(steps=steps, parameters=0, lora_rank=lora_rank)
    if steps == 0:
        return report

    modes = student.training, teacher.training
    student.eval()
    teacher.eval()
    flags = {p: p.requires_grad for p in student.parameters()}
    for p in student.parameters():
        p.requires_grad_(False)
    attached = (
        attach_adapters(student, lora_rank, float(lora_alpha or lora_rank), seed, ENCODER_TARGETS) if lora_rank else []
    )
    params = [p for _, m in converted_modules(student) for p in m.estimator.parameters() if flags.get(p, False)]
    params += [p for _, _, w in attached for p in (w.lora_a, w.lora_b)]
    for p in params:
        p.requires_grad_(True)
    report.parameters = sum(p.numel() for p in params)
    start_values = [p.detach().clone() for p in params]
    checks = list(validation) if validation else batches[: max(1, min(len(batches), 4))]
    cache: dict[int, tuple[torch.Tensor, ...]] = {}

    def target(i: int, batch: dict[str, torch.Tensor], store: bool) -> tuple[torch.Tensor, ...]:
        if i in cache:
            return cache[i]
        with torch.no_grad():
            hidden = tuple(h.detach() for h in _hidden(teacher, batch))
        if store:
            cache[i] = hidden
        return hidden

    @torch.no_grad()
    def validate() -> float:
        values = [
            float(_loss(student, target(-1 - i, b, True), b, embedding_weight, hidden_weight))
            for i, b in enumerate(checks)
        ]
        return sum(values) / len(values)

    bar = _Bar(steps, "end-to-end", progress)
    merged = False
    try:
        best = validate()
        report.loss_before = best
        best_values = [p.detach().clone() for p in params]
        report.best_step = 0
        opt = torch.optim.Adam(params, lr=lr)
        running = 0.0
        for step in range(1, steps + 1):
            batch = batches[(step - 1) % len(batches)]
            value = _loss(student, target(step - 1, batch, len(batches) <= 64), batch, embedding_weight, hidden_weight)
            if anchor:
                value = value + anchor * anchor_penalty(params, start_values)
            opt.zero_grad()
            value.backward()
            opt.step()
            running = value.item() if step == 1 else 0.9 * running + 0.1 * value.item()
            bar.advance(f"end-to-end loss {running:.4f}")
            if step % eval_every == 0 or step == steps:
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
