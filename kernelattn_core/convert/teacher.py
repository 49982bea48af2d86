"""A causal teacher to fit: train a small GPT-2-style byte-level language model.

No pretrained decoder ships offline, so the project trains one on the fitting text it
ships (:func:`kernelattn_core.workloads.minilm.fitting_text`: English prose and the
documentation of 22 standard-library modules, about 71,000 bytes) and measures it on the
held-out text (the documentation of 10 other modules). The model is a
``transformers.GPT2LMHeadModel`` (the ``small`` size: 4 layers, width 256, 4 heads of 64,
3.5 million parameters) over bytes with ``transformers``' byte tokenizer
(``ByT5Tokenizer``: 3 special tokens, then the 256 byte values), so it needs no
vocabulary file and reads any text.

Command line (about 10 minutes on 2 CPU cores; the folder then loads with
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer``, or
:func:`kernelattn_core.convert.lm.load_decoder`)::

    python -m kernelattn_core.convert.teacher --output teacher/ --minutes 10

Fitting estimators to it and comparing held-out perplexities works with any local decoder
checkpoint the same way (:mod:`kernelattn_core.convert.lm`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import InputError
from .lm import pack_causal, perplexity

#: model sizes: ``small`` is the teacher of the docs; ``tiny`` trains in seconds (tests)
SIZES: dict[str, dict[str, int]] = {
    "small": {"n_embd": 256, "n_layer": 4, "n_head": 4, "n_positions": 1024},
    "tiny": {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 256},
}


@dataclass
class TeacherReport:
    """What :func:`train_teacher` did.

    Attributes
    ----------
    size : str
    parameters : int
    steps : int
        Optimiser steps of ``batch_size`` windows of ``context`` tokens.
    seconds : float
        Training time (evaluation excluded).
    train_tokens : int
        Tokens of the training text.
    final_loss : float
        Mean training loss (nats per token) over the last 10 % of the steps.
    held_out_perplexity : float or None
        Byte-level perplexity on the evaluation text (``None`` without one).
    """

    size: str
    parameters: int
    steps: int
    seconds: float
    train_tokens: int
    context: int
    batch_size: int
    final_loss: float
    held_out_perplexity: float | None = None


def byte_tokenizer() -> Any:
    """``transformers``' byte-level tokenizer (``ByT5Tokenizer``): needs no files."""
    import transformers

    return transformers.ByT5Tokenizer()


def teacher_model(size: str = "small", *, vocab_size: int = 384, seed: int = 0) -> nn.Module:
    """A freshly initialised GPT-2-style causal LM of ``size`` (:data:`SIZES`)."""
    import transformers

    if size not in SIZES:
        raise InputError(f"size: expected one of {sorted(SIZES)}, got {size!r}")
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=vocab_size, bos_token_id=1, eos_token_id=1, pad_token_id=0, **SIZES[size]
    )
    config._attn_implementation = "sdpa"
    return transformers.GPT2LMHeadModel(config)


def train_teacher(
    text: str,
    *,
    size: str = "small",
    context: int = 256,
    batch_size: int = 8,
    steps: int | None = None,
    minutes: float | None = 10.0,
    lr: float = 3e-3,
    seed: int = 0,
    eval_text: str | None = None,
    progress: bool | None = None,
) -> tuple[nn.Module, Any, TeacherReport]:
    """Train a byte-level GPT-2-style teacher on ``text``.

    Each step takes ``batch_size`` random windows of ``context + 1`` bytes of the text
    (AdamW, ``lr`` with a linear warm-up over the first 5 % of the steps and a cosine decay
    to 10 %, weight decay 0.1, gradient clipping at 1). The number of steps is ``steps``,
    or as many as fit in ``minutes``, whichever is smaller; the number is re-estimated
    every 5 steps from the pace of the last 20, so the schedule (warm-up, cosine decay)
    ends with the time budget even when the machine's load changes during the run.

    Returns
    -------
    (model, tokenizer, report)
        The model in eval mode.
    """
    tokenizer = byte_tokenizer()
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if ids.numel() < context + 2:
        raise InputError(f"text: expected more than context + 1 = {context + 1} bytes, got {ids.numel()}")
    if steps is None and minutes is None:
        raise InputError("steps: give steps, minutes or both")
    model = teacher_model(size, vocab_size=len(tokenizer), seed=seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    total = steps if steps is not None else 10**9
    budget = math.inf if minutes is None else 60.0 * minutes
    show = sys.stderr.isatty() if progress is None else progress
    losses: list[float] = []
    start = time.perf_counter()
    step = 0
    marks: list[float] = []  # when each of the last steps started
    while step < total:
        elapsed = time.perf_counter() - start
        marks = [*marks[-20:], elapsed]
        if step >= 5 and step % 5 == 0 and math.isfinite(budget):  # as many steps as fit in the time budget,
            # at the pace of the last (up to) 20 steps: on a shared machine the pace changes during the run
            pace = (marks[-1] - marks[0]) / (len(marks) - 1)
            fits = step + int(max(0.0, budget - elapsed) / max(pace, 1e-9))
            total = max(step + 1, fits if steps is None else min(steps, fits))
        if elapsed > budget:
            break
        warm = max(1, total // 20)
        frac = min(1.0, (step + 1) / warm) if step < warm else 0.1 + 0.45 * (1 + math.cos(math.pi * step / total))
        for group in opt.param_groups:
            group["lr"] = lr * frac
        starts = torch.randint(0, ids.numel() - context - 1, (batch_size,), generator=gen)
        window = torch.stack([ids[s : s + context + 1] for s in starts.tolist()])
        loss = model(input_ids=window[:, :-1], labels=window[:, :-1]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if show and step % 20 == 0:
            print(f"step {step}/{total} loss {losses[-1]:.3f} ({elapsed:.0f} s)", file=sys.stderr)
    seconds = time.perf_counter() - start
    model.eval()
    tail = losses[-max(1, len(losses) // 10) :]
    report = TeacherReport(
        size=size,
        parameters=sum(p.numel() for p in model.parameters()),
        steps=step,
        seconds=seconds,
        train_tokens=int(ids.numel()),
        context=context,
        batch_size=batch_size,
        final_loss=sum(tail) / len(tail),
    )
    if eval_text is not None:
        report.held_out_perplexity = perplexity(model, pack_causal(tokenizer, eval_text, max_length=context))
    return model, tokenizer, report


def main(argv: list[str] | None = None) -> int:
    """``python -m kernelattn_core.convert.teacher``: train and save a teacher."""
    parser = argparse.ArgumentParser(
        prog="python -m kernelattn_core.convert.teacher", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--output", required=True, help="folder to save the model, tokenizer and teacher.json")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--minutes", type=float, default=10.0, help="training time budget")
    parser.add_argument("--steps", type=int, default=None, help="at most this many steps")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fit-texts", default="fitting", help="training text: a file, 'fitting' or 'shipped'")
    parser.add_argument("--eval-texts", default="held-out", help="evaluation text: a file or 'held-out'")
    parser.add_argument(
        "--progress", action="store_true", help="a line on stderr every 20 steps (default: only on a terminal)"
    )
    args = parser.parse_args(argv)
    from ..workloads import minilm

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer, report = train_teacher(
        minilm.read_texts(args.fit_texts),
        size=args.size,
        context=args.context,
        batch_size=args.batch_size,
        steps=args.steps,
        minutes=args.minutes,
        lr=args.lr,
        seed=args.seed,
        eval_text=minilm.read_texts(args.eval_texts),
        progress=True if args.progress else None,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "teacher.json").write_text(json.dumps(asdict(report), indent=2) + "\n", "utf-8")
    print(json.dumps(asdict(report)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
